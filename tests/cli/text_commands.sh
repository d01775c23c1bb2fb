#!/usr/bin/env bash
# CLI contract of the text commands: `tokenize` (plain, --jsonl, --decode), `template` and
# `bench-tokenizer`, including bad input (one error line naming the file, non-zero exit).
# Usage: bash tests/cli/text_commands.sh <cherenkov binary> <source dir>. Exits non-zero on failure.
set -uo pipefail
bin=$1
src=$2
tok=$src/tests/fixtures/tokenizer/qwen3/tokenizer.json
model=$src/tests/fixtures/tokenizer/qwen3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n_pass=0
n_fail=0

check() {  # check NAME EXPECTED ACTUAL
  if [ "$2" == "$3" ]; then
    n_pass=$((n_pass + 1))
  else
    n_fail=$((n_fail + 1))
    printf 'FAIL %s\n  want: %q\n  got:  %q\n' "$1" "$2" "$3"
  fi
}

# Expects a non-zero exit and exactly one stderr line containing $2.
check_error() {  # check_error NAME SUBSTRING COMMAND...
  local name=$1 want=$2
  shift 2
  "$@" >"$tmp/out" 2>"$tmp/err" </dev/null
  local rc=$?
  local lines
  lines=$(wc -l <"$tmp/err")
  if [ $rc -ne 0 ] && [ "$lines" -eq 1 ] && grep -qF -- "$want" "$tmp/err"; then
    n_pass=$((n_pass + 1))
  else
    n_fail=$((n_fail + 1))
    printf 'FAIL %s: rc=%s, %s stderr line(s), want one containing %q:\n%s\n' "$name" "$rc" "$lines" "$want" "$(cat "$tmp/err")"
  fi
}

# --- tokenize ---
check "encode plain" "9707,11,1879,0" "$(printf 'Hello, world!' | "$bin" tokenize --tokenizer "$tok")"
check "encode unicode" "71,18503,385,220,99489,90316,198" "$(printf 'héllo 世界 😀\n' | "$bin" tokenize --tokenizer "$tok")"
check "encode special" "151644,87" "$(printf '<|im_start|>x' | "$bin" tokenize --tokenizer "$tok")"
check "encode --no-special" "27,91,318,4906,91,29,87" "$(printf '<|im_start|>x' | "$bin" tokenize --tokenizer "$tok" --no-special)"
check "encode empty" "" "$(printf '' | "$bin" tokenize --tokenizer "$tok")"
check "decode plain" "Hello, world!" "$(printf '9707, 11,1879,0\n' | "$bin" tokenize --tokenizer "$tok" --decode)"
printf '71,18503,385,220,99489,90316,198' | "$bin" tokenize --tokenizer "$tok" --decode >"$tmp/dec"
printf 'héllo 世界 😀\n' >"$tmp/want"
if cmp -s "$tmp/dec" "$tmp/want"; then n_pass=$((n_pass + 1)); else n_fail=$((n_fail + 1)); echo "FAIL decode keeps the trailing newline"; fi
check "decode --skip-special" "x" "$(printf '151644,87' | "$bin" tokenize --tokenizer "$tok" --decode --skip-special)"
check "jsonl encode" $'[9707]\n[151644,87]\n[]' "$(printf '"Hello"\n"<|im_start|>x"\n""\n' | "$bin" tokenize --tokenizer "$tok" --jsonl)"
check "jsonl decode" $'"Hello"\n"<|im_start|>x"' "$(printf '[9707]\n[151644, 87]\n' | "$bin" tokenize --tokenizer "$tok" --jsonl --decode)"
# Round trip of a mixed file, byte for byte.
printf 'def f(x):\n\treturn x ** 2  # ünïcode, 中文, emoji 👨‍👩‍👧\n\n\n   spaces\r\n' >"$tmp/text"
"$bin" tokenize --tokenizer "$tok" <"$tmp/text" | "$bin" tokenize --tokenizer "$tok" --decode >"$tmp/round"
if cmp -s "$tmp/text" "$tmp/round"; then n_pass=$((n_pass + 1)); else n_fail=$((n_fail + 1)); echo "FAIL round trip"; fi

