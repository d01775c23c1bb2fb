#!/usr/bin/env python3
"""MLX affine quantization and the HF <-> MLX tensor layout of a `qwen4_exp` text model.

Reusable by the fixture generator (tools/make_oracle_fixtures.py), by tools/check_fixture.py and by
training/export scripts. Implements exactly:
  * shared/spec/mlx_affine.md  -- the quantizer's rule and the bit packing (bits 2,3,4,5,6,8);
  * docs/formats.md, "MLX"     -- the tensor names and layout transforms of an mlx-vlm style
                                  conversion (prefix `language_model.model.`, `switch_mlp` stacked
                                  experts, +1 folded into zero-centred norms, conv weights [C,K,1],
                                  one concatenated n-gram table with its own group size, routers at
                                  8 bits through module overrides in `quantization`).

Public API
  quantize_affine(w, bits, group_size, out_dtype=None) -> (codes_u32, scales, biases)
  dequantize_affine(codes, scales, biases, bits, group_size, out_dtype=torch.float32) -> w
  pack_codes(q, bits) / unpack_codes(codes, bits, n)
  hf_to_mlx(state_dict, text_config, bits=4, group_size=64, ngram_group_size=32, router_bits=8,
            mtp_state_dict=None, dtype=torch.bfloat16, keep_ple_buffers=False) -> (tensors, quantization)
  mlx_to_hf(tensors, text_config, quantization, prefix="model.", experts="fused", ngram_shards=None,
            dtype=torch.float32) -> (state_dict, mtp_state_dict)
  mlx_config(hf_config: dict, quantization: dict) -> dict     (config.json of an MLX checkpoint)

Self-test: python3 tools/mlx_format.py --selftest
"""
from __future__ import annotations

import argparse
import re
import sys

import numpy as np
import torch

__all__ = [
    "quantize_affine",
    "dequantize_affine",
    "pack_codes",
    "unpack_codes",
    "hf_to_mlx",
    "mlx_to_hf",
    "mlx_config",
    "is_zero_centred_norm",
    "MLX_TRUNK_PREFIX",
    "MLX_HEAD_PREFIX",
    "MLX_MTP_PREFIX",
]

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
MLX_TRUNK_PREFIX = "language_model.model."
MLX_HEAD_PREFIX = "language_model.lm_head."
MLX_MTP_PREFIX = "mtp."

# --------------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------------


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bits {bits}; expected one of {SUPPORTED_BITS}")


