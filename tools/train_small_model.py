#!/usr/bin/env python3
"""Train, evaluate and export the small qwen4_exp text model (trunk + MTP head) that Cherenkov embeds.

Pipeline (each stage logs to stdout and to <work>/train_log.txt):
  1. corpus   the *.py/*.md/*.rst/*.txt files of this interpreter's stdlib and site-packages,
              deterministic order, deduplicated, fixed held-out split by content hash (small_model_data.py)
  2. tokenizer  byte-level BPE (Qwen split regex, ByteLevel), 8192 tokens, trained here or restored
  3. model    HF Qwen4ExpForCausalLM (GDN + QSA layers, hc 4, PLE, 32 experts top-4, shared expert,
              sigmoid output gate) + the spec §10 MTP head (small_model_arch.py)
  4. train    AdamW, bf16 autocast, next-token CE + mtp_weight * MTP CE (t -> x_{t+2} from R_last[t] and
              x_{t+1}) + router load-balance loss + QSA indexer loss (KL to dense attention + positivity
              hinge); warmup-stable-decay learning rate, the decay in the final call (--final)
  5. state    --state DIR: resumed if present, saved every --save-every seconds and at the end
  6. eval     held-out perplexity, MTP first-draft acceptance, greedy samples
  7. export   --export DIR: MLX 4-bit g64 checkpoint + tokenizer + configs, and DIR/fixture (float32 on the
              dequantized export) (small_model_export.py)
  8. bundle   --out DIR: train_log.txt (live), state.tar.partNN (at every save), results.tar.gz,
              export.tar.gz.partNN (<= 8 files, each <= 15.9 MB)

Run `--help` for options; models/README.md has the exact commands of the GPU run.
"""
from __future__ import annotations

T_START = __import__("time").time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import glob  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import small_model_arch as A  # noqa: E402
import small_model_data as D  # noqa: E402

STATE_VERSION = 1
PART_BYTES = 15_900_000  # each file returned from the GPU machine must stay under 16 MB
CSV_HEADER = "step,tokens,train_s,wall_s,lr,loss,ce,mtp_ce,aux,idx_kl,grad_norm,tok_per_s,phase"

# ---------------------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------------------

_LOG_FILE = None


_LOG_MIRROR = None  # $OUT/train_log.txt: comes back even if the process is killed at the time limit


def log(msg: str) -> None:
    line = f"[{time.time() - T_START:7.1f}s] {msg}"
    print(line, flush=True)
    for path in (_LOG_FILE, _LOG_MIRROR):
        if path is not None:
            with open(path, "a") as fh:
                fh.write(line + "\n")


# ---------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state", help="checkpoint dir: resumed if it holds a state, saved to during/after training")
    p.add_argument("--export", help="write the MLX 4-bit checkpoint here (and DIR/fixture)")
    p.add_argument("--out", help="bundle results/state/export into this dir (the GPU machine's $OUT)")
    p.add_argument("--no-out-state", action="store_true", help="do not put the state into --out")
    p.add_argument("--work", default="out/small_model_work", help="logs, loss.csv, metrics.json, samples")
    p.add_argument("--tiny", action="store_true", help="tiny model and corpus: CPU pipeline test")
    p.add_argument("--device", default="auto")
    p.add_argument("--cpu-threads", type=int, default=0, help="torch CPU threads (0: min(8, cores))")
    p.add_argument("--seed", type=int, default=1234)
    # time / steps
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="wall seconds for the whole process (from its start); training stops early enough "
                        "that eval/export/save fit (see --reserve). 0: no limit")
    p.add_argument("--reserve", type=float, default=-1.0,
                   help="seconds kept for the work after training (default: 150 with --export, 45 without)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps in total")
    p.add_argument("--train-steps", type=int, default=0, help="stop after this many steps in this call")
    p.add_argument("--save-every", type=float, default=150.0, help="seconds between periodic state saves")
    p.add_argument("--final", choices=["auto", "yes", "no"], default="auto",
                   help="decay the learning rate to its end in this call (auto: yes iff --export)")
    # data
    p.add_argument("--corpus-mb", type=float, default=None, help="train corpus cap (default 160; tiny 2)")
    p.add_argument("--val-mb", type=float, default=None, help="held-out cap (default 3; tiny 0.3)")
    p.add_argument("--val-permille", type=int, default=20)
    p.add_argument("--tok-train-mb", type=float, default=None, help="text for BPE training (default 24)")
    p.add_argument("--vocab-size", type=int, default=None, help="default 8192; tiny 1024")
    # optimisation
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 64; tiny 4)")
    p.add_argument("--seq-len", type=int, default=None, help="default 512; tiny 96")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1.5e-3)")
    p.add_argument("--min-lr-frac", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 150; tiny 5)")
    p.add_argument("--decay-frac", type=float, default=0.25,
                   help="fraction of all training time (over all calls) spent in the final decay")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--aux-weight", type=float, default=0.01, help="router load-balance loss weight")
    p.add_argument("--indexer-weight", type=float, default=0.1, help="QSA indexer loss weight")
    p.add_argument("--indexer-margin", type=float, default=1.0,
                   help="indexer positivity hinge: every visible block's max head dot / sqrt(D) >= this")
    p.add_argument("--indexer-pos-weight", type=float, default=0.1, help="weight of that hinge in the indexer loss")
    p.add_argument("--refill-steps", type=int, default=12,
                   help="after a resume: steps at lr 0 that rebuild the Adam moments (not stored)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--no-grouped-mm", action="store_true", help="experts: one GEMM per expert")
    # evaluation
    p.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens for ppl (default 262144)")
    p.add_argument("--accept-prompts", type=int, default=None, help="greedy-acceptance prompts (default 32)")
    p.add_argument("--accept-prompt-len", type=int, default=128)
    p.add_argument("--accept-gen", type=int, default=64)
    p.add_argument("--sample-tokens", type=int, default=96)
    p.add_argument("--fixture-len", type=int, default=None, help="fixture prompt length (default 128)")
    p.add_argument("--fixture-greedy", type=int, default=32)
    p.add_argument("--eval", choices=["auto", "full", "quick", "none"], default="auto",
                   help="full: perplexity, teacher-forced and greedy MTP acceptance, samples; quick: the first "
                        "two on fewer tokens; auto: full with --export, else quick")
    a = p.parse_args(argv)
    tiny = a.tiny

    def dflt(name, full, small):
        if getattr(a, name) is None:
            setattr(a, name, small if tiny else full)

    dflt("corpus_mb", 160.0, 2.0)
    dflt("val_mb", 3.0, 0.3)
    dflt("tok_train_mb", 24.0, 2.0)
    dflt("vocab_size", 8192, 1024)
    dflt("batch_size", 64, 4)
    dflt("seq_len", 512, 96)
    dflt("lr", 1.5e-3, 3e-3)
    dflt("warmup", 150, 5)
    dflt("eval_tokens", 262144, 4096)
    dflt("accept_prompts", 32, 4)
    dflt("fixture_len", 128, 80)
    if tiny:
        a.accept_prompt_len, a.accept_gen, a.sample_tokens, a.fixture_greedy = 40, 12, 24, 8
    if a.eval == "auto":
        a.eval = "full" if a.export else "quick"
    if a.reserve < 0:
        a.reserve = (150.0 if a.export else 45.0) if not tiny else 20.0
    return a


