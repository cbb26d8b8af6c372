#!/usr/bin/env bash
# Two builds of Loom, one call: `loom bench` of each workload with the build in
# .carry (B, the tree being tried) and a baseline build in .carry/ab (A),
# alternating A B A B so that both sides see the same machine. Fresh machines
# differ by more than most changes are worth (docs/PERFORMANCE.md), so a
# change is kept or dropped on such a run only.
#
# Staging the baseline (here, before the call; .carry/ab adds about 8 MB):
#   git checkout BASE && BUILD_DIR=build bash scripts/gpu_build.sh
#   mkdir -p /tmp/ab/bin /tmp/ab/lib && cp -a .carry/bin/loom /tmp/ab/bin/ &&
#     cp -a .carry/lib/libloom.so* .carry/lib/loom /tmp/ab/lib/
#   git checkout CHANGE && BUILD_DIR=build bash scripts/gpu_build.sh
#   cp -a /tmp/ab .carry/ab && gzip -9 .carry/ab/lib/libloom.so.*.*.*
# Then on the GPU machine: bash benchmarks/ab.sh  (env CFGS, ROUNDS, STEPS,
# WARMUP, LAYERS; medians go to $OUT/ab.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/loom-ab}; mkdir -p "$OUT"
[ -x .carry/ab/bin/loom ] || { echo "ab.sh: no baseline in .carry/ab (see the header)" >&2; exit 1; }
# NVIDIA's libraries from the torch venv, found as scripts/gpu_check.sh finds them.
NV=${SP:-$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")' 2>/dev/null || echo /opt/torch/.venv/lib/python3.12/site-packages/nvidia)}
SYS_LD=/usr/local/cuda/lib64:$NV/cudnn/lib:$NV/nccl/lib:$NV/cu13/lib
for z in .carry/ab/lib/libloom.so.*.gz; do [ -e "$z" ] && gunzip -f "$z"; done
bench() { # LABEL DIR CONFIG
  local ms
  ms=$(LD_LIBRARY_PATH=$2/lib:$SYS_LD "$2/bin/loom" bench "$3" --steps="${STEPS:-10}" --warmup="${WARMUP:-3}" \
         --set model.layers="\"${LAYERS:-fused}\"" 2>&1 | grep -o '"median_step_ms":[0-9.]*' | cut -d: -f2 || true)
  echo "$1 $(basename "$3") layers=${LAYERS:-fused}: ${ms:-FAILED} ms" | tee -a "$OUT/ab.txt"
}
for cfg in ${CFGS:-configs/bench/llama-125m.toml configs/bench/llama-1b.toml configs/bench/llama2-7b.toml}; do
  for _ in $(seq "${ROUNDS:-2}"); do
    bench A .carry/ab "$cfg"
    bench B .carry "$cfg"
  done
done
