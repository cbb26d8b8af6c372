#!/usr/bin/env bash
# The whole GPU check in one call, on a machine with an NVIDIA GPU, over a
# tree that carries .carry/ from scripts/gpu_build.sh: the GPU test suites,
# then benchmarks/compare.sh (Loom beside the PyTorch peer). Logs and JSON go
# to $OUT (default ./gpu-check-out); a summary table is printed last.
#
#   bash scripts/gpu_check.sh [tests|bench|all] [CONFIG...]
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHAT=${1:-all}; shift || true
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
SP=${SP:-$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")' 2>/dev/null || echo /opt/torch/.venv/lib/python3.12/site-packages/nvidia)}
export LD_LIBRARY_PATH=$ROOT/.carry/lib:/usr/local/cuda/lib64:$SP/cudnn/lib:$SP/nccl/lib:$SP/cu13/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
[ -f .carry/lib/libopenblas.so.0.gz ] && gunzip -f .carry/lib/libopenblas.so.0.gz
# The test binaries name the tree and their build folder by absolute path
# (/work/main, /work/main/build-gpu): make both resolve here.
if [ "$ROOT" != /work/main ]; then mkdir -p /work && ln -sfn "$ROOT" /work/main; fi
[ -e /work/main/build-gpu ] || ln -sfn "$ROOT/.carry" /work/main/build-gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

status=0
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  : > "$OUT/tests.txt"
  # The suites with GPU cases (the CPU suites run in CI).
  for n in ${GPU_TESTS:-test_cuda_kernels test_cuda_gemm test_cuda_attention test_golden test_gpu_train}; do
    t=.carry/bin/$n
    if "$t" --gtest_brief=1 > "$OUT/$n.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
    s=$(grep -cE '^\[  SKIPPED \]' "$OUT/$n.log"); p=$(grep -oE '\[  PASSED  \] [0-9]+' "$OUT/$n.log" | grep -oE '[0-9]+$')
    echo "$r $n passed=${p:-0} skipped=$s" | tee -a "$OUT/tests.txt"
    [ $r = FAIL ] && grep -E "Failure|FAILED|error" "$OUT/$n.log" | head -20
  done
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  LOOM_BIN=.carry/bin/loom OUT=$OUT/bench bash benchmarks/compare.sh "$@" | tee "$OUT/table.md"
fi
exit $status
