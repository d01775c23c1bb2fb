#!/usr/bin/env python3
"""Sums the kernel durations of `ncu --csv --metrics gpu__time_duration.sum` (scripts/gpu_ncu.sh with
CK_NCU_DURATIONS=1) per kernel name, largest first.
    python3 scripts/ncu_sum.py ncu_durations.csv [--top 30] [--skip-before REGEX]
--skip-before drops every launch before the first whose name matches (e.g. the benchmark's setup).
--step REGEX keeps one whole step: the launches between two consecutive launches whose name matches
(e.g. embed_wide_kernel, a step's first kernel), the last such segment of the shortest length (a
decode step: a prefill chunk launches more kernels); --by-grid splits each
kernel name by its grid size (which matrix a GEMV kernel ran on); --sequence N lists the first N
launches from the first whose grid matches --sequence-grid (default ', 1024,': the first launch with
1,024 rows in y, early in a 1,024-row chunk) in launch order, one line each, instead of the sums."""
import argparse
import collections
import csv
import io
import re
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--skip-before", default="")
    ap.add_argument("--step", default="")
    ap.add_argument("--by-grid", action="store_true")
    ap.add_argument("--sequence", type=int, default=0)
    ap.add_argument("--sequence-grid", default=", 1024,")
    a = ap.parse_args()
    text = open(a.csv, errors="replace").read()
    start = text.find('"ID"')  # ncu prints its own log lines before the table
    if start < 0:
        sys.exit(f"{a.csv}: no ncu CSV table")
    rows = [r for r in csv.DictReader(io.StringIO(text[start:])) if r.get("Metric Name") == "gpu__time_duration.sum"]
    if a.skip_before:
        first = next((i for i, r in enumerate(rows) if re.search(a.skip_before, r["Kernel Name"])), 0)
        rows = rows[first:]
    if a.step:
        marks = [i for i, r in enumerate(rows) if re.search(a.step, r["Kernel Name"])]
        if len(marks) < 2:
            sys.exit(f"{a.csv}: fewer than two launches match --step {a.step}")
        # Segments between matches: a prefill chunk launches more kernels than a decode step (grouping,
        # GEMM fragments); keep the last segment of the shortest length, a decode step.
        segs = list(zip(marks, marks[1:]))
        shortest = min(b - e for e, b in segs)
        first, last = [(e, b) for e, b in segs if b - e == shortest][-1]
        rows = rows[first:last]
    if a.sequence:
        first = next((i for i, r in enumerate(rows) if a.sequence_grid in r.get("Grid Size", "")), None)
        if first is None:
            sys.exit(f"{a.csv}: no launch with a grid matching {a.sequence_grid!r}")
        for r in rows[first:first + a.sequence]:
            name = re.sub(r"\(.*", "", r["Kernel Name"])
            us = float(r["Metric Value"].replace(",", "")) / 1e3
            print(f"{us:10.2f} us  {name[:70]:70s}  grid {r.get('Grid Size', '?')}")
        return
    total = collections.Counter()
    count = collections.Counter()
    for r in rows:
        name = re.sub(r"\(.*", "", r["Kernel Name"])  # drop the argument list
        if a.by_grid:
            name += f" grid {r.get('Grid Size', '?')}"
        total[name] += float(r["Metric Value"].replace(",", ""))
        count[name] += 1
    all_ns = sum(total.values())
    print(f"{len(rows)} launches, {all_ns / 1e6:.3f} ms of kernel time")
    for name, ns in total.most_common(a.top):
        print(f"{100 * ns / all_ns:5.1f}%  {ns / 1e6:8.3f} ms  {count[name]:5d} x {ns / count[name] / 1e3:8.2f} us  {name[:100]}")


if __name__ == "__main__":
    main()
