#!/usr/bin/env bash
# Configures and builds Loom into build/ (override with BUILD_DIR). Extra
# arguments go to cmake's configure step, e.g. -DLOOM_WITH_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
# ccache hits across checkouts of the same tree (paths hashed relative to it).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
