#!/usr/bin/env bash
# The packed store on oracle fixtures (tools/sweep_oracle.py or tests/fixtures/oracle): for each
# checkpoint, `cherenkov pack` it, `cherenkov verify` the store, then run `cherenkov generate` on the
# fixture's prompt from the checkpoint and from the store (the CPU reference) and compare the prompt
# logits bit for bit and the greedy tokens. One line a fixture:
#   same      the store gives the checkpoint's logits bit for bit and the same tokens
#   differs   it does not (max |difference| printed); expected only where pack quantized float experts
#             to Q4 (as an MLX conversion would; pack's log says so), a bug where it copied them
#   refused   pack refused the checkpoint (its error printed), e.g. experts that mix formats
#   FAILED    verify or generate failed on a store that pack wrote: a bug
# Exits 1 if any line is FAILED, or differs where pack copied the experts.
#   scripts/store_sweep.sh /tmp/ck-sweep            # every fixture under the directory
#   CK_BIN=build/cherenkov CK_STORE_TMP=/tmp/x scripts/store_sweep.sh DIR...
set -uo pipefail
BIN=${CK_BIN:-$(ls -t build/cherenkov build-cuda/cherenkov 2>/dev/null | head -1)}
[ -x "$BIN" ] || { echo "store_sweep: no cherenkov binary (build first, or set CK_BIN)" >&2; exit 2; }
[ $# -gt 0 ] || { echo "usage: $0 FIXTURE_DIR..." >&2; exit 2; }
TMP=${CK_STORE_TMP:-$(mktemp -d /tmp/ck-store-sweep.XXXXXX)}
mkdir -p "$TMP"
BAD=0
for root in "$@"; do
  for fx in $(find "$root" -name meta.json -printf '%h\n' | sort); do
    name=$(basename "$fx")
    ids=$(python3 -c "import numpy as np,sys; print(','.join(map(str, np.load(sys.argv[1]).reshape(-1))))" \
          "$fx/prompt_ids.npy") || { echo "$name FAILED (no prompt_ids.npy)"; BAD=1; continue; }
    store="$TMP/$name.store"
    rm -rf "$store"
    # pack's info line says how the experts were stored: "QN copied", "float", or "quantized to Q4"
    # (float experts whose dimensions suit Q4); only the last may change the logits.
    if ! CHERENKOV_LOG=info "$BIN" pack "$fx" --out "$store" --no-sync > "$TMP/$name.pack.log" 2>&1; then
      echo "$name refused: $(grep -m1 -i error "$TMP/$name.pack.log" || tail -1 "$TMP/$name.pack.log")"
      continue
    fi
    if ! "$BIN" verify "$store" > "$TMP/$name.verify.log" 2>&1; then
      echo "$name FAILED verify: $(tail -1 "$TMP/$name.verify.log")"; BAD=1; continue
    fi
    failed=
    for src in ckpt store; do
      dir=$fx; [ $src = store ] && dir=$store
      "$BIN" generate --model "$dir" --backend cpu --prompt-ids "$ids" --max-tokens 4 \
        --logits-out "$TMP/$name.$src.npy" > "$TMP/$name.$src.ids" 2> "$TMP/$name.$src.log" || failed=$src
    done
    if [ -n "$failed" ]; then
      echo "$name FAILED generate from the $failed: $(tail -1 "$TMP/$name.$failed.log")"; BAD=1; continue
    fi
    if cmp -s "$TMP/$name.ckpt.npy" "$TMP/$name.store.npy" && cmp -s "$TMP/$name.ckpt.ids" "$TMP/$name.store.ids"; then
      echo "$name same"
    else
      diff=$(python3 -c "import numpy as np,sys; a=np.load(sys.argv[1]); b=np.load(sys.argv[2]); print(f'{np.abs(a-b).max():.3g}')" \
             "$TMP/$name.ckpt.npy" "$TMP/$name.store.npy")
      if grep -q "quantized to Q4" "$TMP/$name.pack.log"; then
        echo "$name differs (max |logit difference| $diff; float experts, quantized to Q4 by the packer)"
      else
        echo "$name differs (max |logit difference| $diff; experts stored as they were: a bug)"; BAD=1
      fi
    fi
    rm -rf "$store"
  done
done
exit $BAD
