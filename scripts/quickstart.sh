#!/usr/bin/env bash
# From a fresh machine: install, build, prepare the bundled English text
# (fortune(6)'s corpus from the Debian package), train the quickstart model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
if [ ! -f data/fortunes/val.bin ]; then
  ./build/bin/loom prepare text data/fortunes /usr/share/games/fortunes
fi
./build/bin/loom train configs/quickstart.toml "$@"
