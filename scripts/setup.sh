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
