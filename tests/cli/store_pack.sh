#!/usr/bin/env bash
# `cherenkov synth | pack | verify` and `generate --model STORE` end to end: the store's logits equal
# the checkpoint's, low-bit stores load, a corrupt record is named by verify, a killed pack leaves no
# loadable store, a valid store is reused.
# Usage: store_pack.sh <cherenkov-binary> <source-dir>
set -u
bin=$1; src=$2
fail=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
export CHERENKOV_LOG=warn
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fail=1; }
check() {  # check NAME EXPECTED_RC NEEDLE -- command...
  local name=$1 want=$2 needle=$3; shift 4
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ "$want" = 0 ] && [ $rc -ne 0 ]; then bad "$name: exit $rc: $out"; return; fi
  if [ "$want" != 0 ] && { [ $rc -eq 0 ] || [ $rc -ge 128 ]; }; then bad "$name: exit $rc (want a clean error): $out"; return; fi
  if ! grep -qF -- "$needle" <<<"$out"; then bad "$name: output lacks '$needle': $out"; return; fi
  ok "$name"
}

# 1. MLX Q4 fixture: pack, verify, identical logits and ids from the store and the checkpoint.
fx=$src/tests/fixtures/oracle/mlx_q4g64_nested_hc4_e32k4
if [ -d "$fx" ]; then
  ids=$(python3 -c "import numpy as np; print(','.join(map(str, np.load('$fx/prompt_ids.npy').tolist())))")
  check "pack mlx fixture" 0 "pack: $tmp/mlx.store" -- "$bin" pack "$fx" --out "$tmp/mlx.store" --experts 4,3,2 --no-sync
  check "verify" 0 ": OK" -- "$bin" verify "$tmp/mlx.store"
  check "pack again reuses" 0 "up to date" -- "$bin" pack "$fx" --out "$tmp/mlx.store" --experts 4,3 --no-sync
  a=$("$bin" generate --model "$fx" --prompt-ids "$ids" --max-tokens 8 --backend cpu --logits-out "$tmp/a.npy" 2>&1)
  b=$("$bin" generate --model "$tmp/mlx.store" --prompt-ids "$ids" --max-tokens 8 --backend cpu --logits-out "$tmp/b.npy" 2>&1)
  if [ "$a" = "$b" ] && python3 -c "import numpy as np,sys; sys.exit(0 if np.array_equal(np.load('$tmp/a.npy'), np.load('$tmp/b.npy')) else 1)"; then
    ok "store logits and ids equal the checkpoint's ($a)"
  else
    bad "store differs from checkpoint: '$a' vs '$b'"
  fi
  for bits in 3 2; do
    out=$(CHERENKOV_EXPERTS=$bits "$bin" generate --model "$tmp/mlx.store" --prompt-ids "$ids" --max-tokens 4 --backend cpu --logits-out "$tmp/q$bits.npy" 2>&1)
    if [ $? -eq 0 ] && python3 -c "
import numpy as np, sys
a = np.load('$tmp/b.npy'); q = np.load('$tmp/q$bits.npy')
rel = np.linalg.norm(q - a) / np.linalg.norm(a)
sys.exit(0 if np.isfinite(q).all() and 0 < rel < (0.5 if $bits == 3 else 1.0) else 1)"; then ok "generate with $bits-bit experts"; else bad "generate with $bits-bit experts: $out"; fi
  done
  # A corrupt record: verify names layer and expert and fails.
  python3 - "$tmp/mlx.store" <<'PY'
import json, sys
d = sys.argv[1]; m = json.load(open(d + '/manifest.json')); f = m['experts'][0]
k = 1 * m['geometry']['n_experts'] + 5
off = k * f['stride'] + f['gate']['codes'] + 10
with open(d + '/experts.bin', 'r+b') as fh:
    fh.seek(off); b = fh.read(1); fh.seek(off); fh.write(bytes([b[0] ^ 0xff]))
PY
  check "verify names the corrupt record" 1 "layer 1, expert 5" -- "$bin" verify "$tmp/mlx.store"
