"""The small qwen4_exp model of tools/train_small_model.py: its geometry, the MTP draft head, and the
fast training paths that replace two slow pieces of the HF 5.17.0 reference while training.

What lives here
  * small_text_config(): the Qwen4ExpTextConfig of the embedded small model (and of the --tiny test).
  * MTPHead: spec §10 (pre_fc_norm_embedding, pre_fc_norm_hidden, fc_embedding, fc_hidden, one QSA
    decoder layer with its own experts, its own hyper_connection_mixer; embedding and lm_head shared
    with the trunk). It is attached to the HF model as `model.mtp`, so state-dict names are the
    release's `mtp.*` names.
  * trunk_forward() / mtp_forward(): the forward passes used by training, evaluation and fixtures.
  * FastPaths: training-only replacements, enabled per module instance:
      - QSA attention: the HF indexer loops over every (batch, query) pair in Python (fine for an
        oracle, hopeless for training). The replacement computes the same block scores, the same
        top-k block selection and the same mask with batched tensor ops (no cache, no padding only),
        and adds the indexer's training loss (the indexer's selection is not differentiable, so HF
        alone would leave index_qk_proj at its random init).
      - routed experts: bf16 grouped GEMM (torch grouped_mm), with a per-expert loop fallback.
    Evaluation numbers and all fixtures can be produced without them (fresh, unpatched modules).
What does not live here: data, tokenizer, optimizer, checkpoint state, export (train_small_model.py,
small_model_export.py).
"""
from __future__ import annotations

import copy
import math
import types

import torch
import torch.nn.functional as F
from torch import nn

from transformers.models.qwen4_exp import modeling_qwen4_exp as hf
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

# ---------------------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------------------

