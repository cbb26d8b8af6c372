#!/usr/bin/env bash
# Builds the CUDA configuration (sm_90a) into build-gpu/ (or $BUILD_DIR: the
# CI build folder build/ is the same configuration wherever nvcc is found, so
# BUILD_DIR=build reuses it) and stages what a GPU
# machine needs to run it into .carry/ (binaries, libloom, plugins).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
B=${BUILD_DIR:-build-gpu}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_WITH_CUDA=ON "$@"
cmake --build "$B" -j "$(nproc)"
rm -rf .carry && mkdir -p .carry/bin .carry/lib
# What scripts/gpu_check.sh runs, and nothing else (the device takes 64 MiB
# with the tree): loom, the suites with GPU cases, the benchmarks. Stripped:
# the symbols are for debuggers, and the tree travels without them.
for t in loom test_cuda_kernels test_cuda_gemm test_cuda_fp8 test_cuda_attention test_cuda_moe test_gpu_moe test_golden \
         test_gpu_train test_gpu_fp8_recipes test_gpu_fp8_block test_step_alloc test_docmask test_nccl_comm test_sharding test_fp8_mpi fp8_gemm_bench expert_streams_bench; do
  [ -x "$B/bin/$t" ] || { echo "gpu_build: $B/bin/$t was not built" >&2; exit 1; }
  cp -a "$B/bin/$t" .carry/bin/
done
cp -a "$B"/lib/. .carry/lib/
strip --strip-unneeded .carry/bin/* .carry/lib/libloom.so.*.*.* .carry/lib/loom/plugins/*.so
# The fortune corpus (Debian's fortunes package, which GPU images lack) as
# byte-level token shards: the GPU training test and the native-vs-fused
# convergence run read it (5 MB).
.carry/bin/loom prepare text .carry/data/fortunes /usr/share/games/fortunes > /dev/null
du -sh .carry
