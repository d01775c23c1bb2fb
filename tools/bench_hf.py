#!/usr/bin/env python3
"""Hugging Face transformers on the benchmark geometry: the peer figure beside bench_cuda.

Builds Qwen4ExpForCausalLM (transformers 5.17.0) with the released model's geometry and N trunk layers
(the same geometry bench_cuda --synth-layers N uses: hidden 2560, 512 experts top-10 of 640, hc 4,
GDN 16/48 heads, QSA every 4th layer, PLE on layer id 2), random bf16 weights on the GPU (HF cannot
run MLX 4-bit codes, so its weights are bf16: 4x the bytes per weight of ours), and times
  decode: one token per forward with the KV/recurrent cache, median over --steps steps;
  prefill: one forward over T tokens (no cache reuse), for each T in --prefill.
Prints one line per figure; run on the GPU machine (scripts/gpu_check.sh calls it when torch exists).
  python3 tools/bench_hf.py --layers 16 --prefill 512,2048
"""
import argparse
import statistics
import time


def geometry(layers: int, experts: int = 512, vocab: int = 248320):
    from transformers import Qwen4ExpTextConfig
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    return Qwen4ExpTextConfig(
        vocab_size=vocab, hidden_size=2560, num_hidden_layers=layers, layer_types=types,
        hc_count=4, hc_lowrank=320, head_dim=256, num_attention_heads=24, num_key_value_heads=2,
        indexer_budget=2048, indexer_compress_ratio=4, indexer_head_dim=128, indexer_kv_heads=1, indexer_n_heads=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_value_head_dim=128, moe_intermediate_size=640, shared_expert_intermediate_size=640,
        num_experts=experts, num_experts_per_tok=10, norm_topk_prob=True, output_gate_type="sigmoid",
        heads_per_ngram=8, ngram_size=3, ngram_vocab_size_base=20000, make_ngram_vocab_size_divisible_by=128,
        split_ngram_parts=128, ple_conv_kernel_size=4, ple_embed_dim=2560, ple_layer_ids=[2] if layers >= 2 else [],
        rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        bos_token_id=0, eos_token_id=0, pad_token_id=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens before the timed decode steps")
    ap.add_argument("--experts", type=int, default=512, help="smaller only for a smoke test")
    ap.add_argument("--vocab", type=int, default=248320, help="smaller only for a smoke test")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import Qwen4ExpForCausalLM
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    cfg = geometry(a.layers, a.experts, a.vocab)
    t0 = time.perf_counter()
    with torch.device(a.device):
        model = Qwen4ExpForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    sync()
    print(f"hf: transformers {transformers.__version__}, torch {torch.__version__}, {a.layers} layers, "
          f"{n_params / 1e9:.2f} B params bf16 ({n_params * 2 / 1e9:.1f} GB), built in {time.perf_counter() - t0:.1f} s",
          flush=True)
    V = cfg.vocab_size
    gen = torch.Generator(device=a.device).manual_seed(1)
    with torch.inference_mode():
        ids = torch.randint(1, V, (1, a.context), device=a.device, generator=gen)
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for i in range(a.steps + 2):
            sync()
            t = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            sync()
            if i >= 2:
                times.append(time.perf_counter() - t)
        med = statistics.median(times)
        print(f"hf decode  1 row/step   {1 / med:8.1f} tok/s  ({med * 1e3:.2f} ms/step, median of {len(times)})",
              flush=True)
        for T in [int(x) for x in a.prefill.split(",") if x]:
            ids = torch.randint(1, V, (1, T), device=a.device, generator=gen)
            model(input_ids=ids[:, :64], use_cache=False)  # warm-up of the kernels this length uses
            sync()
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            sync()
            sec = time.perf_counter() - t
            print(f"hf prefill {T:5d} tokens  {T / sec:8.1f} tok/s  ({sec:.3f} s)", flush=True)


if __name__ == "__main__":
    main()