# Per-head shapes equal the released model's (GDN heads 128x128, attention head_dim 256 with a 64-dim
# partial rotary, indexer 4 heads x 128, block 4): engine kernels written for the real geometry run
# unchanged. Only counts shrink. Every Linear input dim is a multiple of 64 (MLX group size) and the
# n-gram row width (ple_embed_dim / 16 heads = 32) a multiple of 32 (the n-gram group size), so the
# 4-bit export quantizes every matrix.
FULL_GEOMETRY = dict(
    hidden_size=256,
    num_hidden_layers=6,
    # explicit list: QSA at layers 2 and 5, GDN elsewhere; PLE on 1-based layer 2 (= index 1, GDN)
    layer_types=["linear_attention", "linear_attention", "full_attention",
                 "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    hc_count=4,
    hc_lowrank=64,
    ple_layer_ids=[2],
    ple_embed_dim=512,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=4000,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=64,
    indexer_compress_ratio=4,
    max_position_embeddings=8192,
)

# --tiny: the same layer kinds, minimal sizes (CPU pipeline test in about a minute).
TINY_GEOMETRY = dict(
    hidden_size=64,
    num_hidden_layers=3,
    layer_types=["linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    hc_count=2,
    hc_lowrank=64,
    ple_layer_ids=[2],
    ple_embed_dim=512,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=500,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=32,
    indexer_budget=16,
    indexer_compress_ratio=4,
    max_position_embeddings=4096,
)


def small_text_config(vocab_size: int, eos_token_id: int, tiny: bool = False) -> Qwen4ExpTextConfig:
    geo = dict(TINY_GEOMETRY if tiny else FULL_GEOMETRY)
    return Qwen4ExpTextConfig(
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,  # <|endoftext|>: the PLE n-gram EOS rule sees document boundaries
        bos_token_id=None,
        pad_token_id=None,
        hidden_act="silu",
        output_gate_type="sigmoid",
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        initializer_range=0.02,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        split_ngram_parts=1,
        **geo,
    )


def mtp_layer_config(cfg: Qwen4ExpTextConfig) -> Qwen4ExpTextConfig:
    """The config the MTP decoder layer is built from: one QSA attention layer, no PLE."""
    mcfg = copy.deepcopy(cfg)
    mcfg.ple_layer_ids = []  # first: a strict config may re-validate on every assignment
    mcfg.layer_types = ["qwen_sparse_attention"]
    mcfg.num_hidden_layers = 1
    mcfg._attn_implementation = "sdpa"
    return mcfg


# ---------------------------------------------------------------------------------------------------
# MTP head (spec §10)
# ---------------------------------------------------------------------------------------------------


class MTPHead(nn.Module):
    """One draft step at position t: (Hin = trunk R_last[t] (wide), x = x_{t+1}) -> logits for x_{t+2}.

    pre_fc_norm_hidden is the per-stream GROUPED N1 norm (one RMS statistic per H-wide stream, as every
    other wide norm of the model, and as llama.cpp / the Rust cherenkov / the MLX port do), not the flat
    single-statistic variant of vLLM/SGLang (spec §14 open question 1). The engine must use grouped
    for this model; config.json says so in `mtp_pre_fc_norm_hidden_grouped: true`.
    """

    def __init__(self, cfg: Qwen4ExpTextConfig):
        super().__init__()
        H, S, eps = cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps
        self.hidden_size, self.hc_count = H, S
        self.pre_fc_norm_embedding = hf.Qwen4ExpTextRMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = hf.Qwen4ExpTextRMSNorm(S * H, group_size=H, eps=eps)
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)  # one matrix applied to every stream
        mcfg = mtp_layer_config(cfg)
        self.layers = nn.ModuleList([hf.Qwen4ExpTextDecoderLayer(mcfg, 0)])
        self.hyper_connection_mixer = hf.Qwen4ExpTextGatedResidual(mcfg, use_combine=False)

    def inject(self, r_last: torch.Tensor, emb_next: torch.Tensor) -> torch.Tensor:
        """R0 = concat_s bf16(fe + fh_s): r_last [B,T,S*H], emb_next [B,T,H] -> [B,T,S*H]."""
        fe = self.fc_embedding(self.pre_fc_norm_embedding(emb_next))
        hn = self.pre_fc_norm_hidden(r_last).unflatten(-1, (self.hc_count, self.hidden_size))
        fh = self.fc_hidden(hn)
        return (fe.unsqueeze(-2) + fh).flatten(-2)


def attach_mtp(model: hf.Qwen4ExpForCausalLM) -> MTPHead:
    """Build the MTP head, initialise it like the trunk (HF _init_weights), attach as model.mtp."""
    mtp = MTPHead(model.config)
    mtp.apply(model._init_weights)
    mtp.to(next(model.parameters()).dtype)
    model.mtp = mtp
    return mtp


def build_model(cfg: Qwen4ExpTextConfig, seed: int = 0) -> hf.Qwen4ExpForCausalLM:
    torch.manual_seed(seed)
    cfg._attn_implementation = "sdpa"
    model = hf.Qwen4ExpForCausalLM(cfg)
    attach_mtp(model)
    return model


# ---------------------------------------------------------------------------------------------------
# Forward helpers
# ---------------------------------------------------------------------------------------------------


def _text_position_ids(batch: int, length: int, device, offset: int = 0) -> torch.Tensor:
    pos = torch.arange(offset, offset + length, device=device)
    return pos.view(1, 1, -1).expand(3, batch, -1)


def causal_bool_mask(batch: int, length: int, device) -> torch.Tensor:
    m = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return m.view(1, 1, length, length).expand(batch, 1, length, length)


class _Capture:
    """Forward pre-hook on the trunk's hyper_connection_mixer: keeps R_last (pre-mixer wide residual)."""

    def __init__(self, model):
        self.value = None
        self.handle = model.model.hyper_connection_mixer.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.value = args[0]

    def remove(self):
        self.handle.remove()


def trunk_forward(model, input_ids: torch.Tensor):
    """No-cache trunk forward. Returns (logits [B,T,V], R_last [B,T,S*H])."""
    cap = _Capture(model)
    try:
        out = model.model(input_ids=input_ids, use_cache=False)
        r_last = cap.value
    finally:
        cap.remove()
    logits = model.lm_head(out.last_hidden_state)
    return logits, r_last


def mtp_forward(model, r_last: torch.Tensor, next_ids: torch.Tensor, return_hidden: bool = False):
    """MTP over positions 0..T-1 at once (training, evaluation, fixtures).

    Row t pairs r_last[:, t] (the trunk's pre-mixer wide residual at position t) with next_ids[:, t]
    (= x_{t+1}) at RoPE position t, and predicts x_{t+2}. Causal attention over the MTP's own rows,
    exactly what the engine's MTP caches hold when every slot i was written from (R_last[i], x_{i+1}).
    Returns logits [B,T,V] (and R1, the head's pre-mixer wide output, when return_hidden).
    """
    mtp = model.mtp
    B, T = next_ids.shape
    r0 = mtp.inject(r_last, model.model.embed_tokens(next_ids))
    pos_emb = model.model.rotary_emb(r0, _text_position_ids(B, T, r0.device))
    r1 = mtp.layers[0](
        r0,
        position_embeddings=pos_emb,
        attention_mask=causal_bool_mask(B, T, r0.device),
        conv_mask=None,
        past_key_values=None,
        ple_input_ids=None,
    )
    logits = model.lm_head(mtp.hyper_connection_mixer(r1))
    return (logits, r1) if return_hidden else logits


def routers(model):
    return [m for m in model.modules() if isinstance(m, hf.Qwen4ExpTextTopKRouter)]


def attentions(model):
    return [m for m in model.modules() if isinstance(m, hf.Qwen4ExpTextAttention)]


# ---------------------------------------------------------------------------------------------------
# QSA indexer, batched (same maths as Qwen4ExpTextQSAIndexer.forward for one unpadded, uncached call)
# ---------------------------------------------------------------------------------------------------


def indexer_block_scores(indexer, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, return_max_dot: bool = False):
    """Block scores [B, T, NB] fp32 for queries 0..T-1 against complete blocks 0..NB-1 (NB = T // r).

    score[t, b] = sum_h relu(<q~_h(t), K^_b>) / sqrt(D): q~ = RoPE(q_layernorm(q), t); K^_b =
    RoPE(k_layernorm(bf16(mean of the 4 raw keys)), 4b). Entries with b >= floor((t+1)/r) are not visible
    to query t and must be masked by the caller. With return_max_dot, also returns max_h <q~_h, K^_b> /
    sqrt(D) (before the ReLU) for the positivity loss. None (or (None, None)) when T < r.
    """
    B, T, _ = u.shape
    D, nh, r = indexer.index_head_dim, indexer.index_n_heads, indexer.compress_ratio
    qk = indexer.index_qk_proj(u)
    q, raw = torch.split(qk, [nh * D, indexer.index_kv_heads * D], dim=-1)
    q = indexer.q_layernorm(q.reshape(B, T, nh, D))
    q = hf.apply_rotary_pos_emb(q, cos=cos, sin=sin, unsqueeze_dim=2)
    nb = T // r
    if nb == 0:
        return (None, None) if return_max_dot else None
    raw = raw.reshape(B, T, D)
    pooled = raw[:, : nb * r].reshape(B, nb, r, D).float().mean(dim=2).to(raw.dtype)
    pooled = indexer.k_layernorm(pooled)
    kb = hf.apply_rotary_pos_emb(pooled.unsqueeze(2), cos=cos[:, 0 : nb * r : r], sin=sin[:, 0 : nb * r : r],
                                 unsqueeze_dim=2).squeeze(2)
    dots = torch.einsum("bthd,bnd->bthn", q.float(), kb.float())
    scores = torch.relu(dots).sum(dim=2) / math.sqrt(D)
    if return_max_dot:
        return scores, dots.amax(dim=2) / math.sqrt(D)
    return scores


def visible_blocks(T: int, r: int, device) -> torch.Tensor:
    """[T, NB] bool: block b is complete and visible to query t (b < floor((t+1)/r))."""
    nb = T // r
    t = torch.arange(T, device=device)
    return torch.arange(nb, device=device)[None, :] < ((t + 1) // r)[:, None]


def selection_mask(scores: torch.Tensor | None, T: int, r: int, block_topk: int, device) -> torch.Tensor:
    """[B or 1, T, T] bool: the tokens each query may attend to (selected complete blocks, plus its
    trailing incomplete block, which is always kept). Causality is implied."""
    t = torch.arange(T, device=device)
    j = torch.arange(T, device=device)
    tail_start = ((t + 1) // r) * r
    tail = (j[None, :] >= tail_start[:, None]) & (j[None, :] <= t[:, None])  # [T, T]
    if scores is None:
        return tail.unsqueeze(0)
    B, _, nb = scores.shape
    valid = visible_blocks(T, r, device)
    k = min(block_topk, nb)
    idx = scores.masked_fill(~valid, float("-inf")).topk(k, dim=-1).indices
    chosen = torch.zeros(B, T, nb, dtype=torch.bool, device=device).scatter(-1, idx, True) & valid
    tok = chosen.repeat_interleave(r, dim=-1)
    tok = F.pad(tok, (0, T - nb * r))
    return tok | tail.unsqueeze(0)


def topk_gap(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Relative gap (s_k - s_{k+1}) / max(|s_k|, tiny) between the k-th and (k+1)-th visible scores for
    every row with more than k visible entries; +inf for rows where selection is not needed."""
    n_valid = valid.sum(-1)
    s = scores.float().masked_fill(~valid, float("-inf"))
    kk = min(k + 1, s.shape[-1])
    top = s.topk(kk, dim=-1).values
    gap = torch.full(s.shape[:-1], float("inf"), device=s.device)
    if kk == k + 1:
        sk, sk1 = top[..., k - 1], top[..., k]
        rel = (sk - sk1) / sk.abs().clamp_min(1e-12)
        gap = torch.where(n_valid > k, rel, gap)
    return gap


# ---------------------------------------------------------------------------------------------------
# Fast paths (training)
# ---------------------------------------------------------------------------------------------------


class FastPaths:
    """Per-instance replacements of Qwen4ExpTextAttention.forward and Qwen4ExpTextExperts.forward.

    Attention (only when called without a cache; otherwise the HF path runs):
      * the same selection as HF, batched;
      * SDPA with the combined causal & selection mask, as HF's sdpa path;
      * if collect_indexer_loss: KL(dense attention block mass || softmax of indexer block scores), the
        DeepSeek-V3.2 "lightning indexer" objective: the target is the main heads' dense causal attention
        (no grad), mean over heads, summed per complete visible block and renormalised; the indexer runs
        on a detached input, so this loss trains only the indexer. Rows with < 2 visible blocks skipped.
        Plus indexer_pos_weight * a hinge keeping every visible block's score above indexer_margin
        (_indexer_positivity: no exact ties at 0).
    Experts: tokens sorted by expert, bf16 grouped GEMMs (or one GEMM per expert), weighted sum over the
    top-k slots (fp32 accumulate, one rounding), as HF's grouped_mm backend.
    """

    def __init__(self, model, use_grouped_mm: bool = True):
        self.model = model
        self.enabled = True
        self.collect_indexer_loss = False
        self.indexer_losses: list[torch.Tensor] = []
        self.router_logits: list[torch.Tensor] = []
        self.collect_router_logits = False
        self.use_grouped_mm = use_grouped_mm
        self.indexer_margin = 1.0
        self.indexer_pos_weight = 0.1
        self._handles = []
        for m in attentions(model):
            m.forward = types.MethodType(self._attn_forward_factory(), m)
        for m in model.modules():
            if isinstance(m, hf.Qwen4ExpTextExperts):
                m.forward = types.MethodType(self._experts_forward_factory(), m)
        for r in routers(model):
            self._handles.append(r.register_forward_hook(self._router_hook))

    def _router_hook(self, module, args, output):
        if self.collect_router_logits:
            self.router_logits.append(output[0])

    def reset(self):
        self.indexer_losses = []
        self.router_logits = []

    # -- attention -------------------------------------------------------------------------------
    def _attn_forward_factory(self):
        paths = self
        orig = hf.Qwen4ExpTextAttention.forward

        def forward(mod, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
            if past_key_values is not None or not paths.enabled or attention_mask is None \
                    or attention_mask.dtype != torch.bool:
                return orig(mod, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
            B, T, _ = hidden_states.shape
            cos, sin = position_embeddings
            idx = mod.indexer
            r = idx.compress_ratio
            scores, max_dot = indexer_block_scores(idx, hidden_states.detach(), cos, sin, return_max_dot=True)
            with torch.no_grad():
                sel = selection_mask(scores.detach() if scores is not None else None, T, r, idx.block_topk,
                                     hidden_states.device)
                mask = attention_mask & sel.unsqueeze(1)
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, mod.head_dim)
            q, gate = torch.chunk(mod.q_proj(hidden_states).view(*input_shape, -1, mod.head_dim * 2), 2, dim=-1)
            gate = gate.reshape(*input_shape, -1)
            q = mod.q_norm(q.view(hidden_shape)).transpose(1, 2)
            k = mod.k_norm(mod.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            v = mod.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
            k_rep = hf.repeat_kv(k, mod.num_key_value_groups)
            v_rep = hf.repeat_kv(v, mod.num_key_value_groups)
            if q.dtype != k_rep.dtype:
                k_rep, v_rep = k_rep.to(q.dtype), v_rep.to(q.dtype)
            attn = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, scale=mod.scaling)
            attn = attn.transpose(1, 2).reshape(*input_shape, -1)
            attn = attn * torch.sigmoid(gate)
            out = mod.o_proj(attn)
            if paths.collect_indexer_loss and scores is not None and T // r >= 2:
                kl = _indexer_kl(q.detach(), k_rep.detach(), mod.scaling, scores, r)
                pos = _indexer_positivity(max_dot, r, paths.indexer_margin)
                paths.indexer_losses.append(kl + paths.indexer_pos_weight * pos)
            return out, None

        return forward

    # -- experts ---------------------------------------------------------------------------------
    def _experts_forward_factory(self):
        paths = self

        def forward(mod, hidden_states, top_k_index, top_k_weights):
            N, H = hidden_states.shape
            k = top_k_index.shape[1]
            E = mod.num_experts
            dt = torch.get_autocast_dtype("cuda") if (hidden_states.is_cuda and torch.is_autocast_enabled("cuda")) \
                else hidden_states.dtype
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            tok = order // k
            x = hidden_states[tok].to(dt)
            counts = torch.bincount(flat, minlength=E)
            w1 = mod.gate_up_proj.to(dt)  # [E, 2I, H]
            w2 = mod.down_proj.to(dt)  # [E, H, I]
            if paths.use_grouped_mm:
                offs = torch.cumsum(counts, 0).to(torch.int32)
                h = F.grouped_mm(x, w1.transpose(1, 2), offs=offs)
                g, up = h.chunk(2, dim=-1)
                y = F.grouped_mm(F.silu(g) * up, w2.transpose(1, 2), offs=offs)
            else:
                ys = []
                start = 0
                for e, c in enumerate(counts.tolist()):
                    if c == 0:
                        continue
                    xe = x[start : start + c]
                    g, up = F.linear(xe, w1[e]).chunk(2, dim=-1)
                    ys.append(F.linear(F.silu(g) * up, w2[e]))
                    start += c
                y = torch.cat(ys, 0)
            y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
            unsorted = torch.empty_like(y)
            unsorted[order] = y
            return unsorted.view(N, k, H).sum(dim=1).to(hidden_states.dtype)

        return forward


def _indexer_kl(q, k, scaling, scores, r):
    """KL(target || softmax(scores)) averaged over rows with >= 2 visible blocks. q,k [B,h,T,D] (detached)."""
    B, T, nb = scores.shape
    device = scores.device
    valid = visible_blocks(T, r, device)  # [T, nb]
    with torch.no_grad():
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).mean(dim=1)  # [B,T,T]
        pb = p[..., : nb * r].reshape(B, T, nb, r).sum(-1).masked_fill(~valid, 0.0)
        pb = pb / pb.sum(-1, keepdim=True).clamp_min(1e-12)
        logp = torch.log(pb.clamp_min(1e-12))
    logq = torch.log_softmax(scores.float().masked_fill(~valid, float("-inf")), dim=-1)
    kl = (pb * (logp - logq.masked_fill(~valid, 0.0))).masked_fill(~valid, 0.0).sum(-1)  # [B,T]
    rows = valid.sum(-1) >= 2
    return kl[:, rows].mean()


def _indexer_positivity(max_dot, r, margin):
    """mean over visible (query, block) pairs of relu(margin - max_h <q~_h, K^_b>/sqrt(D)).

    Keeps every visible block's score >= margin > 0. Without it the KL drives unattended blocks to an
    exact 0 (all heads ReLU'd away), and the top-k then meets exact ties at 0 whenever fewer than
    budget/r blocks score above 0: ties that torch resolves arbitrarily and the engine by lower index
    (spec trap 29). With it, unattended blocks sit near the margin with distinct scores, and the softmax
    mass the KL cares about is unchanged (the margin is small next to the scores of attended blocks).
    """
    B, T, nb = max_dot.shape
    valid = visible_blocks(T, r, max_dot.device)
    pen = torch.relu(margin - max_dot).masked_fill(~valid, 0.0)
    return pen.sum() / (valid.sum() * B).clamp_min(1)


def load_balance_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-style auxiliary loss, averaged over layers: E * sum_e f_e * P_e (1.0 when balanced)."""
    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        E = probs.shape[-1]
        idx = probs.topk(top_k, dim=-1).indices
        f = torch.zeros(E, device=probs.device).scatter_add_(0, idx.reshape(-1),
                                                            torch.ones(idx.numel(), device=probs.device))
        f = f / idx.numel()
        total = total + E * (f * probs.mean(0)).sum()
    return total / max(1, len(router_logits))
