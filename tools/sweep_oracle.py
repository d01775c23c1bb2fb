#!/usr/bin/env python3
"""Oracle fixtures of random geometry: the general model, not only the committed fixtures' shapes.

    python3 tools/sweep_oracle.py --out /tmp/ck-sweep --count 12 --seed 1
    CK_ORACLE_FIXTURES=/tmp/ck-sweep ./build/test_cpu_reference          # the CPU reference on them
    CK_ORACLE_FIXTURES=/tmp/ck-sweep ./build/test_cuda_model             # the CUDA engine (GPU machine)

The committed fixtures (tools/make_oracle_fixtures.py, tests/fixtures/oracle/) pin five geometries. The
judge of the engine is the Hugging Face implementation on any valid config, so this tool draws configs
at random from the space src/format/config.cpp accepts (hidden size, head counts and dims, GDN key and
value heads and dims, conv kernel, layer pattern, experts and top-k, hyper-connection streams and low
rank, QSA indexer heads, budget and compress ratio, RoPE fraction, PLE layers and n-gram sizes, output
gate, tied embeddings, float32 / bfloat16 / MLX storage of 2-8 bits in groups of 32-128, flat or nested
configs, one file or shards) and writes one fixture a config with make_oracle_fixtures.make_fixture:
the same oracle run (float32, sdpa, no cache), the same rejection of seeds whose router, indexer or
greedy decisions are closer than the tests' tolerances, the same files. A fixture's name starts with
its draw (sweep_SEED_...), so a failing case can be made again alone (--seed SEED --count 1, with the
same --bits and --prompt-len).

The fixtures are not committed (they are as many as one asks for); the tests read them through the
environment variable CK_ORACLE_FIXTURES, which replaces tests/fixtures/oracle for every test that
iterates over the oracle fixtures (tests/common/fixtures.h).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS_DIR)

import make_oracle_fixtures as mof  # noqa: E402


def draw_text(rng: random.Random) -> tuple[dict, str]:
    """One random text config within config.cpp's rules, and its storage (float32, bfloat16 or mlx; the
    MLX width and group are drawn in make_fx).

    A quarter of the draws are "large": MLX 4-bit, hidden size and low rank multiples of 64 from 256,
    so that the CUDA engine's own forms run on them (weights in 16-row tensor-core tiles from K = 256,
    the one-row mix kernel, the 4-bit expert kernels), not only its fallbacks for tiny shapes."""
    t: dict = {}
    large = rng.random() < 0.25
    storage = "mlx" if large else rng.choice(["float32", "bfloat16", "mlx", "mlx"])
    mlx = storage.startswith("mlx")
    # Under MLX a matrix is quantized where its input dimension is a multiple of the group size, so the
    # sizes there are multiples of 64 mostly (with one odd size left in bf16 now and then).
    sizes = [256, 320, 512] if large else [64, 128] if mlx else [32, 48, 64, 96]
    t["hidden_size"] = rng.choice(sizes)
    layers = rng.randint(2, 3) if large else rng.randint(2, 6)
    t["num_hidden_layers"] = layers
    kinds = [rng.random() < 0.6 for _ in range(layers)]  # True: linear_attention
    if all(kinds):
        kinds[rng.randrange(layers)] = False
    if not any(kinds):
        kinds[rng.randrange(layers)] = True
    t["layer_types"] = ["linear_attention" if k else "full_attention" for k in kinds]
    # Attention (QSA) and its indexer.
    kv = rng.choice([1, 2])
    t["num_key_value_heads"] = kv
    t["num_attention_heads"] = kv * rng.choice([1, 2, 3, 4])
    t["head_dim"] = rng.choice([64, 128] if large else [16, 32, 64])
    factor = rng.choice([0.25, 0.5, 1.0])
    rot = int(t["head_dim"] * factor)
    if rot % 2 or rot == 0:
        factor, rot = 1.0, t["head_dim"]
    t["rope_parameters"] = {"rope_type": "default", "rope_theta": rng.choice([10000.0, 1000000.0]),
                            "partial_rotary_factor": factor}
    # A block's score is a sum over the indexer heads of relu(q . k): with one head about half the blocks
    # score exactly 0, and ties at 0 for the last kept block make the oracle's choice arbitrary (such
    # seeds are rejected), so most draws have a few heads.
    t["indexer_n_heads"] = rng.choice([1, 2, 4, 4, 6, 8])
    t["indexer_kv_heads"] = 1
    t["indexer_head_dim"] = max(rot, rng.choice([64, 128] if large else [16, 32, 64]))
    ratio = rng.choice([2, 4, 8])
    t["indexer_compress_ratio"] = ratio
    t["indexer_budget"] = ratio * rng.choice([1, 2, 3, 4])
    # Gated DeltaNet.
    nk = rng.choice([1, 2, 3])
    t["linear_num_key_heads"] = nk
    t["linear_num_value_heads"] = nk * rng.choice([1, 2, 3])
    t["linear_key_head_dim"] = rng.choice([64, 128] if large else [8, 12, 16, 32])
    t["linear_value_head_dim"] = rng.choice([64, 128] if large else [8, 16, 24, 32])
    t["linear_conv_kernel_dim"] = rng.choice([2, 3, 4, 5])
    # Experts.
    E = rng.choice([4, 8, 16, 32, 64])
    t["num_experts"] = E
    t["num_experts_per_tok"] = rng.randint(1, min(8, E))
    t["norm_topk_prob"] = rng.random() < 0.5
    t["moe_intermediate_size"] = rng.choice([128, 256] if large else [64, 128] if mlx else [16, 32, 48, 64])
    t["shared_expert_intermediate_size"] = rng.choice([128, 256] if large else [64, 128] if mlx else [16, 32, 64])
    # Hyper-connections, gate, embeddings.
    t["hc_count"] = rng.choice([2, 3, 4])
    t["hc_lowrank"] = rng.choice([64, 128] if large else [8, 16, 32])
    t["output_gate_type"] = rng.choice(["sigmoid", "silu"])
    t["tie_word_embeddings"] = rng.random() < 0.3
    t["vocab_size"] = rng.choice([512, 1024] if large else [256, 320, 384])
    t["eos_token_id"] = rng.randint(2, 9)
    t["bos_token_id"] = 1
    # PLE on some of the GDN layers (one-indexed), or none.
    linear_ids = [i + 1 for i, k in enumerate(kinds) if k]
    if linear_ids and rng.random() < 0.7:
        t["ple_layer_ids"] = sorted(rng.sample(linear_ids, rng.randint(1, len(linear_ids))))
        t["ngram_size"] = rng.choice([2, 3, 4])
        t["heads_per_ngram"] = rng.choice([2, 4, 8])
        heads = (t["ngram_size"] - 1) * t["heads_per_ngram"]
        t["ple_embed_dim"] = heads * rng.choice([2, 4, 8])
        t["ple_conv_kernel_size"] = rng.choice([2, 3, 4])
        t["ngram_vocab_size_base"] = rng.choice([64, 100])
        t["split_ngram_parts"] = rng.choice([1, 2])
    else:
        t["ple_layer_ids"] = []
    return t, storage


def make_fx(seed: int, bits_allowed: tuple[int, ...] = (2, 3, 4, 5, 6, 8), prompt_len: tuple[int, int] = (40, 90)) -> dict:
    rng = random.Random(seed)
    text, storage = draw_text(rng)
    mlx = None
    if storage.startswith("mlx"):
        # Large draws keep 4-bit groups of 64 (the released form); the others take any MLX width the
        # parser accepts (and --bits allows) in groups of 32, 64 or 128: a matrix whose input dimension is
        # not a multiple of its group stays bf16, so mixed checkpoints come out too.
        large = text["hidden_size"] >= 256
        bits = 4 if large else rng.choice([b for b in bits_allowed if b != 4] + [4, 4])
        group = 64 if large else rng.choice([32, 64, 64, 128])
        mlx = dict(bits=bits, group_size=group, ngram_group_size=32, router_bits=rng.choice([8, None]))
        storage = f"mlx{bits}g{group}"
    name = f"sweep_{seed:05d}_{storage}_h{text['hidden_size']}_l{text['num_hidden_layers']}_e{text['num_experts']}" \
           f"k{text['num_experts_per_tok']}_hc{text['hc_count']}"
    fx = dict(
        name=name,
        # layer_types as drawn (with "full_attention" entries, like the release) or as save_pretrained
        # writes them ("qwen_sparse_attention")
        layer_types_in_config=rng.choice(["as-given", "hf"]),
        seed=10_000 + seed,
        form="flat",
        layout="mlx" if mlx else rng.choice(["hf-per-expert", "hf-fused"]),
        storage=storage if not mlx else f"mlx-q{mlx['bits']}-g{mlx['group_size']}",
        max_shard_size=None,
        T=rng.randint(*prompt_len),
        N=8,
        description=f"sweep draw {seed} (tools/sweep_oracle.py)",
        text=mof._text(**text),
    )
    if mlx or rng.random() < 0.3:  # the multimodal config (text_config, a tiny vision tower to skip)
        fx["form"] = "nested"
        fx["vision"] = dict(mof._TINY_VISION)
    if mlx:
        fx["mlx"] = mlx
    elif rng.random() < 0.25 and fx["layout"] == "hf-per-expert":
        # several safetensors files and their index (make_oracle_fixtures fuses experts file by file, so
        # the fused layout stays in one)
        fx["max_shard_size"] = "200KB"
    return fx


def _quiet_torch() -> None:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    mof.torch.set_num_threads(1)
    mof.torch.set_float32_matmul_precision("highest")
    mof.torch.use_deterministic_algorithms(True, warn_only=True)


def _make_one(job: tuple) -> tuple:
    """One draw in a worker: (name, meta or None, log lines, error or None)."""
    seed, out, device, attempts, bits, prompt_len = job
    _quiet_torch()
    fx = make_fx(seed, bits, prompt_len)
    lines: list[str] = []
    try:
        meta = mof.make_fixture(fx, out, device, attempts, lines.append)
        return fx["name"], meta, lines, None
    except Exception as e:  # a draw no seed could make acceptable, or one HF rejects: say so, go on
        return fx["name"], None, lines, f"{type(e).__name__}: {str(e)[:300]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/ck-sweep", help="output directory (default /tmp/ck-sweep)")
    ap.add_argument("--count", type=int, default=8, help="how many configs (default 8)")
    ap.add_argument("--seed", type=int, default=1, help="first draw (draws seed .. seed + count - 1)")
    ap.add_argument("--max-attempts", type=int, default=20, help="weight seeds tried per config")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--jobs", type=int, default=1, help="draws made at once, one process each (default 1)")
    ap.add_argument("--bits", default="2,3,4,5,6,8",
                    help="MLX code widths to draw from (default all the parser takes; the CUDA engine takes "
                         "2,3,4,8). A draw depends on it: repeat a draw with the same --bits")
    ap.add_argument("--prompt-len", default="40,90",
                    help="prompt lengths drawn from LO,HI (default 40,90; longer prompts select among more "
                         "indexer blocks and cross more 64-row DeltaNet chunks, and take the oracle longer)")
    args = ap.parse_args(argv)
    try:
        prompt_len = tuple(int(v) for v in args.prompt_len.split(","))
    except ValueError:
        prompt_len = ()
    if len(prompt_len) != 2 or not 2 <= prompt_len[0] <= prompt_len[1]:
        ap.error(f"--prompt-len {args.prompt_len}: expected LO,HI with 2 <= LO <= HI")
    bits = tuple(int(b) for b in args.bits.split(","))
    if not bits or any(b not in (2, 3, 4, 5, 6, 8) for b in bits):
        ap.error(f"--bits {args.bits}: expected widths from 2, 3, 4, 5, 6, 8")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    jobs = [(seed, args.out, args.device, args.max_attempts, bits, prompt_len)
            for seed in range(args.seed, args.seed + args.count)]
    made, failed = 0, []

    def report(result: tuple) -> None:
        nonlocal made
        name, meta, lines, err = result
        print(f"[{time.time() - t0:6.1f}s] {name}: " +
              (f"skipped: {err}" if err else
               f"seed {meta['seed']} ({meta['attempts']} attempt(s)), greedy margin {meta['min_greedy_margin']:.3g}, "
               f"{meta['generation_seconds']:.1f} s"), flush=True)
        for line in lines:
            print(line, flush=True)
        if err:
            failed.append(f"{name}: {err}")
        else:
            made += 1

    if args.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.jobs) as pool:
            for result in pool.imap_unordered(_make_one, jobs):
                report(result)
    else:
        for job in jobs:
            report(_make_one(job))
    print(f"done: {made} fixture(s) in {args.out}, {len(failed)} draw(s) skipped, {time.time() - t0:.1f} s")
    return 0 if made > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
