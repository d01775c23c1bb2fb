#!/usr/bin/env python3
"""Each loop of a kernel's SASS (a backward branch and the instructions it spans) with its length and
its instruction mix: where a kernel's issued instructions go, read here without a GPU. How the delta
rule's scan was found issuing its tf32 conversions and copy arithmetic instead of MMAs
(docs/roofline-cuda.md, "Forty-first session").
    FUNC=gdn_chunk_scan_tc_kernelILi64 scripts/sass_sizes.sh | python3 scripts/sass_loops.py
Nested loops are listed each (an outer loop's mix includes its inner loops' bodies once)."""
import re
import signal
import sys
from collections import Counter


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    text = open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read()
    kernels = re.split(r"\n(?=\s*Function : )", text)
    for k in kernels:
        name = re.search(r"Function : (\S+)", k)
        ins = [(int(m.group(1), 16), m.group(2))
               for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", k)]
        if not name or not ins:
            continue
        print(f"{name.group(1)}: {len(ins)} instructions")
        at = {a: i for i, (a, _) in enumerate(ins)}
        for i, (a, t) in enumerate(ins):
            if "BRA" not in t:
                continue
            m = re.search(r"0x([0-9a-f]+)", t.split("BRA", 1)[1])
            if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
                continue
            j = at[int(m.group(1), 16)]
            mix = Counter((x.split()[1] if x.startswith("@") else x.split()[0]).split(".")[0]
                          for _, x in ins[j:i + 1])
            top = ", ".join(f"{op} {n}" for op, n in mix.most_common(10))
            print(f"  loop {j}-{i} ({i - j + 1} instructions): {top}")


if __name__ == "__main__":
    main()