# ---------------------------------------------------------------------------------------------------
# State: bf16 weights (byte planes, zlib) + step counters + tokenizer + loss curve, as tar parts
# ---------------------------------------------------------------------------------------------------
#
# The Adam moments are NOT stored: with fp32 moments the state would be 3x larger than the 64 MiB that
# can be carried to the GPU machine. After a resume, --refill-steps steps at learning rate 0 rebuild
# them (bias-corrected Adam from fresh moments), then the schedule continues. Weights are stored in
# bf16: their rounding error (2^-9 relative) is far below one Adam step at the learning rates used.


def _pack_state(model, meta: dict, tok_json: str, csv_text: str) -> bytes:
    index, hi_parts, lo_parts, ints = [], [], [], []
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if t.is_floating_point():
            b = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
            lo_parts.append(b[:, 0].tobytes())
            hi_parts.append(b[:, 1].tobytes())
            index.append({"name": name, "shape": list(t.shape), "kind": "bf16"})
        else:
            ints.append(t.to(torch.int64).contiguous().numpy().tobytes())
            index.append({"name": name, "shape": list(t.shape), "kind": "i64"})
    files = {
        "meta.json": json.dumps(meta, indent=1).encode(),
        "index.json": json.dumps(index).encode(),
        "tokenizer.json": tok_json.encode(),
        "loss.csv": csv_text.encode(),
        "weights.hi.z": zlib.compress(b"".join(hi_parts), 1),
        "weights.lo.z": zlib.compress(b"".join(lo_parts), 1),
        "ints.bin": b"".join(ints),
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def save_state(state_dir: str, model, meta: dict, tok_json: str, csv_text: str) -> int:
    t0 = time.time()
    blob = _pack_state(model, meta, tok_json, csv_text)
    tmp = state_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for i in range(0, len(blob), PART_BYTES):
        with open(os.path.join(tmp, f"state.tar.part{i // PART_BYTES:02d}"), "wb") as fh:
            fh.write(blob[i : i + PART_BYTES])
    old = state_dir.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(state_dir):
        os.rename(state_dir, old)
    os.rename(tmp, state_dir)
    shutil.rmtree(old, ignore_errors=True)
    n_parts = (len(blob) + PART_BYTES - 1) // PART_BYTES
    log(f"[state] saved {state_dir}: {len(blob) / 1e6:.1f} MB in {n_parts} parts, step {meta['step']} "
        f"({time.time() - t0:.1f}s)")
    return len(blob)


def load_state(state_dir: str):
    parts = sorted(glob.glob(os.path.join(state_dir, "state.tar.part*")))
    if not parts:
        return None
    blob = b"".join(open(p, "rb").read() for p in parts)
    files = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        for m in tar.getmembers():
            files[m.name] = tar.extractfile(m).read()
    meta = json.loads(files["meta.json"])
    if meta.get("version") != STATE_VERSION:
        raise SystemExit(f"state {state_dir}: version {meta.get('version')}, expected {STATE_VERSION}")
    index = json.loads(files["index.json"])
    hi = np.frombuffer(zlib.decompress(files["weights.hi.z"]), dtype=np.uint8)
    lo = np.frombuffer(zlib.decompress(files["weights.lo.z"]), dtype=np.uint8)
    ints = files["ints.bin"]
    sd, fo, io_ = {}, 0, 0
    for e in index:
        n = int(np.prod(e["shape"])) if e["shape"] else 1
        if e["kind"] == "bf16":
            b = np.empty((n, 2), dtype=np.uint8)
            b[:, 0], b[:, 1] = lo[fo : fo + n], hi[fo : fo + n]
            fo += n
            t = torch.from_numpy(b.reshape(-1).view(np.int16).copy()).view(torch.bfloat16).float()
        else:
            t = torch.from_numpy(np.frombuffer(ints, dtype=np.int64, count=n, offset=io_).copy())
            io_ += 8 * n
        sd[e["name"]] = t.reshape(e["shape"])
    log(f"[state] loaded {state_dir}: {len(parts)} parts, {len(blob) / 1e6:.1f} MB, step {meta['step']}")
    return dict(meta=meta, state_dict=sd, tokenizer_json=files["tokenizer.json"].decode(),
                csv=files["loss.csv"].decode())


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.dim() >= 2 and "conv1d" not in name
        is_table = name.endswith("embed_tokens.weight") or "ngram_embedding" in name
        (decay if is_matrix and not is_table else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def sample_batch(tokens: torch.Tensor, batch: int, length: int, step: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - length, (batch,), generator=g).to(tokens.device)
    idx = starts[:, None] + torch.arange(length, device=tokens.device)[None, :]
    return tokens[idx].long()


def autocast_ctx(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def compute_losses(model, paths, window: torch.Tensor, args, cfg, train: bool = True):
    """window [B, T+1]: trunk reads x_0..x_{T-1}; MTP row t reads (R_last[t], x_{t+1}) -> x_{t+2}."""
    x = window[:, :-1]
    paths.reset()
    paths.collect_router_logits = train
    paths.collect_indexer_loss = train
    logits, r_last = A.trunk_forward(model, x)
    V = logits.shape[-1]
    ce = F.cross_entropy(logits.float().reshape(-1, V), window[:, 1:].reshape(-1))
    mtp_logits = A.mtp_forward(model, r_last[:, :-1], window[:, 1:-1])
    mtp_ce = F.cross_entropy(mtp_logits.float().reshape(-1, V), window[:, 2:].reshape(-1))
    zero = logits.new_zeros((), dtype=torch.float32)
    aux = A.load_balance_loss(paths.router_logits, cfg.num_experts_per_tok) if paths.router_logits else zero
    idx = torch.stack(paths.indexer_losses).mean() if paths.indexer_losses else zero
    paths.collect_router_logits = paths.collect_indexer_loss = False
    paths.reset()
    loss = ce + args.mtp_weight * mtp_ce + args.aux_weight * aux + args.indexer_weight * idx
    return loss, dict(ce=ce, mtp_ce=mtp_ce, aux=aux, idx_kl=idx), logits, mtp_logits


def validate_grouped_mm(device) -> bool:
    """grouped_mm forward and backward on this device/dtype agree with the per-expert loop."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        torch.manual_seed(0)
        E, H, I, N, k = 4, 64, 32, 37, 2
        w1 = torch.randn(E, 2 * I, H, device=device, requires_grad=True)
        w2 = torch.randn(E, H, I, device=device, requires_grad=True)
        x = torch.randn(N, H, device=device)
        idx = torch.randint(0, E, (N, k), device=device)
        wt = torch.rand(N, k, device=device)

        class M(torch.nn.Module):
            pass

        outs = []
        for use in (True, False):
            m = M()
            m.gate_up_proj, m.down_proj, m.num_experts = w1, w2, E
            paths = A.FastPaths.__new__(A.FastPaths)
            paths.use_grouped_mm = use
            fwd = paths._experts_forward_factory()
            with autocast_ctx(device):
                y = fwd(m, x, idx, wt)
            g1, g2 = torch.autograd.grad(y.float().square().sum(), [w1, w2])
            outs.append((y.float(), g1, g2))
        ok = all(torch.allclose(a.detach(), b.detach(), rtol=5e-2, atol=5e-2 * float(b.detach().abs().max()))
                 for a, b in zip(outs[0], outs[1]))
        return bool(ok)
    except Exception as e:  # noqa: BLE001
        log(f"[train] grouped_mm unavailable ({type(e).__name__}: {e}); using the per-expert loop")
        return False


class Schedule:
    """Warmup (steps), then constant, then - in the final call - a linear decay in wall time to
    min_lr_frac at the training deadline, over decay_frac of all training time (all calls)."""

    def __init__(self, args, step0, prior_train_s, t_train0, deadline, final):
        self.a, self.final = args, final
        self.decay_s = 0.0
        self.t_end = deadline
        if final and deadline is not None:
            this_call = max(1.0, deadline - t_train0)
            self.decay_s = min(0.8 * this_call, args.decay_frac * (prior_train_s + this_call))
        self.step_total_end = args.max_steps if args.max_steps else None
        if final and args.train_steps:
            self.step_total_end = step0 + args.train_steps
        self.decay_steps = int(args.decay_frac * self.step_total_end) if (final and self.step_total_end) else 0

    def lr(self, step, now):
        a = self.a
        mult = min(1.0, (step + 1) / max(1, a.warmup))
        if self.final:
            if self.decay_s > 0 and self.t_end is not None:
                rem = self.t_end - now
                if rem < self.decay_s:
                    mult *= max(a.min_lr_frac, rem / self.decay_s)
            elif self.decay_steps > 0:
                rem = self.step_total_end - step
                if rem < self.decay_steps:
                    mult *= max(a.min_lr_frac, rem / self.decay_steps)
        return a.lr * mult


def train(model, paths, opt, train_tokens, args, cfg, device, run):
    """The loop. `run` holds step counters, csv rows, state-saving closure; returns when done."""
    B, T = args.batch_size, args.seq_len
    deadline = (T_START + args.time_budget - args.reserve) if args.time_budget > 0 else None
    t_train0 = time.time()
    sched = Schedule(args, run["step"], run["train_s"], t_train0, deadline, run["final"])
    if run["final"]:
        log(f"[train] final call: decay over the last {sched.decay_s:.0f}s" if sched.decay_s else
            f"[train] final call: decay over the last {sched.decay_steps} steps")
    model.train()
    step_times = []
    last_save = time.time()
    pending = []
    refill = run["refill"]
    steps_this_call = 0
    t_log = time.time()
    tokens_log = 0
    while True:
        if args.max_steps and run["step"] >= args.max_steps:
            log("[train] reached --max-steps")
            break
        if args.train_steps and steps_this_call >= args.train_steps:
            log("[train] reached --train-steps")
            break
        est = (sorted(step_times)[len(step_times) // 2] if step_times else 0.0) * 1.5
        if deadline is not None and time.time() + est > deadline:
            log(f"[train] time budget: stopping with {deadline - time.time():.0f}s left before the reserve")
            break
        t0 = time.time()
        phase = "refill" if refill > 0 else "train"
        lr = 0.0 if refill > 0 else sched.lr(run["step"], t0)
        for g in opt.param_groups:
            g["lr"] = lr
        window = sample_batch(train_tokens, B, T + 1, run["samples_drawn"], args.seed)
        run["samples_drawn"] += 1
        try:
            with autocast_ctx(device):
                loss, parts, _, _ = compute_losses(model, paths, window, args, cfg)
            loss.backward()
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            paths.reset()
            del window
            torch.cuda.empty_cache()
            if B <= 8:
                raise
            B //= 2
            args.batch_size = B
            log(f"[train] out of memory: batch size -> {B}")
            continue
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append((run["step"], lr, phase, loss.detach(), {k: v.detach() for k, v in parts.items()}, gn.detach()))
        if refill > 0:
            refill -= 1
        else:
            run["step"] += 1
            run["tokens"] += B * T
        steps_this_call += 1
        tokens_log += B * T
        if device.type == "cuda" and steps_this_call <= 3:
            torch.cuda.synchronize()
        dt = time.time() - t0
        step_times = (step_times + [dt])[-20:]
        run["train_s"] += dt
        if len(pending) >= args.log_every or steps_this_call <= 3:
            now = time.time()
            tps = tokens_log / max(1e-9, now - t_log)
            ms_step = 1000 * (now - t_log) / len(pending)
            t_log, tokens_log = now, 0
            for (s, lr_, ph, l_, p_, g_) in pending:
                row = [s, run["tokens"], f"{run['train_s']:.1f}", f"{now - T_START:.1f}", f"{lr_:.3e}",
                       f"{l_.item():.4f}", f"{p_['ce'].item():.4f}", f"{p_['mtp_ce'].item():.4f}",
                       f"{p_['aux'].item():.4f}", f"{p_['idx_kl'].item():.4f}", f"{g_.item():.3f}",
                       f"{tps:.0f}", ph]
                run["csv"].append(",".join(str(v) for v in row))
            s, lr_, ph, l_, p_, g_ = pending[-1]
            mem = f", mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else ""
            log(f"[train] step {s} {ph} lr {lr_:.2e} loss {l_.item():.3f} ce {p_['ce'].item():.3f} "
                f"mtp {p_['mtp_ce'].item():.3f} aux {p_['aux'].item():.3f} idx {p_['idx_kl'].item():.3f} "
                f"gn {g_.item():.2f} | {tps:,.0f} tok/s, {ms_step:.0f} ms/step{mem}")
            pending = []
            if not math.isfinite(l_.item()):
                raise SystemExit("[train] loss is not finite: stopping")
        near_end = deadline is not None and deadline - time.time() < 60
        if run["save"] is not None and time.time() - last_save > args.save_every and not near_end:
            run["save"]()
            last_save = time.time()
    run["steps_this_call"] = steps_this_call


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, paths, val_tokens: torch.Tensor, args, cfg, device) -> dict:
    """Held-out perplexity and teacher-forced MTP acceptance over non-overlapping windows of seq_len.

    acceptance_teacher_forced = mean over t in [0, T-2] of [argmax MTP(R_last[t], x_{t+1}) ==
    argmax trunk logits at t+1], with x_{t+1} the true held-out token.
    """
    model.eval()
    T = args.seq_len
    n_win = max(1, min(args.eval_tokens // T, (val_tokens.numel() - 1) // (T + 1)))
    starts = torch.arange(n_win) * T
    tot = dict(nll=0.0, n=0, mtp_nll=0.0, mtp_n=0, acc=0, mtp_acc=0, accept=0, accept_n=0)
    bs = max(1, args.batch_size // 2)
    for i in range(0, n_win, bs):
        s = starts[i : i + bs]
        idx = s[:, None].to(val_tokens.device) + torch.arange(T + 1, device=val_tokens.device)[None, :]
        w = val_tokens[idx].long()
        with autocast_ctx(device):
            _, parts, logits, mtp_logits = compute_losses(model, paths, w, args, cfg, train=False)
        nb = w.shape[0]
        tot["nll"] += parts["ce"].item() * nb * T
        tot["n"] += nb * T
        tot["mtp_nll"] += parts["mtp_ce"].item() * nb * (T - 1)
        tot["mtp_n"] += nb * (T - 1)
        am = logits.argmax(-1)  # [B, T]: trunk greedy for x_{t+1}
        tot["acc"] += (am == w[:, 1:]).sum().item()
        dm = mtp_logits.argmax(-1)  # [B, T-1]: row t drafts x_{t+2}
        tot["mtp_acc"] += (dm == w[:, 2:]).sum().item()
        tot["accept"] += (dm == am[:, 1:]).sum().item()
        tot["accept_n"] += dm.numel()
    res = dict(
        val_tokens=tot["n"],
        val_loss=tot["nll"] / tot["n"],
        val_ppl=math.exp(tot["nll"] / tot["n"]),
        val_mtp_loss=tot["mtp_nll"] / tot["mtp_n"],
        val_top1=tot["acc"] / tot["n"],
        val_mtp_top1=tot["mtp_acc"] / tot["mtp_n"],
        acceptance_teacher_forced=tot["accept"] / tot["accept_n"],
    )
    log(f"[eval] held-out: {tot['n']:,} tokens, loss {res['val_loss']:.4f}, ppl {res['val_ppl']:.3f}, "
        f"top-1 {res['val_top1']:.3f}; MTP loss {res['val_mtp_loss']:.4f}, MTP top-1 (x_t+2) "
        f"{res['val_mtp_top1']:.3f}, first-draft acceptance (teacher forced) {res['acceptance_teacher_forced']:.3f}")
    return res


@torch.no_grad()
def greedy_generate(model, prompt: torch.Tensor, n_new: int, device) -> torch.Tensor:
    """Greedy continuation by recomputing the full sequence each step (no cache). prompt [B, P]."""
    seq = prompt
    for _ in range(n_new):
        with autocast_ctx(device):
            logits, _ = A.trunk_forward(model, seq)
        seq = torch.cat([seq, logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
    return seq


@torch.no_grad()
def greedy_acceptance(model, val_tokens: torch.Tensor, args, device) -> dict:
    """First-draft acceptance as the engine sees it under greedy decoding.

    From K held-out prompts of P tokens, the trunk generates G tokens greedily. On the final sequence,
    for every t in [P-1, P+G-2] (x_{t+1} is a trunk-greedy token): the draft d_t = argmax MTP(R_last[t],
    x_{t+1}) at position t is accepted iff d_t == argmax of the trunk logits at t+1 (= x_{t+2} within the
    generated part). acceptance = accepted / (K*G).
    """
    model.eval()
    K, P, G = args.accept_prompts, args.accept_prompt_len, args.accept_gen
    span = (val_tokens.numel() - P - 1) // max(1, K)
    if span <= 0:
        return {}
    starts = torch.arange(K) * span
    idx = starts[:, None].to(val_tokens.device) + torch.arange(P, device=val_tokens.device)[None, :]
    prompts = val_tokens[idx].long()
    seq = greedy_generate(model, prompts, G, device)
    with autocast_ctx(device):
        logits, r_last = A.trunk_forward(model, seq)
        mtp_logits = A.mtp_forward(model, r_last[:, :-1], seq[:, 1:])
    am = logits.float().argmax(-1)
    dm = mtp_logits.float().argmax(-1)
    t = torch.arange(P - 1, P + G - 1, device=seq.device)
    acc = (dm[:, t] == am[:, t + 1]).float().mean().item()
    consistent = (am[:, P - 1 : P + G - 1] == seq[:, P : P + G]).float().mean().item()
    log(f"[eval] greedy first-draft acceptance: {acc:.3f} over {K}x{G} drafts "
        f"(recompute agreement of the greedy trunk {consistent:.3f})")
    return dict(acceptance_greedy=acc, acceptance_greedy_drafts=K * G, acceptance_prompt_len=P)


SAMPLE_PROMPTS = [
    "import torch\nimport torch.nn as nn\n\n\nclass ",
    'def fibonacci(n):\n    """',
    "# Licensed under the Apache License, Version 2.0 (the \"License\");\n",
    "Installation\n============\n\n",
    "    def __init__(self, config):\n        super().__init__()\n",
]


@torch.no_grad()
def write_samples(model, tok, args, device, path: str) -> list[dict]:
    out = []
    with open(path, "w") as fh:
        for p in SAMPLE_PROMPTS:
            ids = torch.tensor([tok.encode(p, add_special_tokens=False).ids], device=device)
            seq = greedy_generate(model, ids, args.sample_tokens, device)
            text = tok.decode(seq[0].tolist(), skip_special_tokens=False)
            out.append(dict(prompt=p, text=text))
            fh.write(f"=== prompt {p!r}\n{text}\n\n")
            log(f"[sample] {p!r} ->\n{text}\n" + "-" * 60)
    return out



def post_training(model, paths, tok, cfg, corpus, val_np, val_tokens, args, device, work, metrics) -> None:
    """Evaluation of the trained weights; with --export: the MLX export, the same evaluation (quick) on the
    dequantized 4-bit weights, and the fixture (float32, CPU, plain HF modules, dequantized weights)."""
    if args.eval == "quick":
        args.eval_tokens = min(args.eval_tokens, 65536)
    if args.eval in ("full", "quick"):
        metrics.update(evaluate(model, paths, val_tokens, args, cfg, device))
    if args.eval == "full":
        metrics.update(greedy_acceptance(model, val_tokens, args, device))
        metrics["samples"] = write_samples(model, tok, args, device, os.path.join(work, "samples.txt"))
    if not args.export:
        return
    import small_model_export as X

    t0 = time.time()
    shutil.rmtree(args.export, ignore_errors=True)
    model_cpu = model.to("cpu").float()
    tensors, quant, _ = X.export_checkpoint(model_cpu, tok, args.export, log=log)
    metrics["export_bytes"] = os.path.getsize(os.path.join(args.export, "model.safetensors"))
    deq = X.dequantized_model(cfg, tensors, quant, log=log)
    cands = []
    for doc in corpus["val"]:
        enc = tok.encode(doc, add_special_tokens=False).ids
        if len(enc) >= args.fixture_len:
            cands.append(enc[: args.fixture_len])
        if len(cands) >= 16:
            break
    if not cands:
        cands = [val_np[: args.fixture_len].tolist()]
    with torch.no_grad():  # trained vs 4-bit weights, greedy agreement on the first candidate prompt
        p = torch.tensor([cands[0]])
        l_trained, _ = A.trunk_forward(model_cpu.eval(), p)
        l_deq, _ = A.trunk_forward(deq, p)
        agree = (l_trained.argmax(-1) == l_deq.argmax(-1)).float().mean().item()
    metrics["q4_argmax_agreement_on_a_prompt"] = agree
    log(f"[export] trained vs 4-bit weights: argmax agreement {agree:.3f} over {p.shape[1]} positions")
    if args.eval != "none":
        # the engine runs the 4-bit weights: the same held-out metrics on them (bf16 fast paths, as above)
        model.load_state_dict(deq.state_dict())
        model.to(device)
        saved = (args.eval_tokens, args.accept_prompts)
        args.eval_tokens, args.accept_prompts = min(args.eval_tokens, 131072), max(1, args.accept_prompts // 2)
        log("[eval] the dequantized 4-bit export:")
        q4 = evaluate(model, paths, val_tokens, args, cfg, device)
        q4.update(greedy_acceptance(model, val_tokens, args, device))
        args.eval_tokens, args.accept_prompts = saved
        metrics["q4"] = q4
    fdeadline = (T_START + args.time_budget - 25) if args.time_budget > 0 else None
    fmeta = X.write_fixture(deq, cands, os.path.join(args.export, "fixture"), args.fixture_greedy, tok, log=log,
                            deadline=fdeadline, checkpoint_dir=args.export)
    metrics["fixture"] = {k: fmeta[k] for k in ("T", "N", "passed_gap_rule", "min_router_rel_gap",
                                                 "min_indexer_rel_gap", "min_greedy_margin", "indexer_zero_scores")}
    log(f"[export] export, 4-bit evaluation and fixture took {time.time() - t0:.0f}s")


# ---------------------------------------------------------------------------------------------------
# Bundling for $OUT
# ---------------------------------------------------------------------------------------------------


def _tar_gz(paths_arcnames, dst: str) -> None:
    with tarfile.open(dst, "w:gz", compresslevel=6) as tar:
        for path, arc in paths_arcnames:
            if os.path.exists(path):
                tar.add(path, arcname=arc)


def _split(path: str, out_dir: str, base: str) -> list[str]:
    data = open(path, "rb").read()
    outs = []
    for i in range(0, max(1, len(data)), PART_BYTES):
        name = os.path.join(out_dir, f"{base}.part{i // PART_BYTES:02d}")
        with open(name, "wb") as fh:
            fh.write(data[i : i + PART_BYTES])
        outs.append(name)
    return outs


def mirror_state(args) -> None:
    """Copy the state parts into --out (so a run killed at the time limit still returns its last save)."""
    if not (args.out and args.state) or args.no_out_state:
        return
    os.makedirs(args.out, exist_ok=True)
    for old in glob.glob(os.path.join(args.out, "state.tar.part*")):
        os.remove(old)
    for p in sorted(glob.glob(os.path.join(args.state, "state.tar.part*"))):
        shutil.copy(p, os.path.join(args.out, os.path.basename(p)))


def bundle(args, work: str) -> None:
    """--out gets: results.tar.gz (log, loss.csv, metrics.json, samples.txt, fixture/), export.tar.gz.partNN,
    state.tar.partNN (mirrored at every save), train_log.txt (live). At most 8 files: the state goes first."""
    out = args.out
    os.makedirs(out, exist_ok=True)
    files = []
    res = os.path.join(out, "results.tar.gz")
    items = [(os.path.join(work, n), n) for n in ("train_log.txt", "loss.csv", "metrics.json", "samples.txt")]
    if args.export:
        items.append((os.path.join(args.export, "fixture"), "fixture"))
    _tar_gz(items, res)
    files.append(res)
    if args.export:
        tmp = os.path.join(work, "export.tar.gz")
        _tar_gz([(os.path.join(args.export, n), os.path.join("export", n)) for n in sorted(os.listdir(args.export))
                 if n != "fixture"], tmp)
        files += _split(tmp, out, "export.tar.gz")
        os.remove(tmp)
    mirror_state(args)
    present = sorted(glob.glob(os.path.join(out, "*")))
    state_parts = [f for f in present if os.path.basename(f).startswith("state.tar.part")]
    if len(present) > 8 and state_parts:
        log(f"[bundle] WARNING: {len(present)} files in {out}: dropping the state ({len(state_parts)} parts)")
        for f in state_parts:
            os.remove(f)
    files = sorted(glob.glob(os.path.join(out, "*")))
    for f in files:
        log(f"[bundle] {f}: {os.path.getsize(f) / 1e6:.2f} MB")
    big = [f for f in files if os.path.getsize(f) > 16_000_000]
    if big or len(files) > 8:
        log(f"[bundle] WARNING: limits exceeded: {len(files)} files, too big: {big}")


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    global _LOG_FILE, _LOG_MIRROR
    args = parse_args(argv)
    work = args.work
    os.makedirs(work, exist_ok=True)
    _LOG_FILE = os.path.join(work, "train_log.txt")
    open(_LOG_FILE, "w").close()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        _LOG_MIRROR = os.path.join(args.out, "train_log.txt")
        open(_LOG_MIRROR, "w").close()
    log(f"[main] argv: {' '.join(sys.argv[1:] if argv is None else argv)}")
    dev = args.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    threads = args.cpu_threads or min(8, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        log(f"[main] device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"transformers {__import__('transformers').__version__}, {threads} CPU threads")
    else:
        log(f"[main] device cpu ({threads} threads), torch {torch.__version__}")

    # -- state, corpus, tokenizer -------------------------------------------------------------------
    st = load_state(args.state) if args.state and os.path.isdir(args.state) else None
    if st is not None and st["meta"].get("tiny") != args.tiny:
        raise SystemExit(f"state {args.state} was made with tiny={st['meta'].get('tiny')}")
    corpus = D.collect_corpus(int(args.corpus_mb * 1e6), int(args.val_mb * 1e6), args.val_permille, log=log)
    from tokenizers import Tokenizer

    if st is not None:
        tok = Tokenizer.from_str(st["tokenizer_json"])
        if st["meta"].get("corpus_fingerprint") != corpus["fingerprint"]:
            log(f"[data] WARNING: corpus fingerprint {corpus['fingerprint']} differs from the state's "
                f"{st['meta'].get('corpus_fingerprint')} (different package set?): continuing")
    else:
        t0 = time.time()
        tok = D.train_tokenizer(corpus["train"], args.vocab_size, int(args.tok_train_mb * 1e6), log=log)
        log(f"[tok] BPE training took {time.time() - t0:.1f}s")
    ids = D.token_ids(tok)
    eot = ids["<|endoftext|>"]
    train_np = D.encode_docs(tok, corpus["train"], eot, log=log, label="train")
    val_np = D.encode_docs(tok, corpus["val"], eot, log=log, label="held-out")
    train_tokens = torch.from_numpy(train_np).to(device)
    val_tokens = torch.from_numpy(val_np).to(device)
    bytes_per_token = corpus["stats"]["train_bytes"] / max(1, train_np.size)
    log(f"[data] {bytes_per_token:.2f} bytes/token on the train split")

    # -- model ---------------------------------------------------------------------------------------
    vocab = max(args.vocab_size, tok.get_vocab_size())
    if st is not None:
        vocab = st["meta"]["vocab_size"]
    cfg = A.small_text_config(vocab, eot, tiny=args.tiny)
    model = A.build_model(cfg, seed=args.seed)
    if st is not None:
        missing, unexpected = model.load_state_dict(st["state_dict"], strict=False)
        if missing or unexpected:
            raise SystemExit(f"state does not match the model: missing {missing}, unexpected {unexpected}")
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in model.mtp.parameters())
    n_exp = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = n_params - n_exp + n_exp * cfg.num_experts_per_tok / cfg.num_experts
    log(f"[model] {n_params / 1e6:.2f}M parameters (MTP {n_mtp / 1e6:.2f}M, routed experts {n_exp / 1e6:.2f}M, "
        f"about {active / 1e6:.1f}M active per token); vocab {vocab}; layers {cfg.layer_types}")
    use_gmm = (not args.no_grouped_mm) and validate_grouped_mm(device)
    gmm = "grouped_mm, " + ("bf16" if device.type == "cuda" else "fp32")
    log(f"[train] experts: {gmm if use_gmm else 'per-expert loop'}")
    paths = A.FastPaths(model, use_grouped_mm=use_gmm)
    paths.indexer_margin, paths.indexer_pos_weight = args.indexer_margin, args.indexer_pos_weight
    opt_kw = dict(betas=(0.9, args.beta2), eps=1e-8)
    if device.type == "cuda":
        opt_kw["fused"] = True
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, **opt_kw)

    final = args.final == "yes" or (args.final == "auto" and bool(args.export))
    prev = st["meta"] if st is not None else {}
    run = dict(step=prev.get("step", 0), tokens=prev.get("tokens", 0), train_s=prev.get("train_s", 0.0),
               samples_drawn=prev.get("samples_drawn", 0), calls=prev.get("calls", 0) + 1,
               csv=(st["csv"].strip().split("\n") if st is not None else [CSV_HEADER]),
               refill=args.refill_steps if st is not None else 0, final=final, save=None)
    tok_json = tok.to_str()

    def state_meta():
        return dict(version=STATE_VERSION, tiny=args.tiny, step=run["step"], tokens=run["tokens"],
                    train_s=run["train_s"], samples_drawn=run["samples_drawn"], calls=run["calls"],
                    vocab_size=vocab, corpus_fingerprint=corpus["fingerprint"], corpus=corpus["stats"],
                    config=cfg.to_dict(), args=vars(args), final_decay_done=final)

    def save():
        if args.state:
            save_state(args.state, model, state_meta(), tok_json, "\n".join(run["csv"]) + "\n")
            mirror_state(args)

    run["save"] = save if args.state else None

    # -- train ---------------------------------------------------------------------------------------
    log(f"[train] batch {args.batch_size} x seq {args.seq_len} = {args.batch_size * args.seq_len:,} tokens/step, "
        f"peak lr {args.lr}, resume step {run['step']}, budget {args.time_budget or '-'} s "
        f"(reserve {args.reserve:.0f}s)")
    t_train = time.time()
    train(model, paths, opt, train_tokens, args, cfg, device, run)
    train_wall = time.time() - t_train
    log(f"[train] done: {run['steps_this_call']} steps in {train_wall:.0f}s this call, total step {run['step']}, "
        f"{run['tokens']:,} tokens, {run['train_s']:.0f}s of training over {run['calls']} call(s); "
        f"{args.batch_size * args.seq_len * run['steps_this_call'] / max(1e-9, train_wall):,.0f} tok/s this call")
    with open(os.path.join(work, "loss.csv"), "w") as fh:
        fh.write("\n".join(run["csv"]) + "\n")
    del opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    save()

    # -- evaluate, export ----------------------------------------------------------------------------
    metrics = dict(step=run["step"], tokens=run["tokens"], train_seconds=run["train_s"], calls=run["calls"],
                   params=n_params, params_mtp=n_mtp, params_active=active, corpus=corpus["stats"],
                   bytes_per_token=bytes_per_token, train_tokens=int(train_np.size), val_tokens=int(val_np.size),
                   batch_size=args.batch_size, seq_len=args.seq_len, peak_lr=args.lr,
                   tok_per_s_this_call=args.batch_size * args.seq_len * run["steps_this_call"] / max(1e-9, train_wall))
    failed = None
    try:
        post_training(model, paths, tok, cfg, corpus, val_np, val_tokens, args, device, work, metrics)
    except Exception:  # noqa: BLE001 - report, bundle what exists, exit non-zero
        import traceback

        failed = traceback.format_exc()
        log("[main] ERROR after training:\n" + failed)
        metrics["error"] = failed

    metrics["wall_seconds"] = time.time() - T_START
    with open(os.path.join(work, "metrics.json"), "w") as fh:
        json.dump(metrics, fh, indent=2, default=str)
    summary = {k: v for k, v in metrics.items() if k not in ("samples", "corpus")}
    log("[main] metrics: " + json.dumps(summary, default=str))
    if args.out:
        bundle(args, work)
    log(f"[main] finished in {time.time() - T_START:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
