"""Corpus and tokenizer of the small qwen4_exp model (tools/train_small_model.py).

Corpus: the source and documentation files (*.py, *.md, *.rst, *.txt) of the running interpreter's
standard library and installed packages (site-packages / dist-packages), read in a deterministic order,
deduplicated by content, split train/held-out by content hash (a file is held out iff
int(sha1(content)[:8], 16) % 1000 < val_permille), capped in bytes. Documents are joined with
<|endoftext|>.
Tokenizer: byte-level BPE trained with HF `tokenizers`, Qwen-style: NFC normalizer, the Qwen split
regex (copied from the Qwen3 tokenizer.json) + ByteLevel pre-tokenizer, ByteLevel decoder; special
tokens appended after the BPE vocabulary as Qwen does.
"""
from __future__ import annotations

import hashlib
import json
import os
import site
import sys
import sysconfig

EXTENSIONS = (".py", ".md", ".rst", ".txt")
SKIP_DIRS = {"__pycache__", ".git", "node_modules"}
MAX_FILE_BYTES = 400_000
MAX_LINE_CHARS = 1000

# Qwen2/2.5/3 pre-tokenizer split pattern (shared/data/qwen3-tokenizer/tokenizer.json).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special, as in Qwen3 (the chat template emits them as text).
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# The Qwen3 chat template, unchanged (shared/data/qwen3-tokenizer/tokenizer_config.json).
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


# ---------------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------------


def source_roots() -> list[tuple[str, str]]:
    """(tag, directory) for the stdlib and every site-/dist-packages directory of this interpreter."""
    roots = []
    stdlib = sysconfig.get_paths().get("stdlib")
    if stdlib:
        roots.append(("stdlib", stdlib))
    pkgs = set()
    for p in list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path + [
        sysconfig.get_paths().get("purelib", ""), sysconfig.get_paths().get("platlib", "")
    ]:
        if p and os.path.isdir(p) and os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages"):
            pkgs.add(os.path.realpath(p))
    for p in sorted(pkgs):
        roots.append(("pkgs", p))
    return roots


def _walk(root: str, skip_pkg_dirs: bool):
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in SKIP_DIRS and not d.endswith((".dist-info", ".egg-info"))
            and not (skip_pkg_dirs and d in ("site-packages", "dist-packages"))
        )
        for f in sorted(filenames):
            if f.endswith(EXTENSIONS):
                yield os.path.join(dirpath, f)


def _acceptable(text: str) -> bool:
    if len(text) < 64 or "\x00" in text:
        return False
    return max((len(line) for line in text.split("\n")), default=0) <= MAX_LINE_CHARS


def collect_corpus(max_train_bytes: int, max_val_bytes: int, val_permille: int = 20, log=print):
    """Returns dict(train=[str], val=[str], stats, fingerprint). Deterministic for a given file set."""
    seen_real, seen_content = set(), set()
    entries = []  # (sha1, key, text)
    n_files = n_skipped = 0
    for tag, root in source_roots():
        for path in _walk(root, skip_pkg_dirs=(tag == "stdlib")):
            real = os.path.realpath(path)
            if real in seen_real:
                continue
            seen_real.add(real)
            n_files += 1
            try:
                if os.path.getsize(path) > MAX_FILE_BYTES:
                    n_skipped += 1
                    continue
                with open(path, "rb") as fh:
                    raw = fh.read()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                n_skipped += 1
                continue
            text = text.replace("\r\n", "\n")
            if not _acceptable(text):
                n_skipped += 1
                continue
            h = hashlib.sha1(text.encode("utf-8")).hexdigest()
            if h in seen_content:
                continue
            seen_content.add(h)
            entries.append((h, f"{tag}:{os.path.relpath(path, root)}", text))
    # Hash order = a fixed pseudo-random order: a byte cap keeps a sample of every package.
    entries.sort(key=lambda e: e[0])
    train, val, train_keys, val_keys = [], [], [], []
    tb = vb = 0
    for h, key, text in entries:
        nbytes = len(text.encode("utf-8"))
        if int(h[:8], 16) % 1000 < val_permille:
            if vb < max_val_bytes:
                val.append(text)
                val_keys.append(key)
                vb += nbytes
        elif tb < max_train_bytes:
            train.append(text)
            train_keys.append(key)
            tb += nbytes
    fp = hashlib.sha1("\n".join(h for h, _, _ in entries).encode()).hexdigest()[:16]
    stats = dict(files_seen=n_files, files_skipped=n_skipped, unique_docs=len(entries),
                 train_docs=len(train), train_bytes=tb, val_docs=len(val), val_bytes=vb,
                 roots=[r for _, r in source_roots()], val_permille=val_permille,
                 val_examples=val_keys[:10])
    log(f"[data] {n_files} files, {len(entries)} unique docs; train {len(train)} docs {tb / 1e6:.1f} MB, "
        f"held-out {len(val)} docs {vb / 1e6:.2f} MB; fingerprint {fp}")
    return dict(train=train, val=val, stats=stats, fingerprint=fp)


# ---------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int, max_bytes: int, log=print):
    """Byte-level BPE, Qwen style. The result has exactly vocab_size tokens when the corpus allows
    (BPE merges fill vocab_size - len(specials) - len(added)); specials and added tokens come last."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                            trainers)

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    n_extra = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_extra,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def sample():
        used = 0
        for d in docs:
            if used >= max_bytes:
                break
            used += len(d)
            yield d

    tok.train_from_iterator(sample(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    log(f"[tok] trained byte-level BPE: {tok.get_vocab_size()} tokens")
    return tok


def token_ids(tok) -> dict:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}


def write_tokenizer_files(tok, out_dir: str, model_max_length: int = 8192) -> None:
    """tokenizer.json, tokenizer_config.json (Qwen3 style, with chat_template), chat_template.jinja."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = token_ids(tok)
    decoder = {}
    for t in SPECIAL_TOKENS + ADDED_TOKENS:
        decoder[str(ids[t])] = dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False,
                                    special=t in SPECIAL_TOKENS)
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as fh:
        fh.write(QWEN3_CHAT_TEMPLATE)


def write_generation_config(tok, out_dir: str) -> None:
    ids = token_ids(tok)
    gen = {
        "bos_token_id": None,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump(gen, fh, indent=2)
        fh.write("\n")


def encode_docs(tok, docs: list[str], eos_id: int, log=print, label=""):
    """Concatenate docs as  doc0 <eot> doc1 <eot> ...  -> numpy int32 array."""
    import numpy as np

    out = []
    batch = 2048
    for i in range(0, len(docs), batch):
        for enc in tok.encode_batch(docs[i : i + batch], add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.int32))
            out.append(np.asarray([eos_id], dtype=np.int32))
    arr = np.concatenate(out) if out else np.zeros(0, dtype=np.int32)
    log(f"[tok] {label}: {len(docs)} docs -> {arr.size:,} tokens")
    return arr
