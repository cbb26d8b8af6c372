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
         test_gpu_train test_gpu_fp8_recipes test_gpu_fp8_block test_step_alloc test_docmask test_nccl_comm test_sharding test_fp8_mpi \
         test_reliability_hostile test_fp8_rowwise_example test_cpu_kernels test_train_e2e test_fp8_recipes \
         fp8_gemm_bench expert_streams_bench; do
  [ -x "$B/bin/$t" ] || { echo "gpu_build: $B/bin/$t was not built" >&2; exit 1; }
  cp -a "$B/bin/$t" .carry/bin/
done
cp -a "$B"/lib/. .carry/lib/
# examples/plugins/fp8_rowwise, built from the installed SDK by the install
# test, where test_fp8_rowwise_example loads it (its build folder, under .carry).
ctest --test-dir "$B" -R '^install_sdk_and_build_example$' --output-on-failure > /dev/null ||
  { echo "gpu_build: the install test (examples built from the installed SDK) failed" >&2; exit 1; }
mkdir -p .carry/tests/install/work/fp8_rowwise-build
cp -a "$B"/tests/install/work/fp8_rowwise-build/libloom-precision-fp8_rowwise.so .carry/tests/install/work/fp8_rowwise-build/
strip --strip-unneeded .carry/bin/* .carry/lib/libloom.so.*.*.* .carry/lib/loom/plugins/*.so \
  .carry/tests/install/work/fp8_rowwise-build/*.so
# cairo (the charts of loom compare and loom plot) is not staged: loom loads it
# only to draw a chart (apps/loom/drawing.hpp), so it starts on a GPU image
# without it, and loom compare there writes its table and CSV files and says
# the chart was not drawn. cairo and the 16 libraries it loads would add 5 MiB
# to the carried tree. Nothing staged may need it at start-up:
for f in .carry/bin/* .carry/lib/*.so* .carry/lib/loom/plugins/*.so; do
  if readelf -d "$f" | grep -q 'NEEDED.*libcairo'; then
    echo "gpu_build: $f links libcairo, which the GPU image may lack; load it when drawing instead (apps/loom/drawing.cpp)" >&2
    exit 1
  fi
done
# The fortune corpus (Debian's fortunes package, which GPU images lack) as
# byte-level token shards: the GPU training test and the native-vs-fused
# convergence run read it (5 MB).
.carry/bin/loom prepare text .carry/data/fortunes /usr/share/games/fortunes > /dev/null
# The node-loss corpus's texts (gpu_check.sh node-loss prepares it there, with
# the fortunes below): 150 steps of 8,192 tokens on 4 GPUs read 4.9M tokens,
# more than the fortunes hold (2.45M). The King James Bible (Debian's
# bible-kjv, one document a chapter) and the Jargon File (jargon-text) bring
# it to 8.3M byte tokens; gzipped they carry in 2.2 MB.
for p in bible-kjv jargon-text; do
  dpkg -s "$p" > /dev/null 2>&1 || { apt-get install -y -qq "$p" > /dev/null ||
    { echo "gpu_build: the node-loss corpus needs Debian's $p (apt-get install $p)" >&2; exit 1; }; }
done
mkdir -p .carry/node-text
bible -f "gen1:1-rev22:21" | awk -F'[ :]' 'NR > 1 && $1 != prev { print "%" } { prev = $1; print }' |
  gzip -9n > .carry/node-text/kjv.txt.gz
cp /usr/share/doc/jargon-text/jargon.txt.gz .carry/node-text/jargon.txt.gz
# The raw corpus too (2.8 MB): the CPU FP8 convergence test prepares it itself
# (gpu_check.sh cpu-bits runs it on the GPU machine's processor).
cp -a /usr/share/games/fortunes .carry/fortunes-raw
du -sh .carry
