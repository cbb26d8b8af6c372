#!/usr/bin/env bash
# From a fresh machine: install, build, run the whole test suite (GPU tests
# skip with a message when no GPU is present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