check_error "missing tokenizer" "/nonexistent/tokenizer.json" "$bin" tokenize --tokenizer /nonexistent/tokenizer.json
printf '{"model": {"type": "BPE", "vocab": {}, "merges": [' >"$tmp/broken.json"
check_error "malformed tokenizer.json" "$tmp/broken.json: malformed JSON" "$bin" tokenize --tokenizer "$tmp/broken.json"
printf '{"model": {"type": "WordPiece"}}' >"$tmp/wordpiece.json"
check_error "unsupported tokenizer.json" "only BPE" "$bin" tokenize --tokenizer "$tmp/wordpiece.json"
check_error "bad id list" "expected a token id" bash -c "printf '1,x' | '$bin' tokenize --tokenizer '$tok' --decode"
check_error "bad jsonl" "stdin line 2: malformed JSON" bash -c "printf '\"ok\"\n{oops\n' | '$bin' tokenize --tokenizer '$tok' --jsonl"
check_error "jsonl wrong type" "stdin line 1: expected a JSON string" bash -c "printf '[1]\n' | '$bin' tokenize --tokenizer '$tok' --jsonl"

# --- template ---
printf '[{"role": "user", "content": "Hi"}]' >"$tmp/messages.json"
"$bin" template --model "$model" --messages "$tmp/messages.json" --add-generation-prompt --enable-thinking false >"$tmp/prompt"
printf '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n' >"$tmp/want"
if cmp -s "$tmp/prompt" "$tmp/want"; then n_pass=$((n_pass + 1)); else n_fail=$((n_fail + 1)); echo "FAIL template (no trailing newline, thinking off):"; cat "$tmp/prompt"; fi
"$bin" template --model "$model" --messages "$tmp/messages.json" >"$tmp/prompt"
printf '<|im_start|>user\nHi<|im_end|>\n' >"$tmp/want"
if cmp -s "$tmp/prompt" "$tmp/want"; then n_pass=$((n_pass + 1)); else n_fail=$((n_fail + 1)); echo "FAIL template default:"; cat "$tmp/prompt"; fi
printf '[{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]' >"$tmp/tools.json"
"$bin" template --model "$model" --messages "$tmp/messages.json" --tools "$tmp/tools.json" >"$tmp/prompt"
if grep -qF '{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}' "$tmp/prompt"; then
  n_pass=$((n_pass + 1))
else
  n_fail=$((n_fail + 1)); echo "FAIL template tools keep key order:"; cat "$tmp/prompt"
fi
check_error "missing messages" "$tmp/none.json" "$bin" template --model "$model" --messages "$tmp/none.json"
printf '[{"role": "user", ' >"$tmp/bad_messages.json"
check_error "malformed messages" "$tmp/bad_messages.json: malformed JSON" "$bin" template --model "$model" --messages "$tmp/bad_messages.json"
printf '{"role": "user", "content": "Hi"}' >"$tmp/one_message.json"
check_error "messages not a list" "expected a JSON array of messages" "$bin" template --model "$model" --messages "$tmp/one_message.json"
check_error "vars not an object" "expected a JSON object of variables" "$bin" template --model "$model" --messages "$tmp/messages.json" --vars "$tmp/tools.json"
check_error "missing model dir" "$tmp/nomodel" "$bin" template --model "$tmp/nomodel" --messages "$tmp/messages.json"
mkdir -p "$tmp/badtpl"
printf '{%% if messages %%}unclosed' >"$tmp/badtpl/chat_template.jinja"
check_error "malformed template" "chat_template.jinja: line 1: {% if %} is never closed" "$bin" template --model "$tmp/badtpl" --messages "$tmp/messages.json"
printf '{{ raise_exception("no " ~ messages[0].role ~ " allowed") }}' >"$tmp/badtpl/chat_template.jinja"
check_error "template raises" "raise_exception: no user allowed" "$bin" template --model "$tmp/badtpl" --messages "$tmp/messages.json"

# --- bench-tokenizer ---
for i in $(seq 200); do cat "$tmp/text"; done >"$tmp/bench.txt"
out=$("$bin" bench-tokenizer --tokenizer "$tok" --input "$tmp/bench.txt" --iters 2)
if grep -q "MB/s" <<<"$out"; then n_pass=$((n_pass + 1)); else n_fail=$((n_fail + 1)); echo "FAIL bench-tokenizer: $out"; fi
check_error "bench missing input" "$tmp/missing.txt" "$bin" bench-tokenizer --tokenizer "$tok" --input "$tmp/missing.txt"

echo "$n_pass passed, $n_fail failed"
[ "$n_fail" -eq 0 ]
