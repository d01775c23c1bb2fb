#!/usr/bin/env python3
"""Write oracle fixtures for tiny random `qwen4_exp` models, computed with the Hugging Face
implementation (transformers 5.17.0) in float32.

    python3 tools/make_oracle_fixtures.py --device cpu  --out tests/fixtures/oracle
    python3 tools/make_oracle_fixtures.py --device cuda --out tests/fixtures/oracle   # the GPU oracle

Each fixture is a directory <out>/<name>/ with
  config.json, model*.safetensors (+ model.safetensors.index.json when sharded)  the checkpoint
  prompt_ids.npy     int64 [T]          random ids with the EOS id inserted a few times
  logits.npy         float32 [T, V]     logits at every prompt position, ONE no-cache forward
  greedy_ids.npy     int64 [N]          greedy continuation (argmax, ties -> lowest index), each step a
                                        full no-cache forward over prompt + generated ids
  greedy_margins.npy float32 [N]        top-1 minus top-2 logit at each greedy step
  meta.json          what it covers, seeds, regenerate command, versions, device, min top-k gaps, ...

Determinism: the weights (and their scaling) and the prompt are made on the CPU from the fixture's
seed, whatever --device says; only the oracle forwards run on --device. A seed is rejected (and the
next one tried) when a router or indexer top-k boundary is nearly tied (spec trap 28/29) or a greedy
margin is tiny. The gap definitions (scale-relative, conservative):
  router : (l_(k) - l_(k+1)) / max_j |l_j|   on the router logits of each token (softmax is monotone)
  indexer: (s_(k) - s_(k+1)) / s_(1)        on the block scores of each query whose top-k drops blocks
Only decisions that can change the result are recorded (k < number of candidates).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
import warnings

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TOOLS_DIR)
sys.path.insert(0, TOOLS_DIR)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mlx_format  # noqa: E402

DEFAULT_OUT = os.path.join("tests", "fixtures", "oracle")
ROUTER_GAP_MIN = 1e-4
INDEXER_GAP_MIN = 1e-4
GREEDY_MARGIN_MIN = 1e-3

# ------------------------------------------------------------------------------------------------
# Fixture definitions
# ------------------------------------------------------------------------------------------------

_BASE_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    hc_count=2,
    hc_lowrank=16,
    ple_layer_ids=[2],
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=100,
    make_ngram_vocab_size_divisible_by=128,
    seed=1234,
    split_ngram_parts=2,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=32,
    indexer_budget=8,
    indexer_compress_ratio=4,
    tie_word_embeddings=False,
    output_gate_type="sigmoid",
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)

_TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=2,
    temporal_patch_size=1,
    spatial_merge_size=1,
    in_channels=3,
    num_position_embeddings=4,
)


def _text(**kw):
    d = copy.deepcopy(_BASE_TEXT)
    d.update(kw)
    return d


FIXTURES = [
    dict(
        name="hf_f32_flat_hc2_e8k1",
        layer_types_in_config="default",
        seed=101,
        form="flat",
        layout="hf-per-expert",
        storage="float32",
        max_shard_size=None,
        T=80,
        N=16,
        description="Flat qwen4_exp_text (Qwen4ExpForCausalLM, prefix model.), weights stored fully float32, "
        "single model.safetensors, per-expert experts; hc_count 2, 8 experts top-1 (norm_topk_prob true), "
        "sigmoid output gate, PLE on one GDN layer (ple_layer_ids [2]) with ngram_size 3 and the n-gram "
        "table in 2 shards, config.json has neither layer_types nor full_attention_interval (HF derives "
        "GDN, GDN, GDN, QSA with the default interval 4), partial_rotary_factor 0.25, "
        "indexer budget 8 / compress ratio 4 (2 of up to 20 blocks kept).",
        text=_text(
            vocab_size=256,
            eos_token_id=5,
            bos_token_id=4,
            indexer_n_heads=6,
            full_attention_interval=4,
            num_experts=8,
            num_experts_per_tok=1,
            norm_topk_prob=True,
            hc_count=2,
            output_gate_type="sigmoid",
            ple_layer_ids=[2],
            ngram_size=3,
            heads_per_ngram=8,
            ngram_vocab_size_base=100,
            split_ngram_parts=2,
        ),
    ),
    dict(
        name="hf_bf16_nested_hc3_e64k6_sharded",
        layer_types_in_config="as-given",
        seed=202,
        form="nested",
        layout="hf-per-expert",
        storage="bfloat16",
        max_shard_size="400KB",
        T=96,
        N=16,
        description="Nested qwen4_exp config (Qwen4ExpForConditionalGeneration, text_config, prefix "
        "model.language_model., a tiny vision tower under model.visual.* to skip), bf16 weights, sharded "
        "model-0000K-of-0000N.safetensors + index json, per-expert experts; hc_count 3, 64 experts top-6 "
        "with norm_topk_prob false, silu output gate, PLE on two GDN layers (ple_layer_ids [1, 2]) with "
        "ngram_size 4, heads_per_ngram 4, 4 n-gram shards and hash seed 4321, explicit layer_types with "
        "'full_attention' entries, 5 layers, partial_rotary_factor 1.0 with mrope_section/interleaved keys, "
        "indexer 8 heads of dim 32 (RoPE on its first 16 dims only), budget 16 / ratio 4 (4 of up to 24 blocks kept), GQA 4:1.",
        text=_text(
            vocab_size=384,
            hidden_size=32,
            num_hidden_layers=5,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 1.0,
                             "mrope_section": [3, 3, 2], "mrope_interleaved": True},
            indexer_n_heads=8,
            indexer_head_dim=32,
            indexer_budget=16,
            indexer_compress_ratio=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            num_experts=64,
            num_experts_per_tok=6,
            norm_topk_prob=False,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            hc_count=3,
            hc_lowrank=8,
            output_gate_type="silu",
            ple_layer_ids=[1, 2],
            ngram_size=4,
            heads_per_ngram=4,
            ple_embed_dim=48,
            ngram_vocab_size_base=64,
            split_ngram_parts=4,
            seed=4321,
            eos_token_id=300,
            bos_token_id=299,
        ),
        vision=dict(_TINY_VISION),
    ),
    dict(
        name="hf_bf16_flat_hc4_e16k3_fused_tied",
        layer_types_in_config="interval",
        seed=303,
        form="flat",
        layout="hf-fused",
        storage="bfloat16",
        max_shard_size=None,
        T=72,
        N=16,
        description="Flat qwen4_exp_text, bf16, single file, experts rewritten FUSED "
        "(experts.gate_up_proj [E,2I,H] gate first, experts.down_proj [E,H,I]), tie_word_embeddings true "
        "(no lm_head.weight); hc_count 4, 16 experts top-3 (norm_topk_prob true), sigmoid gate, PLE on "
        "layer 3 (0-based 2, the second GDN layer, ple_layer_index 0), ngram_size 3, 4 n-gram shards, "
        "layer_types derived from full_attention_interval 2 (GDN, QSA, GDN, QSA; config.json has the interval, no "
        "layer_types), partial_rotary_factor 0.5, "
        "indexer budget 12 / ratio 4 (3 of up to 18 blocks), GQA 2:1, EOS = last vocab id. Tied head: the "
        "embedding is small (std 0.1) and the final mixer's hc_norm has 1 + w ~ 8 so the logits have std ~3.",
        text=_text(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=4,
            full_attention_interval=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            indexer_n_heads=6,
            indexer_head_dim=32,
            indexer_budget=12,
            indexer_compress_ratio=4,
            num_experts=16,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            hc_count=4,
            hc_lowrank=16,
            output_gate_type="sigmoid",
            ple_layer_ids=[3],
            ngram_size=3,
            heads_per_ngram=8,
            ngram_vocab_size_base=150,
            split_ngram_parts=4,
            tie_word_embeddings=True,
            eos_token_id=511,
            bos_token_id=510,
        ),
    ),
    dict(
        name="hf_bf16_flat_hc3_e32k5_ratio2",
        layer_types_in_config="hf",
        seed=404,
        form="flat",
        layout="hf-per-expert",
        storage="bfloat16",
        max_shard_size=None,
        T=88,
        N=20,
        description="Flat qwen4_exp_text, bf16, single file, per-expert; 3 layers (GDN, GDN, QSA, listed in config.json "
        "as save_pretrained writes them, 'qwen_sparse_attention'), hidden 48, hc_count 3, 32 experts top-5 with norm_topk_prob false, "
        "silu gate, PLE on BOTH GDN layers (ple_layer_ids [1, 2]) with ngram_size 3 and heads_per_ngram 4, "
        "make_ngram_vocab_size_divisible_by 64, hash seed 99, eos_token_id given as a LIST [7, 8] (HF uses "
        "element 0), partial_rotary_factor 0.75 (rotary 24 of head_dim 32), indexer compress ratio 2 with "
        "budget 10 (5 of up to 44 blocks), 3 query heads on 1 KV head.",
        text=_text(
            vocab_size=320,
            hidden_size=48,
            num_hidden_layers=3,
            full_attention_interval=3,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.75},
            indexer_n_heads=5,
            indexer_head_dim=32,
            indexer_budget=10,
            indexer_compress_ratio=2,
            linear_key_head_dim=12,
            linear_value_head_dim=12,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=32,
            num_experts_per_tok=5,
            norm_topk_prob=False,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            hc_count=3,
            hc_lowrank=24,
            output_gate_type="silu",
            ple_layer_ids=[1, 2],
            ngram_size=3,
            heads_per_ngram=4,
            ple_embed_dim=48,
            ngram_vocab_size_base=50,
            make_ngram_vocab_size_divisible_by=64,
            split_ngram_parts=2,
            seed=99,
            eos_token_id=[7, 8],
            bos_token_id=6,
        ),
    ),
    dict(
        name="mlx_q4g64_nested_hc4_e32k4",
        layer_types_in_config="interval",
        seed=505,
        form="nested",
        layout="mlx",
        storage="mlx-q4-g64",
        max_shard_size=None,
        T=80,
        N=16,
        description="MLX layout (docs/formats.md): prefix language_model.model. / language_model.lm_head., "
        "4-bit group-64 affine quantization with bf16 scales/biases, switch_mlp stacked experts, +1 folded "
        "into the zero-centred norms, conv weights [C,K,1], the n-gram table concatenated and quantized with "
        "group 32 (module override), routers (mlp.gate, mlp.shared_expert_gate) at 8 bits via module "
        "overrides, hc input_mix_weight_up (input dim 32, not a multiple of 64) left unquantized bf16 with a "
        "false override, int64 PLE buffers not stored; nested config with `quantization` and "
        "`quantization_config`. Model: hc_count 4, 32 experts top-4 (norm true), sigmoid gate, PLE on layer 1 "
        "(ngram 3, heads_per_ngram 2, row width 64 = 2 groups of 32), layer_types derived from "
        "full_attention_interval 2 (no layer_types in config.json), "
        "head_dim 64, partial_rotary_factor 0.25, indexer budget 16 / ratio 4. The logits are the oracle's "
        "for the DEQUANTIZED weights.",
        text=_text(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=4,
            full_attention_interval=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            indexer_n_heads=6,
            indexer_head_dim=64,
            indexer_budget=16,
            indexer_compress_ratio=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            hc_count=4,
            hc_lowrank=32,
            output_gate_type="sigmoid",
            ple_layer_ids=[1],
            ngram_size=3,
            heads_per_ngram=2,
            ple_embed_dim=256,
            ngram_vocab_size_base=100,
            split_ngram_parts=2,
            eos_token_id=2,
            bos_token_id=1,
        ),
        vision=dict(_TINY_VISION),
        mlx=dict(bits=4, group_size=64, ngram_group_size=32, router_bits=8),
    ),
]

# ------------------------------------------------------------------------------------------------
# Model construction, weight initialisation and calibration
# ------------------------------------------------------------------------------------------------


def build_config(fx: dict):
    from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

    text = copy.deepcopy(fx["text"])
    text["dtype"] = "float32"
    if fx["form"] == "flat":
        cfg = Qwen4ExpTextConfig(**text)
        cfg.architectures = ["Qwen4ExpForCausalLM"]
    else:
        vision = dict(fx["vision"])
        vision["out_hidden_size"] = text["hidden_size"]
        cfg = Qwen4ExpConfig(text_config=text, vision_config=vision,
                             tie_word_embeddings=text.get("tie_word_embeddings", False))
        cfg.architectures = ["Qwen4ExpForConditionalGeneration"]
        cfg.dtype = "float32"
    cfg._attn_implementation = "sdpa"
    return cfg


def text_cfg_of(cfg):
    return cfg.get_text_config()


def build_model(cfg):
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

    cls = Qwen4ExpForCausalLM if cfg.model_type == "qwen4_exp_text" else Qwen4ExpForConditionalGeneration
    model = cls(cfg).to(torch.float32).eval()
    return model


def hf_prefix(cfg) -> str:
    return "model." if cfg.model_type == "qwen4_exp_text" else "model.language_model."


def _rel(name: str) -> str | None:
    """Text-model-relative parameter name, or None for the vision tower."""
    if name.startswith("model.visual."):
        return None
    for p in ("model.language_model.", "model."):
        if name.startswith(p):
            return name[len(p):]
    return name  # lm_head.weight


@torch.no_grad()
def init_weights(model, tcfg, gen: torch.Generator) -> None:
    """Overwrite every text parameter with seeded random values of a useful scale."""
    H = tcfg.hidden_size
    for name, p in model.named_parameters():  # deduplicated: a tied lm_head is the embedding
        rel = _rel(name)
        if rel is None:
            continue
        shape = tuple(p.shape)

        def randn(*s):
            return torch.randn(*s, generator=gen, dtype=torch.float32)

        if rel == "embed_tokens.weight":
            # tied head: a small embedding keeps the residual from being dominated by the current
            # token's own row (a random tied model otherwise just copies one token greedily)
            v = randn(*shape) * (0.1 if tcfg.tie_word_embeddings else 1.0)
        elif rel == "lm_head.weight":
            v = randn(*shape) / math.sqrt(H)
        elif mlx_format.is_zero_centred_norm(rel):
            v = 0.15 * randn(*shape)  # effective scale 1 + w, visibly different from 1 (trap 2)
        elif rel.endswith("linear_attn.norm.weight"):
            v = 1.0 + 0.15 * randn(*shape)  # plain weight
        elif rel.endswith("A_log"):
            v = torch.log(0.05 + 1.95 * torch.rand(*shape, generator=gen))  # A in [0.05, 2]
        elif rel.endswith("dt_bias"):
            v = 0.7 * randn(*shape)
        elif rel.endswith("conv1d.weight"):
            v = 0.5 * randn(*shape)  # HF inits the PLE conv to zero: make it matter
        elif rel.endswith("experts.gate_up_proj"):
            v = randn(*shape) / math.sqrt(shape[-1])
        elif rel.endswith("experts.down_proj"):
            v = randn(*shape) / math.sqrt(shape[-1])
        elif rel.endswith("ngram_embedding.weight"):
            v = randn(*shape)
        elif p.dim() == 2:
            v = randn(*shape) / math.sqrt(shape[-1])
        else:
            raise RuntimeError(f"no init rule for {name} {shape}")
        p.copy_(v)


# Output std targets of some linear maps, measured over the prompt. Module name suffix -> target
# (as a function of hc_count S). Routers, shared-expert gates, HC mixes and injections are made
# decisive; the LM head gets logits of std ~3.
def _calib_targets(S: int):
    return {
        "mlp.gate": 2.0,
        "mlp.shared_expert_gate": 2.0,
        "input_mix_weight_down": 2.0 * S,  # divided by S before the silu
        "input_mix_weight_up": 2.0,
        "block_inject_weight": 2.0 * S,  # divided by S before the sigmoid
        "linear_attn.in_proj_b": 2.0,
        "linear_attn.in_proj_a": 1.5,
        "lm_head": 3.0,
    }


@torch.no_grad()
def calibrate(model, tcfg, prompt: torch.Tensor, passes: int = 4) -> dict:
    """Rescale selected weights so that their outputs have the target std (factors on a 2^(1/4) grid,
    computed on the CPU, so the result does not depend on tiny float differences)."""
    targets = _calib_targets(tcfg.hc_count)
    mods = {}
    for name, mod in model.named_modules():
        rel = _rel(name)
        if rel is None:
            continue
        for suffix, tgt in targets.items():
            if rel == suffix or rel.endswith("." + suffix):
                mods[name] = (mod, tgt)
    mixer_norm = [m for n, m in model.named_modules() if n.endswith("hyper_connection_mixer.hc_norm")][0]
    applied = {}
    for _ in range(passes):
        stats = {}
        hooks = []
        for name, (mod, _) in mods.items():
            def hook(m, inp, out, name=name):
                o = out[0] if isinstance(out, tuple) else out
                stats[name] = float(o.detach().float().std())
            hooks.append(mod.register_forward_hook(hook))
        model(input_ids=prompt[None], use_cache=False)
        for h in hooks:
            h.remove()
        changed = False
        for name, (mod, tgt) in mods.items():
            s = stats.get(name)
            if not s or not math.isfinite(s):
                continue
            f = 2.0 ** (round(4.0 * math.log2(tgt / s)) / 4.0)
            if f != 1.0:
                if name == "lm_head" and tcfg.tie_word_embeddings:
                    # the head is the embedding: scale the final mixer's output instead, through the
                    # (1 + w) of its zero-centred hc_norm (it only feeds the LM head)
                    w = mixer_norm.weight
                    w.copy_(f * (1.0 + w) - 1.0)
                else:
                    mod.weight.mul_(f)
                applied[name] = applied.get(name, 1.0) * f
                changed = True
        if not changed:
            break
    return applied


@torch.no_grad()
def round_params_to_bf16(model) -> None:
    for p in model.parameters():
        if p.is_floating_point():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


# ------------------------------------------------------------------------------------------------
# Prompt
# ------------------------------------------------------------------------------------------------


def eos_id_of(tcfg) -> int:
    e = tcfg.eos_token_id
    return int(e[0] if isinstance(e, (list, tuple)) else e)


def make_prompt(T: int, vocab: int, eos: int, rng: np.random.Generator) -> np.ndarray:
    """Random ids (never EOS) with EOS at: position 1, an adjacent pair, and two more random places."""
    ids = rng.integers(0, vocab - 1, size=T)
    ids = np.where(ids >= eos, ids + 1, ids)  # skip the EOS id
    pair = int(rng.integers(T // 4, T // 2))
    others = rng.choice(np.arange(T // 2 + 2, T - 2), size=2, replace=False)
    for p in [1, pair, pair + 1, *others.tolist()]:
        ids[p] = eos
    return ids.astype(np.int64)


# ------------------------------------------------------------------------------------------------
# Top-k gap recording
# ------------------------------------------------------------------------------------------------


class GapRecorder:
    """Records the k-th/(k+1)-th gaps of every router top-k and every indexer block top-k."""

    def __init__(self, model):
        self.model = model
        self.handles = []
        self._in_indexer = 0
        self._orig_topk = None
        self.reset()

    def reset(self):
        self.router_min = math.inf
        self.router_min_where = None
        self.router_decisions = 0
        self.indexer_min = math.inf
        self.indexer_min_where = None
        self.indexer_decisions = 0  # queries whose top-k drops at least one complete block
        self.indexer_queries = 0  # queries with at least one complete block
        self.indexer_zero_scores = 0  # blocks scoring exactly 0 (all heads ReLU'd away)

    def __enter__(self):
        from transformers.models.qwen4_exp import modeling_qwen4_exp as M

        rec = self
        for name, mod in self.model.named_modules():
            if isinstance(mod, M.Qwen4ExpTextTopKRouter):
                def rhook(m, inp, out, name=name):
                    logits = out[0].detach().float()
                    k, E = m.top_k, logits.shape[-1]
                    if k >= E:
                        return
                    srt = logits.sort(dim=-1, descending=True).values
                    scale = logits.abs().amax(dim=-1).clamp_min(1e-30)
                    gap = (srt[:, k - 1] - srt[:, k]) / scale
                    i = int(gap.argmin())
                    rec.router_decisions += gap.numel()
                    if float(gap[i]) < rec.router_min:
                        rec.router_min = float(gap[i])
                        rec.router_min_where = f"{name} token {i}"
                self.handles.append(mod.register_forward_hook(rhook))
            elif isinstance(mod, M.Qwen4ExpTextQSAIndexer):
                def pre(m, args, kwargs=None, name=name):
                    rec._in_indexer += 1
                    rec._cur = name
                    rec._qidx = 0

                def post(m, args, out, name=name):
                    rec._in_indexer -= 1
                self.handles.append(mod.register_forward_pre_hook(pre))
                self.handles.append(mod.register_forward_hook(post))
        self._orig_topk = torch.Tensor.topk
        orig = self._orig_topk

        def topk(t, k, dim=-1, largest=True, sorted=True, **kw):
            if rec._in_indexer and t.dim() == 1:
                rec._record_indexer(t.detach().float(), int(k))
            return orig(t, k, dim=dim, largest=largest, sorted=sorted, **kw)

        torch.Tensor.topk = topk
        return self

    def _record_indexer(self, scores: torch.Tensor, k: int):
        n = scores.numel()
        self.indexer_queries += 1
        self.indexer_zero_scores += int((scores == 0).sum())
        q = self._qidx
        self._qidx += 1
        if k >= n:
            return
        self.indexer_decisions += 1
        srt = scores.sort(descending=True).values
        gap = float(srt[k - 1] - srt[k]) / max(float(srt[0].abs()), 1e-30)
        if gap < self.indexer_min:
            self.indexer_min = gap
            self.indexer_min_where = f"{self._cur}, call-local query #{q} with blocks ({n} blocks, top {k})"

    def __exit__(self, *exc):
        torch.Tensor.topk = self._orig_topk
        for h in self.handles:
            h.remove()
        self.handles = []
        return False


# ------------------------------------------------------------------------------------------------
# Oracle runs
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def run_oracle(model, prompt: np.ndarray, N: int, device: str):
    """Prompt logits (one forward) and greedy continuation (full no-cache forwards), with gaps."""
    ids = torch.from_numpy(prompt).to(device)
    with GapRecorder(model) as rec:
        out = model(input_ids=ids[None], use_cache=False)
        logits = out.logits[0].float()
        prompt_rec = dict(router_min=rec.router_min, indexer_min=rec.indexer_min,
                          router_decisions=rec.router_decisions, indexer_decisions=rec.indexer_decisions,
                          indexer_queries=rec.indexer_queries, indexer_zero_scores=rec.indexer_zero_scores,
                          router_min_where=rec.router_min_where, indexer_min_where=rec.indexer_min_where)
        greedy, margins = [], []
        cur = ids
        last = logits[-1]
        for step in range(N):
            if step > 0:
                last = model(input_ids=cur[None], use_cache=False).logits[0, -1].float()
            top2 = torch.topk(last, 2)
            nxt = int(torch.argmax(last))  # first maximal index: ties -> lowest id
            margins.append(float(top2.values[0] - top2.values[1]))
            greedy.append(nxt)
            cur = torch.cat([cur, torch.tensor([nxt], device=device, dtype=cur.dtype)])
        all_rec = dict(router_min=rec.router_min, indexer_min=rec.indexer_min,
                       router_decisions=rec.router_decisions, indexer_decisions=rec.indexer_decisions,
                       router_min_where=rec.router_min_where, indexer_min_where=rec.indexer_min_where)
    return (logits.cpu().numpy().astype(np.float32), np.array(greedy, dtype=np.int64),
            np.array(margins, dtype=np.float32), prompt_rec, all_rec)


# ------------------------------------------------------------------------------------------------
# Writing checkpoints
# ------------------------------------------------------------------------------------------------


def _postprocess_config(path: str, fx: dict) -> None:
    """Choose how layer_types appears in config.json (HF always writes the derived list, with
    "full_attention" renamed to "qwen_sparse_attention"):
      default  : no layer_types and no full_attention_interval (HF derives with the default interval 4)
      interval : no layer_types, `full_attention_interval` given
      as-given : the list exactly as the fixture gives it (e.g. with "full_attention", like the release)
      hf       : what save_pretrained wrote (explicit "qwen_sparse_attention" entries)"""
    with open(path) as f:
        conf = json.load(f)
    t = conf["text_config"] if "text_config" in conf else conf
    mode = fx["layer_types_in_config"]
    if mode in ("default", "interval"):
        t.pop("layer_types", None)
        if mode == "interval":
            t["full_attention_interval"] = fx["text"]["full_attention_interval"]
    elif mode == "as-given":
        t["layer_types"] = list(fx["text"]["layer_types"])
    elif mode != "hf":
        raise ValueError(mode)
    with open(path, "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)
        f.write("\n")


def _save_hf(model, cfg, fx: dict, d: str) -> None:
    m = copy.deepcopy(model)
    if fx["storage"] == "bfloat16":
        m = m.to(torch.bfloat16)  # casts float parameters only; int64 PLE buffers stay int64
        m.config.dtype = "bfloat16"
        if hasattr(m.config, "text_config"):
            m.config.get_text_config().dtype = "bfloat16"
    kw = {}
    if fx["max_shard_size"]:
        kw["max_shard_size"] = fx["max_shard_size"]
    m.save_pretrained(d, **kw)
    _postprocess_config(os.path.join(d, "config.json"), fx)
    if fx["layout"] == "hf-fused":
        _rewrite_fused(d)


def _st_files(d: str) -> list[str]:
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]


def _rewrite_fused(d: str) -> None:
    """Rewrite per-expert tensors into fused experts.gate_up_proj [E,2I,H] / experts.down_proj [E,H,I]."""
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file

    rx = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    idx_path = os.path.join(d, "model.safetensors.index.json")
    weight_map = {}
    for fn in _st_files(d):
        path = os.path.join(d, fn)
        with safe_open(path, "pt") as f:
            meta = f.metadata()
            tens = {k: f.get_tensor(k) for k in f.keys()}
        groups, out = {}, {}
        for k, v in tens.items():
            m = rx.match(k)
            if m:
                groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = v
            else:
                out[k] = v
        for base, g in groups.items():
            E = len(g["gate_proj"])
            gate = torch.stack([g["gate_proj"][e] for e in range(E)])
            up = torch.stack([g["up_proj"][e] for e in range(E)])
            out[base + ".gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
            out[base + ".down_proj"] = torch.stack([g["down_proj"][e] for e in range(E)]).contiguous()
        save_file(out, path, metadata=meta)
        for k in out:
            weight_map[k] = fn
    if os.path.exists(idx_path):
        with open(idx_path) as f:
            idx = json.load(f)
        idx["weight_map"] = dict(sorted(weight_map.items()))
        with open(idx_path, "w") as f:
            json.dump(idx, f, indent=2)
            f.write("\n")


def _save_mlx(tensors: dict, quantization: dict, cfg, fx: dict, d: str) -> None:
    """config.json as save_pretrained writes it (bf16 dtype), plus `quantization` (and the duplicate
    `quantization_config` that mlx-lm / mlx-vlm write); one model.safetensors with MLX metadata."""
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    cfg = copy.deepcopy(cfg)
    cfg.dtype = "bfloat16"
    cfg.get_text_config().dtype = "bfloat16"
    cfg.save_pretrained(d)
    path = os.path.join(d, "config.json")
    _postprocess_config(path, fx)
    with open(path) as f:
        conf = json.load(f)
    conf = mlx_format.mlx_config(conf, quantization)
    with open(path, "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, os.path.join(d, "model.safetensors"),
              metadata={"format": "mlx"})


# ------------------------------------------------------------------------------------------------
# Main loop
# ------------------------------------------------------------------------------------------------


def _versions() -> dict:
    import safetensors
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version()}


def _device_desc(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dir_size(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def make_fixture(fx: dict, out_dir: str, device: str, max_attempts: int, log) -> dict:
    name = fx["name"]
    t0 = time.time()
    rejected = []
    for attempt in range(max_attempts):
        seed = fx["seed"] + 1000 * attempt
        torch.manual_seed(seed)  # HF's own init (vision tower) is seeded too
        cfg = build_config(fx)
        tcfg = text_cfg_of(cfg)
        model = build_model(cfg)
        gen = torch.Generator().manual_seed(seed)
        init_weights(model, tcfg, gen)
        rng = np.random.default_rng(seed)
        prompt = make_prompt(fx["T"], tcfg.vocab_size, eos_id_of(tcfg), rng)
        calib = calibrate(model, tcfg, torch.from_numpy(prompt))
        mlx = None
        if fx["layout"] == "mlx":
            q = fx["mlx"]
            sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
            tensors, quantization = mlx_format.hf_to_mlx(
                sd, tcfg.to_dict(), bits=q["bits"], group_size=q["group_size"],
                ngram_group_size=q["ngram_group_size"], router_bits=q["router_bits"], dtype=torch.bfloat16)
            deq, _ = mlx_format.mlx_to_hf(tensors, tcfg.to_dict(), quantization, prefix=hf_prefix(cfg),
                                          experts="fused")
            _load_text_state(model, deq)
            mlx = (tensors, quantization)
        elif fx["storage"] == "bfloat16":
            round_params_to_bf16(model)
        model.to(device)
        logits, greedy, margins, prompt_gaps, gaps = run_oracle(model, prompt, fx["N"], device)
        model.to("cpu")
        reasons = []
        if not np.isfinite(logits).all():
            reasons.append("non-finite logits")
        if gaps["router_min"] < ROUTER_GAP_MIN:
            reasons.append(f"router gap {gaps['router_min']:.3g} at {gaps['router_min_where']}")
        if gaps["indexer_min"] < INDEXER_GAP_MIN:
            reasons.append(f"indexer gap {gaps['indexer_min']:.3g} at {gaps['indexer_min_where']}")
        if float(margins.min()) < GREEDY_MARGIN_MIN:
            reasons.append(f"greedy margin {float(margins.min()):.3g}")
        if prompt_gaps["indexer_decisions"] == 0:
            reasons.append("the indexer never drops a block")
        lstd = float(logits.std())
        if not 0.5 <= lstd <= 30.0:
            reasons.append(f"logit std {lstd:.3g} out of range")
        if reasons:
            rejected.append({"seed": seed, "reasons": reasons})
            log(f"  {name}: seed {seed} rejected: {'; '.join(reasons)}")
            continue
        break
    else:
        raise RuntimeError(f"{name}: no acceptable seed in {max_attempts} attempts: {rejected}")

    tmp = os.path.join(out_dir, f".tmp-{name}")
    final = os.path.join(out_dir, name)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if mlx is not None:
        _save_mlx(mlx[0], mlx[1], cfg, fx, tmp)
    else:
        _save_hf(model, cfg, fx, tmp)
    np.save(os.path.join(tmp, "prompt_ids.npy"), prompt)
    np.save(os.path.join(tmp, "logits.npy"), logits)
    np.save(os.path.join(tmp, "greedy_ids.npy"), greedy)
    np.save(os.path.join(tmp, "greedy_margins.npy"), margins)

    layer_types = list(tcfg.layer_types)
    eos = eos_id_of(tcfg)
    st_files = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
    meta = {
        "name": name,
        "description": fx["description"],
        "layout": fx["layout"],
        "prefix": mlx_format.MLX_TRUNK_PREFIX if fx["layout"] == "mlx" else hf_prefix(cfg),
        "config_form": "qwen4_exp (nested text_config)" if fx["form"] == "nested" else "qwen4_exp_text (flat)",
        "architecture": cfg.architectures[0],
        "weights_dtype": fx["storage"],
        "oracle": "HF transformers Qwen4Exp, float32 parameters and activations, attn_implementation sdpa, "
                  "default experts implementation (grouped_mm), use_cache=False, batch 1, no attention mask",
        "oracle_weights": ("dequantized MLX tensors (mlx_format.mlx_to_hf) loaded into the HF model"
                           if fx["layout"] == "mlx" else
                           "exactly the stored values" + (" (bf16, upcast to fp32)"
                                                          if fx["storage"] == "bfloat16" else "")),
        "seed": seed,
        "base_seed": fx["seed"],
        "attempts": len(rejected) + 1,
        "rejected_seeds": rejected,
        "regenerate": f"python3 tools/make_oracle_fixtures.py --device {device.split(':')[0]} "
                      f"--out {DEFAULT_OUT} --only {name}",
        "regenerate_all": f"python3 tools/make_oracle_fixtures.py --device {device.split(':')[0]} --out {DEFAULT_OUT}",
        "versions": _versions(),
        "device": _device_desc(device),
        "T": int(fx["T"]),
        "N": int(fx["N"]),
        "vocab_size": int(tcfg.vocab_size),
        "eos_token_id": eos,
        "prompt_eos_positions": [int(i) for i in np.nonzero(prompt == eos)[0]],
        "layer_types": layer_types,
        "layer_types_in_config": fx["layer_types_in_config"],
        "attention_layers": [i for i, t in enumerate(layer_types) if t != "linear_attention"],
        "ple_layers_0based": [i - 1 for i in tcfg.ple_layer_ids],
        "summary": summarize(fx, tcfg),
        "min_router_rel_gap": gaps["router_min"],
        "min_router_rel_gap_where": gaps["router_min_where"],
        "min_indexer_rel_gap": gaps["indexer_min"],
        "min_indexer_rel_gap_where": gaps["indexer_min_where"],
        "min_router_rel_gap_prompt": prompt_gaps["router_min"],
        "min_indexer_rel_gap_prompt": prompt_gaps["indexer_min"],
        "gap_definitions": {
            "router": "(l_(k) - l_(k+1)) / max_j |l_j| over the router logits of a token; min over all "
                      "tokens and layers of the prompt forward and every greedy forward (only k < E)",
            "indexer": "(s_(k) - s_(k+1)) / s_(1) over the block scores of a query; min over every query "
                       "whose block top-k drops blocks, in the prompt forward and every greedy forward",
            "thresholds": {"router": ROUTER_GAP_MIN, "indexer": INDEXER_GAP_MIN, "greedy_margin": GREEDY_MARGIN_MIN},
        },
        "prompt_router_decisions": prompt_gaps["router_decisions"],
        "prompt_indexer_queries_with_blocks": prompt_gaps["indexer_queries"],
        "prompt_indexer_queries_dropping_blocks": prompt_gaps["indexer_decisions"],
        "prompt_indexer_zero_scores": prompt_gaps["indexer_zero_scores"],
        "min_greedy_margin": float(margins.min()),
        "logits_std": float(logits.std()),
        "logits_max_abs": float(np.abs(logits).max()),
        "calibration_factors": {k: v for k, v in sorted(calib.items())},
        "files": {f: _sha256(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp)) if f != "meta.json"},
        "safetensors_files": st_files,
        "generation_seconds": round(time.time() - t0, 2),
    }
    if fx["layout"] == "mlx":
        meta["quantization"] = {k: v for k, v in mlx[1].items() if k in ("bits", "group_size")}
        meta["quantization_overrides"] = len(mlx[1]) - 2
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    meta["size_bytes"] = _dir_size(final)
    return meta


def _load_text_state(model, sd: dict) -> None:
    """Load a (dequantized) text state dict into the HF model; everything but the vision tower and the
    recomputed int64 PLE buffers must be covered."""
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad_missing = [k for k in missing if not k.startswith("model.visual.") and
                   not k.endswith(("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"))
                   and not (k == "lm_head.weight" and model.config.get_text_config().tie_word_embeddings)]
    if bad_missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {bad_missing}, unexpected {unexpected}")


def summarize(fx: dict, tcfg) -> str:
    lt = "".join("G" if t == "linear_attention" else "A" for t in tcfg.layer_types)
    rp = tcfg.rope_parameters
    eos = tcfg.eos_token_id
    return (
        f"{fx['form']} {fx['layout']} {fx['storage']}"
        f"{' sharded' if fx['max_shard_size'] else ''}; V={tcfg.vocab_size} H={tcfg.hidden_size} "
        f"L={tcfg.num_hidden_layers} [{lt}] hc={tcfg.hc_count} lowrank={tcfg.hc_lowrank}; "
        f"E={tcfg.num_experts} k={tcfg.num_experts_per_tok} norm_topk={tcfg.norm_topk_prob} "
        f"I={tcfg.moe_intermediate_size} shI={tcfg.shared_expert_intermediate_size}; "
        f"gate={tcfg.output_gate_type}; heads={tcfg.num_attention_heads}/{tcfg.num_key_value_heads}x{tcfg.head_dim} "
        f"rope={rp.get('partial_rotary_factor', 1.0)} theta={rp['rope_theta']:g}; "
        f"indexer {tcfg.indexer_n_heads}x{tcfg.indexer_head_dim} budget={tcfg.indexer_budget} "
        f"ratio={tcfg.indexer_compress_ratio}; PLE={tcfg.ple_layer_ids} ngram={tcfg.ngram_size} "
        f"hpn={tcfg.heads_per_ngram} dim={tcfg.ple_embed_dim} base={tcfg.ngram_vocab_size_base} "
        f"parts={tcfg.split_ngram_parts} seed={tcfg.seed}; eos={eos}; tie={tcfg.tie_word_embeddings}; "
        f"T={fx['T']} N={fx['N']}"
    )


def write_readme(out_dir: str, metas: list[dict], device: str, runtime: float) -> None:
    lines = [
        "# Oracle fixtures for `qwen4_exp`",
        "",
        "Generated by `tools/make_oracle_fixtures.py` with the Hugging Face implementation (transformers "
        f"{metas[0]['versions']['transformers']}, torch {metas[0]['versions']['torch']}) in float32. "
        "Do not edit by hand. Regenerate all of them (the GPU oracle is the reference; a CPU run is a valid "
        "stand-in):",
        "",
        "```",
        f"python3 tools/make_oracle_fixtures.py --device cuda --out {DEFAULT_OUT}",
        f"python3 tools/make_oracle_fixtures.py --device cpu  --out {DEFAULT_OUT}   # CPU stand-in",
        f"python3 tools/make_oracle_fixtures.py --device cuda --out {DEFAULT_OUT} --only NAME   # one fixture",
        "python3 tools/check_fixture.py tests/fixtures/oracle/NAME [--greedy]   # re-verify with HF",
        "python3 tools/mlx_format.py --selftest",
        "```",
        "",
        f"This set was generated on **{metas[0]['device']}** in {runtime:.1f} s.",
        "",
        "## Files of a fixture",
        "",
        "- `config.json` + `model.safetensors` (or `model-0000K-of-0000N.safetensors` + "
        "`model.safetensors.index.json`): the checkpoint, as written by `save_pretrained` (HF layouts; "
        "`generation_config.json` too), post-processed for the fused layout, or converted by "
        "`tools/mlx_format.py` (MLX layout, see docs/formats.md).",
        "- `prompt_ids.npy` int64 [T]: random ids with the EOS id at position 1, at an adjacent pair and at "
        "two more places (the n-gram EOS rule).",
        "- `logits.npy` float32 [T, vocab]: logits at every prompt position from ONE forward over the "
        "prompt (no cache).",
        "- `greedy_ids.npy` int64 [N]: the greedy continuation (argmax, ties to the lowest id), each step "
        "a full no-cache float32 forward over prompt + generated ids. `greedy_margins.npy` float32 [N]: "
        "top-1 minus top-2 logit at each step.",
        "- `meta.json`: description, layout (`hf-per-expert` | `hf-fused` | `mlx`), tensor prefix, seed, "
        "regenerate command, versions, device, minimum router / indexer top-k gaps (definitions inside), "
        "minimum greedy margin, sha256 of every file.",
        "",
        "The oracle runs the HF model with float32 parameters (bf16 fixtures: the stored bf16 values, "
        "upcast; MLX fixture: the dequantized weights), SDPA attention and the default experts backend. "
        "Seeds whose router or indexer top-k boundary is within a relative gap of 1e-4, or whose greedy "
        "margin is below 1e-3, were rejected (spec traps 28-29), so an implementation that is correct to "
        "fp32 rounding cannot flip a discrete choice. An engine running bf16 activations should compare "
        "with a loose tolerance (the oracle is float32).",
        "",
        "## Fixtures",
        "",
        "| name | layout | size | min router gap | min indexer gap | min greedy margin |",
        "|---|---|---|---|---|---|",
    ]
    for m in metas:
        lines.append(f"| `{m['name']}` | {m['layout']} (prefix `{m['prefix']}`) | {m['size_bytes'] / 1e6:.2f} MB "
                     f"| {m['min_router_rel_gap']:.3g} | {m['min_indexer_rel_gap']:.3g} | "
                     f"{m['min_greedy_margin']:.3g} |")
    lines.append("")
    total = sum(m["size_bytes"] for m in metas)
    lines.append(f"Total size: {total / 1e6:.2f} MB.")
    lines.append("")
    for m in metas:
        lines += [f"### `{m['name']}`", "", m["description"], "", f"`{m['summary']}`", "",
                  f"Layer types: {m['layer_types']}; attention layers {m['attention_layers']}; PLE layers "
                  f"(0-based) {m['ple_layers_0based']}; EOS {m['eos_token_id']} at prompt positions "
                  f"{m['prompt_eos_positions']}; indexer drops blocks for "
                  f"{m['prompt_indexer_queries_dropping_blocks']} of "
                  f"{m['prompt_indexer_queries_with_blocks']} prompt queries; seed {m['seed']}.", "",
                  f"Regenerate: `{m['regenerate']}`", ""]
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--only", default=None, help="comma-separated fixture names")
    ap.add_argument("--list", action="store_true", help="list the fixtures and exit")
    ap.add_argument("--max-attempts", type=int, default=20)
    ap.add_argument("--no-readme", action="store_true", help="do not (re)write <out>/README.md")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the models are tiny, and more threads only spin)")
    args = ap.parse_args(argv)

    if args.list:
        for fx in FIXTURES:
            print(f"{fx['name']}: {fx['description']}")
        return 0
    warnings.filterwarnings("ignore")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = args.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("CUDA is not available", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    torch.set_num_threads(max(1, args.threads))
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)

    selected = FIXTURES
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = set(names) - {fx["name"] for fx in FIXTURES}
        if unknown:
            print(f"unknown fixtures: {sorted(unknown)}", file=sys.stderr)
            return 2
        selected = [fx for fx in FIXTURES if fx["name"] in names]
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    metas = []
    for fx in selected:
        print(f"[{time.time() - t0:6.1f}s] {fx['name']} ...", flush=True)
        meta = make_fixture(fx, args.out, device, args.max_attempts, lambda s: print(s, flush=True))
        metas.append(meta)
        print(f"  seed {meta['seed']} ({meta['attempts']} attempt(s)), {meta['size_bytes'] / 1e6:.2f} MB, "
              f"min gaps router {meta['min_router_rel_gap']:.3g} indexer {meta['min_indexer_rel_gap']:.3g}, "
              f"greedy margin {meta['min_greedy_margin']:.3g}, {meta['generation_seconds']:.1f} s", flush=True)
    runtime = time.time() - t0
    if not args.no_readme:
        # the README describes every fixture present in the output directory
        all_metas = []
        for fx in FIXTURES:
            mp = os.path.join(args.out, fx["name"], "meta.json")
            if os.path.exists(mp):
                with open(mp) as f:
                    m = json.load(f)
                m["size_bytes"] = _dir_size(os.path.join(args.out, fx["name"]))
                all_metas.append(m)
        write_readme(args.out, all_metas, device, runtime)
    total = sum(m["size_bytes"] for m in metas)
    print(f"done: {len(metas)} fixture(s), {total / 1e6:.2f} MB, {runtime:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
