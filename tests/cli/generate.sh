#!/usr/bin/env bash
# `cherenkov generate` contract and bad input: one clear error line, non-zero exit, no crash.
# Usage: generate.sh <cherenkov-binary> <source-dir>
set -u
bin=$1; src=$2
fail=0
check() {  # check NAME EXPECTED_RC NEEDLE -- command...
  local name=$1 want=$2 needle=$3; shift 4
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ "$want" = 0 ] && [ $rc -ne 0 ]; then echo "FAIL $name: exit $rc: $out"; fail=1; return; fi
  if [ "$want" != 0 ] && { [ $rc -eq 0 ] || [ $rc -ge 128 ]; }; then echo "FAIL $name: exit $rc (want a clean error): $out"; fail=1; return; fi
  if ! grep -qF -- "$needle" <<<"$out"; then echo "FAIL $name: output lacks '$needle': $out"; fail=1; return; fi
  echo "ok   $name"
}
fx=$(ls -d "$src"/tests/fixtures/oracle/*/ 2>/dev/null | head -1)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if [ -n "$fx" ]; then
  ids=$(python3 -c "import numpy as np; print(','.join(map(str, np.load('$fx/prompt_ids.npy').tolist())))")
  n=$(python3 -c "import numpy as np; print(len(np.load('$fx/greedy_ids.npy')))")
  out=$("$bin" generate --model "$fx" --prompt-ids "$ids" --max-tokens "$n" --logits-out "$tmp/l.npy")
  python3 - "$fx" "$tmp/l.npy" "$out" <<'PY' || fail=1
import sys, numpy as np
fx, lpath, out = sys.argv[1], sys.argv[2], sys.argv[3]
got = np.load(lpath); ref = np.load(fx + '/logits.npy')
assert got.dtype == np.float32 and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
err = max(np.linalg.norm(got[t] - ref[t]) / np.linalg.norm(ref[t]) for t in range(ref.shape[0]))
assert err <= 1e-4, err
ids = [int(x) for x in out.strip().split(',')]
g = np.load(fx + '/greedy_ids.npy').tolist(); m = np.load(fx + '/greedy_margins.npy')
for i, (a, b) in enumerate(zip(ids, g)):
    if a != b:
        assert m[i] <= 1e-3, f'token {i}: {a} != {b} (margin {m[i]})'
        break
print('ok   generate reproduces', fx.rstrip('/').split('/')[-1], 'max rel L2', err)
PY
  check "token outside vocabulary" 1 "outside the vocabulary" -- "$bin" generate --model "$fx" --prompt-ids 1,99999999 --max-tokens 2
  cp -r "$fx" "$tmp/trunc"
  f=$(ls "$tmp"/trunc/*.safetensors | head -1); truncate -s 1000 "$f"
  check "truncated safetensors" 1 "$(basename "$f")" -- "$bin" generate --model "$tmp/trunc" --prompt-ids 1,2 --max-tokens 2
  cp -r "$fx" "$tmp/badcfg"
  python3 -c "import json,sys; p='$tmp/badcfg/config.json'; c=json.load(open(p)); (c['text_config'] if 'text_config' in c else c)['hc_count']=1; json.dump(c,open(p,'w'))"
  check "invalid config" 1 "hc_count" -- "$bin" generate --model "$tmp/badcfg" --prompt-ids 1,2 --max-tokens 2
fi
check "bad prompt ids" 2 "not a token id" -- "$bin" generate --model "$tmp" --prompt-ids 1,x --max-tokens 2
check "empty prompt entry" 2 "empty entry" -- "$bin" generate --model "$tmp" --prompt-ids 1,,2 --max-tokens 2
check "missing model dir" 1 "not a directory" -- "$bin" generate --model /nonexistent --prompt-ids 1 --max-tokens 2
check "unknown flag" 1 "bogus" -- "$bin" generate --model x --prompt-ids 1 --bogus
check "unknown command" 2 "unknown command" -- "$bin" frobnicate
check "help" 0 "--prompt-ids" -- "$bin" generate --help
exit $fail
