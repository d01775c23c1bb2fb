#!/usr/bin/env bash
# `cherenkov run` on the embedded small model: streams text, reports speed on stderr, is
# reproducible with a seed, and fails cleanly on bad input. Usage: run.sh <cherenkov-binary> <source-dir>
set -u
bin=$1; src=$2
model="$src/models/cherenkov-tiny"
fail=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$bin" run --backend cpu --model "$model" --max-tokens 24 "def fibonacci(n):" >"$tmp/out" 2>"$tmp/err" || { echo "FAIL run exited $?: $(cat "$tmp/err")"; fail=1; }
[ -s "$tmp/out" ] && echo "ok   run printed text: $(head -c 60 "$tmp/out" | tr '\n' ' ')" || { echo "FAIL run printed nothing"; fail=1; }
grep -q "decode .* tok/s" "$tmp/err" && echo "ok   speed on stderr" || { echo "FAIL no speed line: $(cat "$tmp/err")"; fail=1; }
a=$("$bin" run --backend cpu --model "$model" --raw --max-tokens 16 --temperature 0.9 --top-p 0.95 --seed 7 "import numpy" 2>/dev/null)
b=$("$bin" run --backend cpu --model "$model" --raw --max-tokens 16 --temperature 0.9 --top-p 0.95 --seed 7 "import numpy" 2>/dev/null)
[ "$a" = "$b" ] && [ -n "$a" ] && echo "ok   same seed, same text" || { echo "FAIL seeded runs differ: '$a' vs '$b'"; fail=1; }
echo "import os" | "$bin" run --backend cpu --model "$model" --raw --max-tokens 8 >"$tmp/out2" 2>/dev/null && [ -s "$tmp/out2" ] \
  && echo "ok   prompt from stdin" || { echo "FAIL prompt from stdin"; fail=1; }
out=$("$bin" run --backend cpu --model /nonexistent "hi" 2>&1); rc=$?
[ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -q "nonexistent" <<<"$out" && echo "ok   bad --model" || { echo "FAIL bad --model: rc $rc: $out"; fail=1; }
out=$("$bin" run --backend cpu --model "$model" --temperature -1 "hi" 2>&1); rc=$?
[ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -q "must be at least 0, got -1" <<<"$out" && [ ${#out} -lt 200 ] \
  && echo "ok   bad --temperature" || { echo "FAIL bad --temperature: rc $rc: $out"; fail=1; }
out=$("$bin" run --backend cpu --model "$model" --max-tokens 0 "hi" 2>&1); rc=$?
[ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -q "not in range 1 to" <<<"$out" && [ ${#out} -lt 200 ] \
  && echo "ok   bad --max-tokens" || { echo "FAIL bad --max-tokens: rc $rc: $out"; fail=1; }
out=$("$bin" run --backend cpu --model "$model" --prefill-chunk 9000 "hi" 2>&1); rc=$?
[ $rc -ne 0 ] && [ $rc -lt 128 ] && grep -q "prefill-chunk" <<<"$out" && echo "ok   bad --prefill-chunk" \
  || { echo "FAIL bad --prefill-chunk: rc $rc: $out"; fail=1; }
"$bin" run --backend cpu --model "$model" --raw --max-tokens 4 --prefill-chunk 8192 "import os" >/dev/null 2>&1 \
  && echo "ok   --prefill-chunk 8192 (the largest)" || { echo "FAIL --prefill-chunk 8192"; fail=1; }
exit $fail
