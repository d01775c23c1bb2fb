#!/usr/bin/env bash
# Installs everything Cherenkov needs to build and test, from Debian's packages and PyPI.
# Idempotent: packages already present are skipped. Used by .ci/run and the README.
set -euo pipefail

debs=(
  build-essential cmake ninja-build pkg-config
  nlohmann-json3-dev   # JSON (config.json, safetensors headers, manifests)
  libfmt-dev           # formatting
  libcli11-dev         # command-line parsing
  libxxhash-dev        # record and tensor checksums in the packed store
  liburing-dev         # io_uring reads from the expert store
  libpcre2-dev         # the tokenizer's Unicode split regex
  libicu-dev           # NFC normalization for the tokenizer
  libgtest-dev         # unit tests
  clang libclang-rt-14-dev  # libFuzzer targets for the parsers
  python3 python3-numpy
)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# Python: numpy for the test helpers; tokenizers for the tokenizer cross-checks.
python3 -c "import numpy" 2>/dev/null || python3 -m pip install -q numpy
echo "install_deps: ok"
