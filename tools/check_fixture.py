#!/usr/bin/env python3
"""Re-verify an oracle fixture written by tools/make_oracle_fixtures.py with the HF implementation.

    python3 tools/check_fixture.py tests/fixtures/oracle/NAME [--device cpu] [--greedy] [--tol 1e-4]
    python3 tools/check_fixture.py tests/fixtures/oracle/*/          # several at once

Reloads the checkpoint (HF layouts with from_pretrained in float32; the MLX layout is dequantized with
tools/mlx_format.mlx_to_hf and loaded into an HF model built from config.json), runs one no-cache
forward over prompt_ids.npy and compares with logits.npy. With --greedy it also recomputes the greedy
continuation and compares greedy_ids.npy exactly. It also checks the int64 PLE buffers stored in an
HF checkpoint against the ones HF derives from the config, and the file hashes in meta.json.
Exit status 0 when every fixture passes.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import warnings

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS_DIR)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mlx_format  # noqa: E402

PLE_BUFFERS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")


def _load_tensors(d: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for fn in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        out.update(load_file(fn))
    return out


def _model_class(config: dict):
    import transformers

    arch = (config.get("architectures") or [None])[0]
    if arch is None:
        arch = "Qwen4ExpForCausalLM" if config["model_type"] == "qwen4_exp_text" else \
            "Qwen4ExpForConditionalGeneration"
    return getattr(transformers, arch)


def load_model(d: str, device: str):
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    cls = _model_class(config)
    quant = config.get("quantization") or config.get("quantization_config")
    if quant is None:
        model = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
        return model.eval().to(device), config, "hf"
    # MLX: build the HF model from the config (minus the quantization keys), dequantize, load
    from transformers import AutoConfig

    cfg_dict = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    cfg = AutoConfig.for_model(**cfg_dict)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    tcfg = cfg.get_text_config()
    prefix = "model." if cfg.model_type == "qwen4_exp_text" else "model.language_model."
    sd, _ = mlx_format.mlx_to_hf(_load_tensors(d), tcfg.to_dict(), quant, prefix=prefix, experts="fused")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad = [k for k in missing if not k.startswith("model.visual.") and not k.endswith(PLE_BUFFERS)
           and not (k == "lm_head.weight" and tcfg.tie_word_embeddings)]
    if bad or unexpected:
        raise RuntimeError(f"MLX state dict mismatch: missing {bad}, unexpected {unexpected}")
    return model.to(device), config, "mlx"


def check(d: str, device: str, greedy: bool, tol: float) -> bool:
    d = d.rstrip("/")
    name = os.path.basename(d)
    ok = True
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    for fn, h in meta.get("files", {}).items():
        p = os.path.join(d, fn)
        hh = hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.exists(p) else None
        if hh != h:
            print(f"  {name}: {fn} sha256 mismatch or missing")
            ok = False
    prompt = np.load(os.path.join(d, "prompt_ids.npy"))
    ref = np.load(os.path.join(d, "logits.npy"))
    model, config, kind = load_model(d, device)
    tcfg = model.config.get_text_config()
    if kind == "hf":
        # stored int64 PLE buffers must equal what HF derives from the config (they are never floats)
        stored = _load_tensors(d)
        fresh = dict(model.named_buffers())
        for k, v in stored.items():
            if k.endswith(PLE_BUFFERS):
                if v.dtype != torch.int64 or not torch.equal(v, fresh[k].cpu()):
                    print(f"  {name}: buffer {k} differs from the HF-derived value")
                    ok = False
    with torch.no_grad():
        ids = torch.from_numpy(prompt).to(device)
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float().cpu().numpy()
    scale = float(np.abs(ref).max())
    diff = float(np.abs(logits - ref).max())
    rel_l2 = float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
    argmax_same = float((logits.argmax(-1) == ref.argmax(-1)).mean())
    exact = bool(np.array_equal(logits, ref))
    good = diff <= tol * max(scale, 1.0)
    ok &= good
    print(f"  {name} [{kind}, {config.get('model_type')}, V={tcfg.vocab_size}]: logits max|diff| {diff:.3g} "
          f"(max|logit| {scale:.3g}, rel-L2 {rel_l2:.3g}, argmax agree {argmax_same:.3f}, "
          f"bit-exact {exact}) -> {'OK' if good else 'FAIL'}")
    if greedy:
        want = np.load(os.path.join(d, "greedy_ids.npy"))
        cur = ids
        got = []
        with torch.no_grad():
            for _ in range(len(want)):
                last = model(input_ids=cur[None], use_cache=False).logits[0, -1]
                nxt = int(torch.argmax(last))
                got.append(nxt)
                cur = torch.cat([cur, torch.tensor([nxt], device=device, dtype=cur.dtype)])
        same = got == [int(x) for x in want]
        ok &= same
        print(f"  {name}: greedy {len(want)} tokens {'match' if same else 'DIFFER'}"
              + ("" if same else f": got {got}, want {want.tolist()}"))
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="fixture directories")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--greedy", action="store_true", help="also recompute the greedy continuation")
    ap.add_argument("--tol", type=float, default=1e-4,
                    help="max |logit diff| allowed, relative to max(1, max |logit|) (default 1e-4)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(max(1, args.threads))
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ok = True
    for d in args.dirs:
        if not os.path.exists(os.path.join(d, "meta.json")):
            continue
        try:
            ok &= check(d, args.device, args.greedy, args.tol)
        except Exception as e:  # report and continue with the next fixture
            print(f"  {d}: ERROR {type(e).__name__}: {e}")
            ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