def pack_codes(q, bits: int) -> torch.Tensor:
    """Pack unsigned codes q [..., n] (values < 2^bits) into a u32 tensor [..., n*bits/32].

    Element i of a row occupies bits [bits*i, bits*i + bits) of the row's little-endian bit stream
    (lowest bits first). For bits 2/4/8 this is "word i/(32/bits), offset bits*(i mod 32/bits)"; for
    bits 3/6 it is the 3-byte unit layout, for bits 5 the 5-byte unit layout (shared/spec/mlx_affine.md).
    """
    _check_bits(bits)
    qn = q.cpu().numpy() if isinstance(q, torch.Tensor) else np.asarray(q)
    n = qn.shape[-1]
    if (n * bits) % 32 != 0:
        raise ValueError(f"row length {n} * {bits} bits is not a multiple of 32")
    if qn.size and (qn.min() < 0 or qn.max() >= (1 << bits)):
        raise ValueError("code out of range")
    lead = qn.shape[:-1]
    qn = qn.astype(np.uint8).reshape(-1, n)
    bitplanes = (qn[:, :, None] >> np.arange(bits, dtype=np.uint8)[None, None, :]) & 1  # [R, n, bits]
    stream = bitplanes.reshape(qn.shape[0], n * bits)
    packed = np.packbits(stream, axis=-1, bitorder="little")  # [R, n*bits/8] bytes
    words = np.ascontiguousarray(packed).view("<u4").astype(np.uint32)
    return torch.from_numpy(words.reshape(*lead, n * bits // 32).copy())


def unpack_codes(codes: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """Inverse of pack_codes: u32 [..., n*bits/32] -> int64 codes [..., n]."""
    _check_bits(bits)
    cn = codes.cpu().numpy() if isinstance(codes, torch.Tensor) else np.asarray(codes)
    cn = np.ascontiguousarray(cn.astype(np.uint32))
    lead = cn.shape[:-1]
    nwords = cn.shape[-1]
    total = nwords * 32 // bits
    if n is None:
        n = total
    if n * bits != nwords * 32:
        raise ValueError(f"{nwords} words do not hold {n} codes of {bits} bits")
    by = cn.reshape(-1, nwords).astype("<u4").view(np.uint8)  # [R, nwords*4]
    stream = np.unpackbits(by, axis=-1, bitorder="little")  # [R, n*bits]
    planes = stream.reshape(-1, n, bits).astype(np.int64)
    q = (planes << np.arange(bits, dtype=np.int64)[None, None, :]).sum(-1)
    return torch.from_numpy(q.reshape(*lead, n))


# --------------------------------------------------------------------------------------------------
# Quantizer (shared/spec/mlx_affine.md, "The quantizer's rule")
# --------------------------------------------------------------------------------------------------


def quantize_codes(w: torch.Tensor, bits: int, group_size: int):
    """The rule in fp32. Returns (q int64 [..., in], scales fp32 [..., in/g], biases fp32 [..., in/g])."""
    _check_bits(bits)
    w32 = w.detach().to(torch.float32).cpu()
    n = w32.shape[-1]
    if n % group_size != 0:
        raise ValueError(f"input dim {n} is not a multiple of group size {group_size}")
    g = w32.reshape(*w32.shape[:-1], n // group_size, group_size)
    n_bins = float((1 << bits) - 1)
    w_max = g.amax(dim=-1, keepdim=True)
    w_min = g.amin(dim=-1, keepdim=True)
    # 1. scale = max((max - min) / (2^bits - 1), 1e-7)
    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    # 2. edge = the end with the larger magnitude; scale negative when the edge is the max
    mask = w_min.abs() > w_max.abs()
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    # 3. snap: q0 = round(edge/scale); if q0 != 0: scale = edge/q0, bias = edge; else bias = 0
    q0 = torch.round(edge / scale)
    nz = q0 != 0
    scale = torch.where(nz, edge / torch.where(nz, q0, torch.ones_like(q0)), scale)
    bias = torch.where(nz, edge, torch.zeros_like(edge))
    # 4. q = min(round((w - bias)/scale), 2^bits - 1)   (never negative by construction; clamp anyway)
    q = torch.clamp(torch.round((g - bias) / scale), 0.0, n_bins)
    return (
        q.to(torch.int64).reshape(w32.shape),
        scale.squeeze(-1),
        bias.squeeze(-1),
    )


def quantize_affine(w: torch.Tensor, bits: int, group_size: int, out_dtype: torch.dtype | None = None):
    """Quantize w [..., out, in] -> (codes u32 [..., out, in*bits/32], scales, biases [..., out, in/g]).

    Scale and bias are computed in fp32 and stored in `out_dtype` (default: w.dtype, i.e. the model
    dtype). The codes are computed from the fp32 scale and bias, as the rule says.
    """
    q, scale, bias = quantize_codes(w, bits, group_size)
    dt = w.dtype if out_dtype is None else out_dtype
    return pack_codes(q, bits), scale.to(dt), bias.to(dt)


def dequantize_affine(
    codes: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """w[o, i] = scales[o, i/g] * q[o, i] + biases[o, i/g], computed in fp32 (s*q is exact in fp32 for
    bf16/f16 scales, so there is a single rounding), returned in out_dtype."""
    ngroups = scales.shape[-1]
    n = ngroups * group_size
    if codes.shape[-1] * 32 != n * bits:
        raise ValueError(
            f"codes {tuple(codes.shape)} do not match {ngroups} groups of {group_size} at {bits} bits"
        )
    q = unpack_codes(codes, bits, n).to(torch.float32)
    q = q.reshape(*q.shape[:-1], ngroups, group_size)
    s = scales.detach().cpu().to(torch.float32).unsqueeze(-1)
    b = biases.detach().cpu().to(torch.float32).unsqueeze(-1)
    w = s * q + b
    return w.reshape(*w.shape[:-2], n).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Layout conversion
# --------------------------------------------------------------------------------------------------

# Zero-centred (N1, `1 + w`) norms: the MLX layout stores `1 + w`. linear_attn.norm (N2) is plain.
_N1_NORM_SUFFIXES = (
    "hc_norm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "indexer.q_layernorm.weight",
    "indexer.k_layernorm.weight",
    "ple.norm_key.weight",
    "ple.norm_query.weight",
    "ple.norm_conv.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)
_CONV_SUFFIXES = ("linear_attn.conv1d.weight", "ple.conv1d.weight")
_ROUTER_SUFFIXES = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
_PLE_BUFFERS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")
_UNQUANTIZED_PARAM_SUFFIXES = ("A_log", "dt_bias")

_RE_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_RE_FUSED = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_RE_NGRAM_SHARD = re.compile(r"^(.*\.ple_embedding\.ngram_embedding)\.shard_(\d+)\.weight$")
_RE_NGRAM_ONE = re.compile(r"^(.*\.ple_embedding\.ngram_embedding)\.weight$")


def is_zero_centred_norm(name: str) -> bool:
    return name.endswith(_N1_NORM_SUFFIXES)


def _split_hf_names(state_dict: dict) -> tuple[dict, dict, dict]:
    """HF names -> (trunk-relative tensors, head tensors {'weight': ...}, mtp-relative tensors)."""
    trunk, head, mtp = {}, {}, {}
    for name, t in state_dict.items():
        if name.startswith("model.visual.") or name.startswith("visual."):
            continue  # vision tower: out of scope
        if name.startswith("model.mtp."):
            mtp[name[len("model.mtp.") :]] = t
        elif name.startswith("mtp."):
            mtp[name[len("mtp.") :]] = t
        elif name.startswith("model.language_model."):
            trunk[name[len("model.language_model.") :]] = t
        elif name.startswith("model."):
            trunk[name[len("model.") :]] = t
        elif name.startswith("lm_head."):
            head[name[len("lm_head.") :]] = t
        else:
            raise ValueError(f"unexpected HF tensor name {name!r}")
    return trunk, head, mtp


def _convert_block(rel: dict, out_prefix: str, *, bits, group_size, ngram_group_size, router_bits,
                   dtype, keep_ple_buffers, tensors: dict, quantization: dict) -> None:
    """Convert one namespace (trunk or MTP) of HF-relative names into MLX tensors under out_prefix."""
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    ngram: dict[str, dict[int, torch.Tensor]] = {}

    def put_quantized(path: str, w: torch.Tensor, b: int | None, g: int, override: bool) -> None:
        """Quantize module `path` if possible; record overrides in `quantization`."""
        full = out_prefix + path
        if b is None or w.shape[-1] % g != 0:
            tensors[full + ".weight"] = w.to(dtype).contiguous()
            quantization[full] = False
            return
        codes, s, bb = quantize_affine(w, b, g, out_dtype=dtype)
        tensors[full + ".weight"] = codes
        tensors[full + ".scales"] = s.contiguous()
        tensors[full + ".biases"] = bb.contiguous()
        if override:
            quantization[full] = {"group_size": g, "bits": b}

    for name, t in rel.items():
        if m := _RE_EXPERT.match(name):
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
            continue
        if m := _RE_FUSED.match(name):
            d = experts.setdefault(m.group(1), {})
            if m.group(2) == "gate_up_proj":  # [E, 2I, H], gate first
                inter = t.shape[1] // 2
                d["gate_proj"] = {e: t[e, :inter] for e in range(t.shape[0])}
                d["up_proj"] = {e: t[e, inter:] for e in range(t.shape[0])}
            else:  # [E, H, I]
                d["down_proj"] = {e: t[e] for e in range(t.shape[0])}
            continue
        if m := _RE_NGRAM_SHARD.match(name):
            ngram.setdefault(m.group(1), {})[int(m.group(2))] = t
            continue
        if m := _RE_NGRAM_ONE.match(name):
            ngram.setdefault(m.group(1), {})[-1] = t
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _PLE_BUFFERS:
            if keep_ple_buffers:
                tensors[out_prefix + name] = t.to(torch.int64)
            continue
        if not t.is_floating_point():  # some other integer buffer: never through a float
            tensors[out_prefix + name] = t
            continue
        if is_zero_centred_norm(name):
            tensors[out_prefix + name] = (1.0 + t.to(torch.float32)).to(dtype)
            continue
        if name.endswith(_CONV_SUFFIXES):  # [C, 1, K] -> [C, K, 1]
            tensors[out_prefix + name] = t.permute(0, 2, 1).to(dtype).contiguous()
            continue
        if leaf in _UNQUANTIZED_PARAM_SUFFIXES or t.dim() == 1:
            tensors[out_prefix + name] = t.to(dtype).contiguous()
            continue
        if t.dim() == 2 and name.endswith(".weight"):
            path = name[: -len(".weight")]
            if name.endswith(_ROUTER_SUFFIXES):
                put_quantized(path, t, router_bits, group_size, override=True)
            else:
                put_quantized(path, t, bits, group_size, override=False)
            continue
        raise ValueError(f"do not know how to convert {name!r} with shape {tuple(t.shape)}")

    for mlp, d in experts.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            per = d.get(proj)
            if not per:
                raise ValueError(f"{mlp}: missing experts {proj}")
            ids = sorted(per)
            if ids != list(range(len(ids))):
                raise ValueError(f"{mlp}.{proj}: expert ids not contiguous")
            stacked = torch.stack([per[e] for e in ids], dim=0)  # [E, out, in]
            put_quantized(f"{mlp}.switch_mlp.{proj}", stacked, bits, group_size, override=False)

    for mod, parts in ngram.items():
        if -1 in parts:
            if len(parts) != 1:
                raise ValueError(f"{mod}: both a single table and shards")
            table = parts[-1]
        else:
            ids = sorted(parts)  # numeric order (shard_10 after shard_9)
            if ids != list(range(len(ids))):
                raise ValueError(f"{mod}: n-gram shards not contiguous: {ids}")
            table = torch.cat([parts[k] for k in ids], dim=0)
        full = out_prefix + mod
        if table.shape[-1] % ngram_group_size != 0:
            tensors[full + ".weight"] = table.to(dtype).contiguous()
            quantization[full] = False
        else:
            codes, s, bb = quantize_affine(table, bits, ngram_group_size, out_dtype=dtype)
            tensors[full + ".weight"] = codes
            tensors[full + ".scales"] = s.contiguous()
            tensors[full + ".biases"] = bb.contiguous()
            quantization[full] = {"group_size": ngram_group_size, "bits": bits}


def hf_to_mlx(
    state_dict: dict,
    text_config: dict,
    bits: int = 4,
    group_size: int = 64,
    ngram_group_size: int = 32,
    router_bits: int | None = 8,
    mtp_state_dict: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    keep_ple_buffers: bool = False,
):
    """Convert an HF `qwen4_exp` state dict into the MLX layout of docs/formats.md.

    state_dict: HF names with prefix `model.language_model.` or `model.`, `lm_head.weight`
      (optional, absent when tied), experts per expert or fused, n-gram table as shards or one
      tensor; `model.visual.*` is dropped; `mtp.*` / `model.mtp.*` entries are treated as MTP.
    text_config: the text config as a dict (used for checks only).
    mtp_state_dict: optional MTP head tensors, names `mtp.*` (or without the `mtp.` prefix).
    Returns (tensors, quantization): tensors named `language_model.model.*`,
    `language_model.lm_head.*`, `mtp.*`; quantization = {"group_size", "bits", <module>: override}.
    Every 2-D weight (linear or embedding, experts stacked) is quantized when its input dimension is a
    multiple of its group size, otherwise stored in `dtype` with a `false` override. Routers
    (`mlp.gate`, `mlp.shared_expert_gate`) get `router_bits` (None: unquantized). Norms, A_log,
    dt_bias and conv weights stay unquantized (in `dtype`). The int64 PLE buffers are dropped unless
    keep_ple_buffers.
    """
    trunk, head, mtp = _split_hf_names(state_dict)
    if mtp_state_dict:
        for k, v in mtp_state_dict.items():
            k = k[len("model.mtp.") :] if k.startswith("model.mtp.") else k
            k = k[len("mtp.") :] if k.startswith("mtp.") else k
            mtp[k] = v
    tensors: dict[str, torch.Tensor] = {}
    quantization: dict = {"group_size": group_size, "bits": bits}
    kw = dict(bits=bits, group_size=group_size, ngram_group_size=ngram_group_size, router_bits=router_bits,
              dtype=dtype, keep_ple_buffers=keep_ple_buffers, tensors=tensors, quantization=quantization)
    _convert_block(trunk, MLX_TRUNK_PREFIX, **kw)
    if mtp:
        _convert_block(mtp, MLX_MTP_PREFIX, **kw)
    if head and text_config.get("tie_word_embeddings", False):
        emb = trunk.get("embed_tokens.weight")
        if emb is not None and not torch.equal(head["weight"], emb):
            raise ValueError("tie_word_embeddings is true but lm_head.weight differs from embed_tokens.weight")
        head = {}  # tied: the head is the embedding (as save_pretrained drops it)
    if head:
        if set(head) != {"weight"}:
            raise ValueError(f"unexpected lm_head tensors {sorted(head)}")
        w = head["weight"]
        full = MLX_HEAD_PREFIX[:-1]
        if w.shape[-1] % group_size == 0:
            codes, s, b = quantize_affine(w, bits, group_size, out_dtype=dtype)
            tensors[full + ".weight"], tensors[full + ".scales"], tensors[full + ".biases"] = codes, s, b
        else:
            tensors[full + ".weight"] = w.to(dtype)
            quantization[full] = False
    elif not text_config.get("tie_word_embeddings", False):
        raise ValueError("lm_head.weight missing but tie_word_embeddings is false")
    n_exp = text_config.get("num_experts")
    if n_exp is not None:
        for k, v in tensors.items():
            if ".switch_mlp." in k and v.shape[0] != n_exp:
                raise ValueError(f"{k}: {v.shape[0]} experts, config says {n_exp}")
    return tensors, quantization


def _module_quant(quantization: dict, path: str):
    """(bits, group) for module `path`, or None if the override says unquantized."""
    ov = quantization.get(path, None)
    if ov is False:
        return None
    if isinstance(ov, dict):
        return int(ov.get("bits", quantization["bits"])), int(ov.get("group_size", quantization["group_size"]))
    return int(quantization["bits"]), int(quantization["group_size"])


def mlx_to_hf(
    tensors: dict,
    text_config: dict,
    quantization: dict | None,
    prefix: str = "model.",
    experts: str = "fused",
    ngram_shards: int | None = None,
    dtype: torch.dtype = torch.float32,
):
    """Inverse of hf_to_mlx, dequantizing. Returns (state_dict, mtp_state_dict).

    prefix: the HF trunk prefix to emit (`model.` for Qwen4ExpForCausalLM, `model.language_model.` for
      Qwen4ExpForConditionalGeneration). The head is `lm_head.weight` (absent if not stored).
    experts: "fused" (runtime HF names `experts.gate_up_proj` [E,2I,H], `experts.down_proj` [E,H,I],
      what `load_state_dict` on an HF model wants) or "per_expert" (what `save_pretrained` writes).
    ngram_shards: None -> one `ngram_embedding.weight` (runtime name); k -> `shard_0..k-1`.
    Norms get the +1 removed (w = stored - 1 in fp32), conv weights go back to [C,1,K]. The int64
    PLE buffers are not produced (HF recomputes them); if present they are passed through as int64.
    """
    quantization = dict(quantization or {"group_size": 64, "bits": 4})
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        mod, leaf = name.rsplit(".", 1)
        if leaf in ("scales", "biases") or (leaf == "weight" and t.dtype == torch.uint32):
            modules.setdefault(mod, {})[leaf] = t
    deq: dict[str, torch.Tensor] = {}
    consumed = set()
    for mod, parts in modules.items():
        if "scales" not in parts:
            continue
        bq = _module_quant(quantization, mod)
        if bq is None:
            raise ValueError(f"{mod} has scales but its quantization override is false")
        bits, group = bq
        if parts["weight"].shape[-1] * 32 != parts["scales"].shape[-1] * group * bits:
            raise ValueError(f"{mod}: shapes do not match bits={bits} group={group}")
        deq[mod + ".weight"] = dequantize_affine(parts["weight"], parts["scales"], parts["biases"], bits, group)
        consumed.update({mod + ".weight", mod + ".scales", mod + ".biases"})
    plain = {k: v for k, v in tensors.items() if k not in consumed}
    plain.update(deq)

    out, mtp_out = {}, {}
    for name, t in plain.items():
        if name.startswith(MLX_TRUNK_PREFIX):
            rel, dst, dprefix = name[len(MLX_TRUNK_PREFIX) :], out, prefix
        elif name.startswith(MLX_HEAD_PREFIX):
            out["lm_head." + name[len(MLX_HEAD_PREFIX) :]] = t.to(dtype)
            continue
        elif name.startswith(MLX_MTP_PREFIX):
            rel, dst, dprefix = name[len(MLX_MTP_PREFIX) :], mtp_out, "mtp."
        else:
            raise ValueError(f"unexpected MLX tensor name {name!r}")
        leaf = rel.rsplit(".", 1)[-1]
        if leaf in _PLE_BUFFERS:
            dst[dprefix + rel] = t.to(torch.int64)
            continue
        if t.dtype == torch.uint32:
            raise ValueError(f"{name}: u32 codes without scales")
        if not t.is_floating_point():
            dst[dprefix + rel] = t
            continue
        m = re.match(r"^(.*\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$", rel)
        if m:
            mlp, proj = m.group(1), m.group(2)
            if experts == "per_expert":
                for e in range(t.shape[0]):
                    dst[f"{dprefix}{mlp}.experts.{e}.{proj}.weight"] = t[e].to(dtype).contiguous()
            else:
                key = f"{dprefix}{mlp}.experts."
                if proj == "down_proj":
                    dst[key + "down_proj"] = t.to(dtype).contiguous()
                else:
                    dst.setdefault("__fuse__" + key, {})[proj] = t.to(dtype)
            continue
        m = _RE_NGRAM_ONE.match(rel)
        if m:
            if ngram_shards:
                rows = t.shape[0]
                if rows % ngram_shards:
                    raise ValueError(f"n-gram table rows {rows} not divisible by {ngram_shards} shards")
                for k, chunk in enumerate(torch.chunk(t, ngram_shards, dim=0)):
                    dst[f"{dprefix}{m.group(1)}.shard_{k}.weight"] = chunk.to(dtype).contiguous()
            else:
                dst[dprefix + rel] = t.to(dtype)
            continue
        if is_zero_centred_norm(rel):
            dst[dprefix + rel] = (t.to(torch.float32) - 1.0).to(dtype)
            continue
        if rel.endswith(_CONV_SUFFIXES):  # [C, K, 1] -> [C, 1, K]
            dst[dprefix + rel] = t.permute(0, 2, 1).to(dtype).contiguous()
            continue
        dst[dprefix + rel] = t.to(dtype)
    for dst in (out, mtp_out):
        for key in [k for k in dst if k.startswith("__fuse__")]:
            d = dst.pop(key)
            base = key[len("__fuse__") :]
            dst[base + "gate_up_proj"] = torch.cat([d["gate_proj"], d["up_proj"]], dim=1).contiguous()
    if "lm_head.weight" not in out and not text_config.get("tie_word_embeddings", False):
        raise ValueError("MLX tensors have no lm_head but tie_word_embeddings is false")
    return out, mtp_out


def mlx_config(hf_config: dict, quantization: dict) -> dict:
    """config.json of an MLX checkpoint: the HF config plus `quantization` (and the mlx-lm/mlx-vlm
    duplicate `quantization_config`)."""
    cfg = dict(hf_config)
    cfg["quantization"] = quantization
    cfg["quantization_config"] = quantization
    return cfg


# --------------------------------------------------------------------------------------------------
# Self-test
# --------------------------------------------------------------------------------------------------


def _ref_pack_words(q: np.ndarray, bits: int) -> np.ndarray:
    """Independent reference for bits 2/4/8: word i/(32/bits), offset bits*(i mod 32/bits)."""
    per = 32 // bits
    rows, n = q.shape
    out = np.zeros((rows, n // per), dtype=np.uint64)
    for i in range(n):
        out[:, i // per] |= q[:, i].astype(np.uint64) << np.uint64(bits * (i % per))
    return out.astype(np.uint32)


def _ref_pack_units(q: np.ndarray, bits: int) -> np.ndarray:
    """Independent reference for bits 3/5/6: units of 8 (3, 5 bits) or 4 (6 bits) codes packed
    lowest-bits-first into 3 or 5 bytes; returns the byte stream per row."""
    codes_per_unit = {3: 8, 5: 8, 6: 4}[bits]
    bytes_per_unit = codes_per_unit * bits // 8
    rows, n = q.shape
    out = np.zeros((rows, n // codes_per_unit * bytes_per_unit), dtype=np.uint8)
    for r in range(rows):
        for u in range(n // codes_per_unit):
            acc = 0
            for j in range(codes_per_unit):
                acc |= int(q[r, u * codes_per_unit + j]) << (bits * j)
            for b in range(bytes_per_unit):
                out[r, u * bytes_per_unit + b] = (acc >> (8 * b)) & 0xFF
    return out


def _tiny_hf_model(tie: bool = False):
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    cfg = Qwen4ExpTextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=32, ple_layer_ids=[1], ngram_size=3,
        heads_per_ngram=2, ple_embed_dim=128, ngram_vocab_size_base=60, split_ngram_parts=2,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8,
        indexer_compress_ratio=4, eos_token_id=3, full_attention_interval=2, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.1 if p.dim() == 1 else 0.5))
    return model, cfg


def selftest(verbose: bool = True) -> None:
    rng = np.random.default_rng(1234)
    n_checks = 0
    # 1. packing round trips and agreement with the independent references
    for bits in SUPPORTED_BITS:
        for n in (32, 64, 96, 256):
            if (n * bits) % 32:
                continue
            q = rng.integers(0, 1 << bits, size=(5, n))
            packed = pack_codes(torch.from_numpy(q), bits)
            assert packed.dtype == torch.uint32 and tuple(packed.shape) == (5, n * bits // 32)
            assert np.array_equal(unpack_codes(packed, bits, n).numpy(), q), (bits, n)
            if bits in (2, 4, 8):
                assert np.array_equal(packed.numpy(), _ref_pack_words(q, bits)), (bits, n)
            else:
                assert np.array_equal(packed.numpy().view(np.uint8).reshape(5, -1), _ref_pack_units(q, bits))
            n_checks += 1
    # hand-checked 3-bit unit: codes 0..7 -> 24-bit value sum(j << 3j)
    acc = sum(j << (3 * j) for j in range(8))
    p = pack_codes(torch.arange(32).remainder(8).reshape(1, 32), 3).numpy().view(np.uint8)[0]
    assert list(p[:3]) == [acc & 0xFF, (acc >> 8) & 0xFF, (acc >> 16) & 0xFF]
    # 4-bit: element i in word i/8 at offset 4*(i%8)
    q = torch.arange(16).reshape(1, 16) % 16
    assert pack_codes(q, 4)[0, 0].item() == 0x76543210 and pack_codes(q, 4)[0, 1].item() == 0xFEDCBA98
    n_checks += 2

    # 2. quantize -> dequantize error bounds, for bits 2,3,4,8 and groups 32,64,128
    for bits in (2, 3, 4, 8):
        for g in (32, 64, 128):
            for dist in ("normal", "positive", "negative", "outlier", "constant"):
                shape = (3, 7, 2 * g) if dist == "normal" else (6, 4 * g)
                w = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
                if dist == "positive":
                    w = w.abs() + 0.5
                elif dist == "negative":
                    w = -(w.abs() + 0.5)
                elif dist == "outlier":
                    w[..., 5] = 40.0
                    w[..., g + 3] = -50.0
                elif dist == "constant":
                    w[:] = 0.0
                    w[1:] = 0.75
                codes, s, b = quantize_affine(w, bits, g)  # fp32 scales: exact rule check
                assert codes.dtype == torch.uint32 and codes.shape[-1] == w.shape[-1] * bits // 32
                assert s.shape == b.shape == (*w.shape[:-1], w.shape[-1] // g)
                q = unpack_codes(codes, bits)
                assert int(q.min()) >= 0 and int(q.max()) <= (1 << bits) - 1
                wd = dequantize_affine(codes, s, b, bits, g)
                grp = w.reshape(*w.shape[:-1], -1, g)
                span = (grp.amax(-1) - grp.amin(-1)) / ((1 << bits) - 1)  # the unsnapped |scale|
                err = (wd - w).abs().reshape(*w.shape[:-1], -1, g).amax(-1)
                # rounding error is <= |scale|/2; the snap can shrink |scale| so that the far end of
                # the group is clipped, but by less than one unsnapped step
                bound = torch.maximum(span, s.abs()) * 1.0001 + 1e-6
                assert bool((err <= bound).all()), (bits, g, dist, float((err - bound).max()))
                # typical error is about a quarter step
                if dist == "normal":
                    mean_err = (wd - w).abs().mean() / span.mean()
                    assert float(mean_err) < 0.35, (bits, g, float(mean_err))
                # the edge (larger-magnitude end) of each group is represented exactly
                mask = grp.amin(-1).abs() > grp.amax(-1).abs()
                edge = torch.where(mask, grp.amin(-1), grp.amax(-1))
                wdg = wd.reshape(*w.shape[:-1], -1, g)
                hit = (wdg - edge.unsqueeze(-1)).abs().amin(-1)
                assert bool((hit <= 1e-6 * (1 + edge.abs())).all()), (bits, g, dist)
                # storing scales in bf16 (the model dtype) keeps the error near the fp32 bound
                codes2, s2, b2 = quantize_affine(w.to(torch.bfloat16), bits, g)
                assert s2.dtype == torch.bfloat16 and torch.equal(codes2, quantize_affine(w.bfloat16().float(), bits, g)[0])
                wd2 = dequantize_affine(codes2, s2, b2, bits, g)
                err2 = (wd2 - w.bfloat16().float()).abs().reshape(*w.shape[:-1], -1, g).amax(-1)
                bound2 = bound + (1 << bits) * s.abs() * 2**-8 + grp.abs().amax(-1) * 2**-7
                assert bool((err2 <= bound2).all()), (bits, g, dist)
                n_checks += 1
    # a group with |min| > |max|: positive scale, bias = min; otherwise negative scale, bias = max
    w = torch.tensor([[-2.0, 0.0, 0.5, 1.0] * 8])
    _, s, b = quantize_codes(w, 4, 32)
    assert float(s) > 0 and float(b) == -2.0
    _, s, b = quantize_codes(-w, 4, 32)
    assert float(s) < 0 and float(b) == 2.0
    n_checks += 1

    # 3. hf_to_mlx / mlx_to_hf on a tiny HF model (names, layouts, inverse)
    for tie in (False, True):
        model, cfg = _tiny_hf_model(tie)
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        tcfg = cfg.to_dict()
        mtp = {
            "mtp.fc_embedding.weight": torch.randn(64, 64),
            "mtp.pre_fc_norm_embedding.weight": torch.randn(64) * 0.1,
            "mtp.layers.0.mlp.gate.weight": torch.randn(4, 64),
        }
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                mtp[f"mtp.layers.0.mlp.experts.{e}.{proj}.weight"] = torch.randn(64, 64)
        tensors, quant = hf_to_mlx(sd, tcfg, mtp_state_dict=mtp)
        names = set(tensors)
        P = MLX_TRUNK_PREFIX
        # the save_pretrained layout (per-expert tensors, n-gram shards, prefix model.language_model.)
        # converts to exactly the same MLX tensors as the runtime layout (fused, one n-gram table)
        saved = {}
        for k, v in sd.items():
            k2 = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
            if k.endswith("experts.gate_up_proj"):
                inter = v.shape[1] // 2
                for e in range(v.shape[0]):
                    saved[k2[: -len("gate_up_proj")] + f"{e}.gate_proj.weight"] = v[e, :inter].clone()
                    saved[k2[: -len("gate_up_proj")] + f"{e}.up_proj.weight"] = v[e, inter:].clone()
            elif k.endswith("experts.down_proj"):
                for e in range(v.shape[0]):
                    saved[k2[: -len("down_proj")] + f"{e}.down_proj.weight"] = v[e].clone()
            elif k.endswith("ngram_embedding.weight"):
                for j, chunk in enumerate(torch.chunk(v, 2, dim=0)):
                    saved[k2[: -len("weight")] + f"shard_{j}.weight"] = chunk.clone()
            else:
                saved[k2] = v
        saved["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)  # skipped
        t_saved, q_saved = hf_to_mlx(saved, tcfg, mtp_state_dict=mtp)
        assert q_saved == quant and set(t_saved) == names
        assert all(torch.equal(t_saved[k], tensors[k]) for k in names)
        assert P + "layers.0.mlp.switch_mlp.gate_proj.weight" in names
        assert tensors[P + "layers.0.mlp.switch_mlp.down_proj.weight"].shape == (4, 64, 64 * 4 // 32)
        assert tensors[P + "layers.0.mlp.switch_mlp.down_proj.scales"].shape == (4, 64, 1)
        assert tensors[P + "layers.0.linear_attn.conv1d.weight"].shape == (128, 4, 1)
        assert tensors[P + "layers.0.ple.conv1d.weight"].shape == (128, 4, 1)
        assert P + "layers.0.ple.ple_embedding.ngram_embedding.scales" in names
        assert quant[P + "layers.0.ple.ple_embedding.ngram_embedding"] == {"group_size": 32, "bits": 4}
        assert quant[P + "layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
        assert quant[P + "layers.1.mlp.shared_expert_gate"] == {"group_size": 64, "bits": 8}
        assert quant[P + "layers.0.attn_hyper_connection.input_mix_weight_up"] is False  # in = 32
        assert tensors[P + "layers.0.attn_hyper_connection.input_mix_weight_up.weight"].dtype == torch.bfloat16
        assert not any(k.endswith(_PLE_BUFFERS) for k in names)
        assert ("language_model.lm_head.weight" in names) != tie
        assert "mtp.layers.0.mlp.switch_mlp.up_proj.scales" in names and "mtp.fc_embedding.scales" in names
        hc = tensors[P + "layers.0.attn_hyper_connection.hc_norm.weight"].float()
        assert torch.allclose(hc, 1 + sd["model.layers.0.attn_hyper_connection.hc_norm.weight"], atol=1e-2)
        ln = tensors[P + "layers.0.linear_attn.norm.weight"].float()  # N2: no +1
        assert torch.allclose(ln, sd["model.layers.0.linear_attn.norm.weight"], atol=1e-2)
        for prefix, ex in (("model.", "fused"), ("model.language_model.", "per_expert")):
            back, mtp_back = mlx_to_hf(tensors, tcfg, quant, prefix=prefix, experts=ex,
                                       ngram_shards=None if ex == "fused" else 2)
            assert "mtp.layers.0.mlp.experts.gate_up_proj" in mtp_back or ex == "per_expert"
            if ex == "fused":
                want = {k for k in sd if not k.endswith(_PLE_BUFFERS) and not (tie and k == "lm_head.weight")}
                assert set(back) == want, sorted(set(back) ^ want)
                for k in want:
                    assert back[k].shape == sd[k].shape, k
                    tol = 0.2 if back[k].dim() >= 2 else 0.02
                    assert float((back[k] - sd[k]).abs().max()) < tol * (1 + float(sd[k].abs().max())), k
                # the dequantized weights load into the HF model and convert again to the same layout
                model.load_state_dict(back, strict=False)
                sd2 = {k: v.detach().clone() for k, v in model.state_dict().items()}
                t2, q2 = hf_to_mlx(sd2, tcfg)
                assert set(t2) == {k for k in tensors if not k.startswith("mtp.")}
                assert q2 == {kk: vv for kk, vv in quant.items() if not kk.startswith("mtp.")}
            else:
                assert "model.language_model.layers.0.mlp.experts.3.down_proj.weight" in back
                assert "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight" in back
        n_checks += 1
    if verbose:
        print(f"mlx_format selftest: OK ({n_checks} checks)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", action="store_true", help="run the self-test")
    args = ap.parse_args(argv)
    if args.selftest:
        selftest()
        return 0
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
