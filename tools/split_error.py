#!/usr/bin/env python3
"""Error of two exact-code forms of a 4-bit group dot product, Σ q x over 64 codes, on the CPU.

The CUDA kernels multiply MLX 4-bit codes q (0..15, exact in any MMA type) by fp32 activations x.
  bf16x3 (today's kernels): x = hi + mid + lo, three bf16 parts, each product exact, each part
         summed in fp32 as an MMA column does. bf16x2: hi + mid only.
  int8xP (a candidate, docs/roofline-cuda.md "Eighth session"): x = 2^e * Σ_j d_j 2^(-7j) with a
         power-of-two e per group (|x / 2^e| < 1/2) and P signed 7-bit digits d_j (int8), so the
         integer MMA sums Σ q d_j exactly in int32; the P column sums are scaled in fp32 and added.
Errors are relative to Σ |q x| (the scale of fp32 summation error) against an fp64 reference, over
groups drawn from several activation shapes, including one large element among tiny ones (where a
shared exponent loses the tiny ones' low bits).

  python3 tools/split_error.py [--groups 300] [--seed 1]
"""
import argparse

import numpy as np


def bf16(v):
    """Round fp32 values to bf16 (nearest even), returned as fp32."""
    b = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def fsum32(values):
    s = np.float32(0)
    for v in values:
        s = np.float32(s + np.float32(v))
    return s


def dot_bf16(q, x, parts):
    """x split into `parts` bf16 parts (hi, mid, lo: each the rest's rounding), each part's products
    summed in fp32, then the part sums: bf16x3 is today's kernels, bf16x2 a candidate for prefill (two
    thirds of the MMAs)."""
    sums, rest = [], x
    for _ in range(parts):
        part = bf16(rest)
        sums.append(fsum32(q * part))
        rest = np.float32(rest - part)
    return fsum32(sums)


def dot_int8(q, x, parts):
    m = float(np.max(np.abs(x)))
    if m == 0.0:
        return np.float32(0)
    e = int(np.floor(np.log2(m))) + 2  # |x / 2^e| < 1/2: every digit fits int8
    r = x.astype(np.float64) / 2.0**e
    out = np.float32(0)
    for j in range(parts):
        d = np.round(r * 128.0)
        r = r * 128.0 - d
        assert np.all(np.abs(d) <= 127)
        D = int(np.sum(q.astype(np.int64) * d.astype(np.int64)))  # exact: the int32 MMA sum
        out = np.float32(out + np.float32(np.float32(D) * np.float32(2.0 ** (e - 7 * (j + 1)))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    shapes = {
        "normal": lambda: rng.standard_normal(64),
        "outliers": lambda: np.where(rng.random(64) < 0.05, 1000.0, 1.0) * rng.standard_normal(64),
        "wide range": lambda: rng.standard_normal(64) * 2.0 ** rng.integers(-20, 5, 64),
        "one huge": lambda: np.r_[1e4, rng.standard_normal(63) * 1e-3],
    }
    forms = {"bf16x3": lambda q, x: dot_bf16(q, x, 3), "bf16x2": lambda q, x: dot_bf16(q, x, 2), "int8x4": lambda q, x: dot_int8(q, x, 4),
             "int8x5": lambda q, x: dot_int8(q, x, 5), "int8x6": lambda q, x: dot_int8(q, x, 6)}
    print(f"{'activations':12s}" + "".join(f"{name:>27s}" for name in forms))
    for shape, gen in shapes.items():
        worst = {name: [] for name in forms}
        for _ in range(a.groups):
            x = gen().astype(np.float32)
            q = rng.integers(0, 16, 64).astype(np.float32)
            exact = float(np.dot(q.astype(np.float64), x.astype(np.float64)))
            scale = float(np.dot(np.abs(q.astype(np.float64)), np.abs(x.astype(np.float64)))) + 1e-300
            for name, f in forms.items():
                worst[name].append(abs(float(f(q, x)) - exact) / scale)
        print(f"{shape:12s}" + "".join(f"{'max %.2e mean %.1e' % (max(v), np.mean(v)):>27s}" for v in worst.values()))


if __name__ == "__main__":
    main()