fi
check "pack Q4 only" 0 "pack:" -- "$bin" pack "$src/tests/fixtures/store_pair/mlx" --out "$tmp/q4only" --no-sync
check "missing low-bit file" 1 "no 3-bit records" -- env CHERENKOV_EXPERTS=3 "$bin" generate --model "$tmp/q4only" --prompt-ids 1,2 --max-tokens 1 --backend cpu
check "bad CHERENKOV_VERIFY_READS" 1 "expected always, sampled or never" -- env CHERENKOV_VERIFY_READS=maybe "$bin" generate --model "$tmp/q4only" --prompt-ids 1,2 --max-tokens 1 --backend cpu

# 2. synth -> pack -> generate: finite logits, equal to the checkpoint's.
check "synth" 0 "synth:" -- "$bin" synth --layers 2 --experts 16 --vocab 256 --ngram-base 200 --out "$tmp/syn" --no-sync
if [ -f "$tmp/syn/config.json" ]; then
  check "pack synth" 0 "pack:" -- "$bin" pack "$tmp/syn" --no-sync
  a=$("$bin" generate --model "$tmp/syn" --prompt-ids 1,2,3 --max-tokens 2 --backend cpu --logits-out "$tmp/sa.npy" 2>&1)
  b=$("$bin" generate --model "$tmp/syn.store" --prompt-ids 1,2,3 --max-tokens 2 --backend cpu --logits-out "$tmp/sb.npy" 2>&1)
  if [ "$a" = "$b" ] && python3 -c "import numpy as np,sys; a=np.load('$tmp/sa.npy'); sys.exit(0 if np.isfinite(a).all() and np.array_equal(a, np.load('$tmp/sb.npy')) else 1)"; then
    ok "synth store logits finite and equal to the checkpoint's"
  else
    bad "synth store: '$a' vs '$b'"
  fi
  # 3. A pack killed mid-way leaves no loadable store.
  rm -rf "$tmp/syn.store"
  "$bin" pack "$tmp/syn" --out "$tmp/killed" --threads 1 >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 1 500); do
    ls "$tmp"/killed/*.tmp >/dev/null 2>&1 && break
    sleep 0.01
  done
  if kill -9 $pid 2>/dev/null; then
    wait $pid 2>/dev/null
    if [ ! -e "$tmp/killed/manifest.json" ]; then ok "killed pack left no manifest"; else bad "killed pack left a manifest"; fi
    check "killed pack is not loadable" 1 "error" -- "$bin" generate --model "$tmp/killed" --prompt-ids 1 --max-tokens 1 --backend cpu
    check "repack after a kill" 0 "pack:" -- "$bin" pack "$tmp/syn" --out "$tmp/killed" --no-sync
    check "verify after repack" 0 ": OK" -- "$bin" verify "$tmp/killed"
  else
    wait $pid; echo "skip killed pack: it finished before the kill"
  fi
fi
check "simulated failure" 1 "simulated failure" -- "$bin" pack "$src/tests/fixtures/store_pair/mlx" --out "$tmp/fail" --fail-after-bytes 1000 --no-sync
check "failed pack is not a store" 1 "error" -- "$bin" verify "$tmp/fail"
check "pack of a missing dir" 1 "error" -- "$bin" pack /nonexistent/x --out "$tmp/none"
check "bad --experts" 2 "not 4, 3 or 2" -- "$bin" pack "$src/tests/fixtures/store_pair/mlx" --out "$tmp/x" --experts 4,5

# Every committed oracle fixture through pack, verify and generate (scripts/store_sweep.sh, which also
# runs on fixtures of random geometry): the same logits and tokens from the store as from the
# checkpoint wherever pack copied the experts (float experts that pack quantizes to Q4 may differ).
if out=$(CK_BIN="$bin" CK_STORE_TMP="$tmp/sweep" bash "$src/scripts/store_sweep.sh" "$src/tests/fixtures/oracle" 2>&1); then
  ok "store sweep over the oracle fixtures: $(grep -c ' same$' <<<"$out") same"
else
  bad "store sweep over the oracle fixtures: $out"
fi
exit $fail
