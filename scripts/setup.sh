#!/usr/bin/env bash
# Installs what building and testing Loom needs (Debian/Ubuntu packages).
# Idempotent: does nothing when everything is already there.
set -euo pipefail
pkgs=(build-essential cmake ninja-build ccache pkg-config
      libboost-dev libtomlplusplus-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
      libopenmpi-dev openmpi-bin libopenblas-dev libgtest-dev googletest
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
