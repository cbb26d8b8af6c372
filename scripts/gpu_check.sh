#!/usr/bin/env bash
# The whole GPU check in one call, on a machine with an NVIDIA GPU, over a
# tree that carries .carry/ from scripts/gpu_build.sh: the GPU test suites,
# then benchmarks/compare.sh (Loom beside the PyTorch peer). Logs and JSON go
# to $OUT (default ./gpu-check-out); a summary table is printed last.
#
#   bash scripts/gpu_check.sh [tests|bench|convergence|all] [CONFIG...]
#       tests: the GPU suites (a skipped case fails the check: every GPU test
#       must run here); bench: benchmarks/compare.sh, native and fused layers
#       beside the HF peer (BREAKDOWN=1 adds per-part times); convergence:
#       native against fused layers on the fortune corpus, 1000 steps;
#       trace: a [profile] window on llama-1b, its Chrome/Perfetto trace
#       checked by tests/trace/check_trace.py (the trace lands in $OUT/trace)
#   bash scripts/gpu_check.sh sharding [CONFIG]     (a host with 2+ GPUs: NCCL and
#       sharding tests, the resharded resume, single-GPU bench, PyTorch FSDP2 peer, `loom
#       compare` of every strategy, and the throughput targets; env NP, STEPS, WARMUP,
#       STRATEGIES. With 4+ GPUs (an even count) also: hybrid_shard in groups of 2 and the
#       PyTorch HSDP peer in groups of 2, the resume onto 2 GPUs, and llama2-7b under zero3
#       and hybrid_shard with planned against measured memory (compare_7b))
#   bash scripts/gpu_check.sh sharding-tests      (the test part of `sharding` only)
#   bash scripts/gpu_check.sh sharding-7b         (the llama2-7b part of `sharding` only; env STEPS_7B, WARMUP_7B)
#   bash scripts/gpu_check.sh fp8-convergence     (bf16 against fp8_delayed and fp8_current: `loom compare`
#       on the fortune corpus, fused layers, same initial weights, 1000 steps; the final validation
#       loss of each FP8 run within 1% of bf16's; env CONV_STEPS)
#   bash scripts/gpu_check.sh cpu-bits            (the CPU path's bits on this machine's processor: CpuGemm.*, the
#       recorded loss bits, the three-seed FP8 convergence test on every core; docs/RELIABILITY.md "Reproducibility")
#   bash scripts/gpu_check.sh fp8                 (test_cuda_fp8, test_gpu_fp8_recipes, test_gpu_fp8_block,
#       test_fp8_rowwise_example (the out-of-tree recipe's outer-vector GEMMs against fp64) and
#       test_gpu_train's StepMakesNoHostSynchronisation (every FP8 recipe's log line without a host sync), then
#       benchmarks/fp8_gemm.cpp: bf16 vs per-tensor and block-scaled FP8 cuBLASLt GEMMs on the llama-1b and
#       llama2-7b linears, the cast kernels and the block-scaled FP8 probe; $OUT/fp8_gemm_bench.md; env FP8_BENCH_ARGS)
#   bash scripts/gpu_check.sh fp8-rowwise [CONFIG] (examples/plugins/fp8_rowwise beside fp8_current: `loom bench` of
#       CONFIG (default llama-1b-fp8) with each, then the PyTorch peer with torchao float8 tensorwise and rowwise
#       under torch.compile; median step ms and tokens/s in $OUT/fp8_rowwise.txt; env STEPS, WARMUP, PEER_STEPS)
#   bash scripts/gpu_check.sh fp8-gathers [CONFIG] (FP8 weight gathers, sharding.gather_dtype = "fp8", on NP GPUs:
#       test_fp8_mpi over NCCL (the gathers, and fp8_delayed's amax all-reduce: equal scales on every rank), then `loom bench` of CONFIG (default llama-1b-fp8) under zero3 with
#       fp8_current and fused layers, gathering parameters and FP8; then `loom compare` of fp8_current under
#       ddp, zero1, zero2, zero3 and zero3 with FP8 gathers (tokens/s per GPU, collective bytes), and deterministic
#       runs of those and of fp8_delayed under ddp and zero3: losses within 2e-3 of ddp's; env NP, STEPS, WARMUP)
#   bash scripts/gpu_check.sh node                (Llama 3 8B at 8k on NP GPUs, default 4, in well under 9 minutes:
#       `loom check` of configs/bench/llama3-8b-8k.toml and its FP8 twin planned for this card without touching
#       it (--device-memory <the card's total> --world-size NP), `loom bench` of both under mpirun (WARMUP 2,
#       STEPS 3: 8 micro-batches a step), the PyTorch FSDP2 + compile peer of the same shape in bf16 and with
#       torchao float8 (torchtitan's recipe, per-op selective AC, whole-layer AC if that runs out of memory;
#       PEER_WARMUP 1, PEER_STEPS 2), then one table:
#       tokens/s per GPU, model TFLOP/s (causal, as NeMo counts), MFU, peak and planned GiB, Loom / peer, and
#       the issue's targets; logs, JSON and the plans' breakdowns in $OUT/node; NODE_FP8_SET="KEY=VALUE ..."
#       benches the FP8 workload once more with those settings, beside the table; NODE_ENV="VAR=VALUE ..."
#       benches both workloads once more with those variables exported to every rank, e.g. NCCL_CTA_POLICY=1)
#   bash scripts/gpu_check.sh node-trace          (the same shape on NP GPUs: a trace of step 3 of each config
#       (`loom train`, [profile] steps = [3, 3], trace = true), then benchmarks/trace_gaps.py on rank 0's trace:
#       each op's time per layer, the compute stream's idle time and where, the collectives' time; env
#       NODE_SET (extra --set KEY=VALUE items for both runs); traces and reports in $OUT/node-trace)
#   bash scripts/gpu_check.sh node-loss           (the same shape on NP GPUs, grad_accum 1, on LOSS_DATA (default
#       data/node-corpus: the fortunes, the King James Bible and the Jargon File, 8.3M byte tokens, prepared there
#       from .carry/node-text): bf16 against fp8_current (the FP8 twin), LOSS_STEPS (150) steps from the same
#       weights, `loom compare`, lr LOSS_LR (default 1e-4: at the config's 3e-4 two bf16 runs already part by
#       more than 10% on single steps) after LOSS_WARMUP (15) warm-up steps,
#       deterministic kernels unless LOSS_DET=0, and with LOSS_FLOOR=1 bf16 again without them:
#       the noise floor of two bf16 runs; LOSS_START=N first trains bf16 N steps and starts both runs from
#       those weights (a Hugging Face export in LOSS_WORK, default /tmp/loom-node-loss); LOSS_RECIPE=fp8_block
#       runs that recipe in place of fp8_current;
#       passes when the FP8 loss is within 1% of bf16's at every step after 50)
#   bash scripts/gpu_check.sh docmask             (document masking on one GPU, under 9 minutes: every GPU case
#       with the switches (test_docmask's DocMaskGpu.*: naive fp32 and cuDNN bf16 against separate documents and
#       against HF transformers' packed golden; the step's allocations and host waits; cuDNN's ragged attention
#       against naive; RoPE at given positions against the CPU); `loom bench --breakdown` with and without train.reset_attention_mask/reset_position_ids/
#       eod_mask_loss on llama-1b (8 x 2048) and on the Llama-3-8B shape at 1 x 8192 with 4 of its 32 layers
#       (the whole 8B model and its AdamW state do not fit one 80 GB GPU), synthetic documents of log-normal
#       lengths, mean 1000 tokens (step, attention and start-up times, $OUT/docmask_speed.md); then 1000 steps on
#       the fortune corpus with the switches on beside the same run without them, both runs' metrics in
#       $OUT/docmask-runs and, where cairo is, `loom plot` of both ($OUT/docmask_convergence.png; the summary
#       says which, and how to draw it elsewhere); a summary table last, with each part's seconds and the
#       total. Env DM_STEPS, CONV_STEPS)
#   bash scripts/gpu_check.sh ep [CONFIG]         (expert parallelism on NP GPUs, default 2: `loom compare` of
#       CONFIG (default mixtral-small) under ddp with every expert on every rank, and under ddp and zero3
#       with sharding.expert_parallel = NP, beside one GPU alone; losses of a deterministic run within 2e-3
#       of EP=1's, tokens/s per GPU of the expert-parallel runs >= 85% of one GPU's; env NP, STEPS, WARMUP)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHAT=${1:-all}; shift || true
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
SP=${SP:-$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")' 2>/dev/null || echo /opt/torch/.venv/lib/python3.12/site-packages/nvidia)}
export LD_LIBRARY_PATH=$ROOT/.carry/lib:/usr/local/cuda/lib64:$SP/cudnn/lib:$SP/nccl/lib:$SP/cu13/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
# Plain test output: the summary greps below read "[  PASSED  ] N" without colour codes.
export GTEST_COLOR=no
# The test binaries name the tree and their build folder by absolute path
# (/work/main, and /work/main/build-gpu or /work/main/build, whichever
# scripts/gpu_build.sh built): make them resolve here.
# A tree built elsewhere (a worktree) names its own path: LOOM_TREE=/work/wt-x.
TREE=${LOOM_TREE:-/work/main}
if [ "$ROOT" != "$TREE" ]; then mkdir -p "$(dirname "$TREE")" && ln -sfn "$ROOT" "$TREE"; fi
for b in build-gpu build; do [ -e "$TREE/$b" ] || ln -sfn "$ROOT/.carry" "$TREE/$b"; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# The fortune corpus, staged by scripts/gpu_build.sh (the GPU image has no fortunes package).
if [ ! -f data/fortunes/val.bin ] && [ -f .carry/data/fortunes/val.bin ]; then
  mkdir -p data && ln -sfn "$ROOT/.carry/data/fortunes" data/fortunes
fi

# Python packages the GPU image lacks (torchao for the float8 peer of compare.sh)
# travel as wheels in .whl/ (docs/PERFORMANCE.md, "Reproducing").
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/loom-site .whl/*.whl &&
    export PYTHONPATH=/tmp/loom-site${PYTHONPATH:+:$PYTHONPATH}
fi

# A copy of config SRC named NAME (run.name, run.out_dir = "runs/NAME") in
# folder DIR, with more sed expressions applied; prints its path:
#   renamed SRC NAME DIR [-e EXPR]...
renamed() {
  local src=$1 name=$2 dir=$3; shift 3
  mkdir -p "$dir"
  sed -e "s/^name = .*/name = \"$name\"/" -e "s|^out_dir = .*|out_dir = \"runs/$name\"|" "$@" "$src" > "$dir/$name.toml"
  echo "$dir/$name.toml"
}
# --set arguments from a space-separated list of KEY=VALUE items, into SETS:
#   set_args "$LIST"; loom ... "${SETS[@]}"
set_args() {
  SETS=()
  local kv
  for kv in $1; do SETS+=(--set "$kv"); done
}

# N ranks, one per GPU, with this environment: mpi_on N COMMAND...
mpi_on() {
  local n=$1; shift
  mpirun --allow-run-as-root --bind-to none -np "$n" -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x GTEST_COLOR -x PATH "$@"
}

status=0
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  : > "$OUT/tests.txt"
  # The suites with GPU cases (the CPU suites run in CI).
  for n in ${GPU_TESTS:-test_cuda_kernels test_cuda_gemm test_cuda_fp8 test_cuda_attention test_cuda_moe test_golden test_gpu_train test_gpu_moe test_gpu_fp8_recipes test_gpu_fp8_block test_step_alloc test_docmask}; do
    t=.carry/bin/$n
    if "$t" --gtest_brief=1 > "$OUT/$n.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
    s=$(grep -cE '^\[  SKIPPED \]' "$OUT/$n.log"); p=$(grep -oE '\[  PASSED  \] [0-9]+' "$OUT/$n.log" | grep -oE '[0-9]+$')
    # On a GPU machine nothing may skip: a skipped GPU test has not passed.
    # (The CPU-only placeholders that exist for builds without CUDA are named *Skipped*/*Without*.)
    real_skips=$(grep -E '^\[  SKIPPED \]' "$OUT/$n.log" | grep -vcE 'Skipped|Without|NeedsTheCudaBackend')
    if [ "$real_skips" -gt 0 ]; then r=FAIL; status=1; grep -E '^\[  SKIPPED \]' "$OUT/$n.log" | head; fi
    echo "$r $n passed=${p:-0} skipped=$s" | tee -a "$OUT/tests.txt"
    [ $r = FAIL ] && grep -E "Failure|FAILED|error" "$OUT/$n.log" | head -20
    grep -hE '^\[(golden|gpu curve|gpu moe|deterministic|timestamp|step allocations|fp8 gemm|fp8 gpu|fp8 weight_cache|fp8 selective|fp8 memory|fp8_block weight_cache|fp8_block memory)' "$OUT/$n.log" | tee -a "$OUT/tests.txt"
  done
fi
if [ "$WHAT" = cpu-bits ]; then
  # The CPU path's promise (docs/RELIABILITY.md, "Reproducibility") on this
  # machine's processor, another x86-64 model than CI's: the recorded GEMM
  # digests and loss bits, then the three-seed FP8 convergence test, whose
  # table must be the one in its comment (threads change no bit, so it runs on
  # every core here).
  : > "$OUT/cpu_bits.txt"
  lscpu | grep -E 'Model name|^CPU\(s\)' | tee -a "$OUT/cpu_bits.txt"
  if [ ! -d /usr/share/games/fortunes ] && [ -d .carry/fortunes-raw ]; then
    mkdir -p /usr/share/games && ln -sfn "$ROOT/.carry/fortunes-raw" /usr/share/games/fortunes
  fi
  for nf in "test_cpu_kernels:CpuGemm.*" "test_train_e2e:TrainE2E.LossBitsAreTheSameOnEveryProcessor" \
            "test_fp8_recipes:Fp8Recipes.QuickstartTrainsLikeFp32AcrossSeeds"; do
    n=${nf%%:*}; f=${nf#*:}
    t0=$(date +%s)
    if OMP_NUM_THREADS=$(nproc) LOOM_FP8_CONVERGENCE_THREADS=$(nproc) .carry/bin/$n --gtest_filter="$f" > "$OUT/$n.cpu.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
    s=$(grep -cE '^\[  SKIPPED \]' "$OUT/$n.cpu.log"); p=$(grep -oE '\[  PASSED  \] [0-9]+' "$OUT/$n.cpu.log" | grep -oE '[0-9]+$')
    [ "$s" -gt 0 ] && { r=FAIL; status=1; }
    echo "$r $n $f passed=${p:-0} skipped=$s $(( $(date +%s) - t0 ))s" | tee -a "$OUT/cpu_bits.txt"
    [ $r = FAIL ] && grep -E "Failure|FAILED|Expected|Which is|digest|bits" "$OUT/$n.cpu.log" | head -20 | tee -a "$OUT/cpu_bits.txt"
    grep -A4 "validation loss by seed" "$OUT/$n.cpu.log" | tee -a "$OUT/cpu_bits.txt"
  done
fi
if [ "$WHAT" = fp8 ]; then
  # The FP8 building blocks: the suite (nothing may skip on a GPU), then the GEMM benchmark.
  : > "$OUT/tests.txt"
  # name[:gtest filter]: test_gpu_train only for the FP8 recipes' log lines read without a host sync.
  for nf in test_cuda_fp8 test_gpu_fp8_recipes test_gpu_fp8_block test_fp8_rowwise_example \
            test_gpu_train:GpuTrain.StepMakesNoHostSynchronisation; do
  n=${nf%%:*}; f=${nf#"$n"}; f=${f#:}
  if .carry/bin/$n --gtest_brief=1 ${f:+--gtest_filter=$f} > "$OUT/$n.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
  s=$(grep -cE '^\[  SKIPPED \]' "$OUT/$n.log"); p=$(grep -oE '\[  PASSED  \] [0-9]+' "$OUT/$n.log" | grep -oE '[0-9]+$')
  if [ "$s" -gt 0 ]; then r=FAIL; status=1; grep -E '^\[  SKIPPED \]' "$OUT/$n.log" | head; fi
  echo "$r $n passed=${p:-0} skipped=$s" | tee -a "$OUT/tests.txt"
  [ $r = FAIL ] && grep -E "Failure|FAILED|error" "$OUT/$n.log" | head -40
  grep -hE '^\[fp8(_block|_rowwise|_delayed|_current)? (gemm|gpu|cuda|cpu|weight_cache|selective|memory|log line)' "$OUT/$n.log" | tee -a "$OUT/tests.txt"
  done
  # shellcheck disable=SC2086
  if .carry/bin/fp8_gemm_bench ${FP8_BENCH_ARGS:-} > "$OUT/fp8_gemm_bench.md" 2> "$OUT/fp8_gemm_bench.log"; then
    r=PASS; else r=FAIL; status=1; fi
  cat "$OUT/fp8_gemm_bench.md"
  [ $r = FAIL ] && tail -20 "$OUT/fp8_gemm_bench.log"
  echo "$r fp8_gemm_bench" | tee -a "$OUT/tests.txt"
fi
if [ "$WHAT" = fp8-rowwise ]; then
  CFG=${1:-configs/bench/llama-1b-fp8.toml}
  RW=$ROOT/.carry/tests/install/work/fp8_rowwise-build/libloom-precision-fp8_rowwise.so
  : > "$OUT/fp8_rowwise.txt"
  for p in fp8_current fp8_rowwise fp8_current fp8_rowwise; do
    extra=()
    [ "$p" = fp8_rowwise ] && extra=(--set "precision.path=\"$RW\"")
    L=$OUT/bench_$p.log
    if .carry/bin/loom bench "$CFG" --steps="${STEPS:-10}" --warmup="${WARMUP:-3}" --set "precision.plugin=\"$p\"" \
         "${extra[@]}" > "$L" 2>&1; then r=PASS; else r=FAIL; status=1; tail -20 "$L"; fi
    ms=$(grep -o '"median_step_ms":[0-9.]*' "$L" | tail -1 | cut -d: -f2)
    tps=$(grep -o '"tokens_per_s[a-z_]*":[0-9.]*' "$L" | tail -1 | cut -d: -f2)
    echo "$r loom $p $(basename "$CFG"): ${ms:-?} ms/step, ${tps:-?} tokens/s" | tee -a "$OUT/fp8_rowwise.txt"
  done
  python3 benchmarks/hf_llama.py "$CFG" --modes float8+compile,float8-rowwise+compile --steps "${PEER_STEPS:-10}" \
    --warmup 3 2>&1 | grep PEER_JSON | tee -a "$OUT/fp8_rowwise.txt"
fi
if [ "$WHAT" = fp8-gathers ]; then
  NP=${NP:-$(nvidia-smi -L | wc -l)}
  MPI=(mpi_on "$NP")
  : > "$OUT/tests.txt"
  L=$OUT/test_fp8_mpi_cuda.log
  if "${MPI[@]}" -x LOOM_FP8_MPI_DEVICE=cuda .carry/bin/test_fp8_mpi > "$L" 2>&1; then
    r=PASS; else r=FAIL; status=1; fi
  s=$(grep -cE '^\[  SKIPPED \]' "$L"); [ "$s" -gt 0 ] && { r=FAIL; status=1; }
  echo "$r test_fp8_mpi (cuda: FP8 gathers, delayed scales) np=$NP $(grep -oE '\[  PASSED  \] [0-9]+' "$L" | head -1) skipped=$s" | tee -a "$OUT/tests.txt"
  [ $r = FAIL ] && grep -E "Failure|FAILED|error|missing" "$L" | sort -u | head -30
  grep -E '^\[fp8 gathers\]' "$L" | sort -u | tee -a "$OUT/tests.txt"
  CFG=${1:-configs/bench/llama-1b-fp8.toml}
  for g in param fp8; do
    "${MPI[@]}" .carry/bin/loom bench "$CFG" --steps="${STEPS:-10}" --warmup="${WARMUP:-3}" \
      --set model.layers='"fused"' --set precision.plugin='"fp8_current"' --set sharding.plugin='"zero3"' \
      --set sharding.gather_dtype="\"$g\"" > "$OUT/bench_zero3_gather_$g.log" 2>&1 || { status=1; tail -20 "$OUT/bench_zero3_gather_$g.log"; }
    echo "== zero3, fp8_current, gather_dtype = $g ($CFG, np=$NP)" | tee -a "$OUT/tests.txt"
    grep -iE "step|mfu|memory|gib" "$OUT/bench_zero3_gather_$g.log" | tail -6 | tee -a "$OUT/tests.txt"
  done
  # FP8 across the strategies on NP GPUs: fp8_current with fused layers under ddp, zero1,
  # zero2, zero3 and zero3 with FP8 gathers, beside one GPU alone; timed (tokens/s per GPU
  # and collective bytes per step), then again deterministic with a ddp repeat (its
  # difference from the first ddp row is the noise floor), and fp8_delayed (amaxes reduced
  # across the ranks) under ddp and zero3. Losses within 2e-3 of ddp's at every step.
  F8=(--set model.layers='"fused"' --set precision.plugin='"fp8_current"')
  ST='ddp,zero1,zero2,zero3,zero3:gather_dtype="fp8"'
  DET=(--steps=10 --warmup=0 --set run.deterministic=true --set train.warmup_steps=10)
  .carry/bin/loom bench "$CFG" "${F8[@]}" --steps="${STEPS:-10}" --warmup="${WARMUP:-3}" \
    --json="$OUT/fp8_single.json" > "$OUT/fp8_single.log" 2>&1 || { status=1; tail -5 "$OUT/fp8_single.log"; }
  "${MPI[@]}" .carry/bin/loom compare "$CFG" "${F8[@]}" --strategies="$ST" --steps="${STEPS:-10}" --warmup="${WARMUP:-3}" \
    --out="$OUT/fp8_compare" > "$OUT/fp8_compare.out" 2> "$OUT/fp8_compare.log" || { status=1; tail -20 "$OUT/fp8_compare.log"; }
  grep -v '^COMPARE_JSON' "$OUT/fp8_compare.out" | tee -a "$OUT/tests.txt"
  "${MPI[@]}" .carry/bin/loom compare "$CFG" "${F8[@]}" --strategies="$ST,ddp" "${DET[@]}" \
    > "$OUT/fp8_compare_det.out" 2> "$OUT/fp8_compare_det.log" || { status=1; tail -20 "$OUT/fp8_compare_det.log"; }
  "${MPI[@]}" .carry/bin/loom compare "$CFG" --set model.layers='"fused"' --strategies=ddp,zero3,ddp "${DET[@]}" \
    > "$OUT/fp8_delayed_det.out" 2> "$OUT/fp8_delayed_det.log" || { status=1; tail -20 "$OUT/fp8_delayed_det.log"; }
  grep -v '^COMPARE_JSON' "$OUT/fp8_delayed_det.out" | tee -a "$OUT/tests.txt"
  # Throughput is reported, not judged here (LOOM_TARGET_* = 0): the FP8 targets are losses and traffic.
  for pair in fp8_compare:fp8_compare_det fp8_delayed_det:fp8_delayed_det; do
    timed=${pair%%:*} det=${pair##*:}
    if LOOM_TARGET_DENSE=0 LOOM_TARGET_SHARDED=0 python3 benchmarks/sharding_targets.py "$OUT/fp8_single.json" \
         "$OUT/$timed.out" "$OUT/$det.out" | tee "$OUT/$det.md"; then r=PASS; else r=FAIL; status=1; fi
    echo "$r FP8 losses across strategies ($det, np=$NP)" | tee -a "$OUT/tests.txt"
  done
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  LOOM_BIN=.carry/bin/loom OUT=$OUT/bench bash benchmarks/compare.sh "$@" | tee "$OUT/table.md"
fi
if [ "$WHAT" = convergence ] || [ "$WHAT" = all ]; then
  # Native against fused layers: same seed (same initial weights), bf16 +
  # cuDNN, 1000 steps, an evaluation every 100. The reference is native with
  # a deterministic attention backward; beside it run fused (deterministic)
  # and REPEAT runs each of native and fused with cuDNN's non-deterministic
  # backward, whose sums land in another order every run. How far the
  # native-nondet runs drift from the reference is the noise floor of a bf16
  # run; every fused run is held to 0.5% at every evaluation, a bound that
  # means something only while the floor stays below it.
  C=configs/convergence; CC=$OUT/convergence-configs
  rm -rf "$CC" && mkdir -p "$CC"
  runs=$C/fortunes-fused.toml
  for layers in native fused; do
    for i in $(seq "${REPEAT:-3}"); do
      runs=$runs,$(renamed "$C/fortunes-$layers.toml" "fortunes-$layers-nondet-$i" "$CC" \
                     -e 's/^deterministic = .*/deterministic = false/')
    done
  done
  # CONV_SET="train.lr=3e-4 train.min_lr=3e-5": more --set overrides, for every run alike.
  set_args "${CONV_SET:-}"
  .carry/bin/loom compare $C/fortunes-native.toml --configs="$runs" --set run.overwrite=true "${SETS[@]}" \
    --steps="${CONV_STEPS:-1000}" --warmup=0 --validate=100 --out="$OUT/convergence" \
    > "$OUT/convergence.out" 2> "$OUT/convergence.log" || status=1
  grep -v '^COMPARE_JSON' "$OUT/convergence.out"
  python3 - "$OUT/convergence/compare_val_losses.csv" <<'PY' || status=1
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
ref, *others = [k for k in rows[0] if k != "step"]
def rel(name):
    return [abs(float(r[name]) - float(r[ref])) / float(r[ref]) for r in rows]
print(f"convergence: {len(rows)} evaluations; relative validation-loss difference to {ref} (worst / mean over evaluations / final)")
for name in others:
    d = rel(name)
    print(f"  {name:28s} {100 * max(d):6.3f}%  {100 * statistics.mean(d):6.3f}%  {100 * d[-1]:6.3f}%")
floor = [max(rel(n)) for n in others if "native-nondet" in n]
fused = [max(rel(n)) for n in others if n.startswith("fortunes-fused")]
det = max(rel("fortunes-fused"))
if floor:
    print(f"noise floor (native, non-deterministic backward, {len(floor)} runs): worst {100 * min(floor):.3f}% .. {100 * max(floor):.3f}%")
print(f"fused ({len(fused)} runs): worst {100 * min(fused):.3f}% .. {100 * max(fused):.3f}%; deterministic fused {100 * det:.3f}% (target 0.5%)")
# Passes when every fused run (deterministic or not) stays within 0.5% of
# the reference at every evaluation. The native runs show the noise floor: a
# floor above 0.5% means the workload cannot judge fused layers at that
# bound (the configs' lr is chosen so that it stays below), and fails too.
target = 0.005
ok = max(fused) <= target and (not floor or max(floor) <= target)
if floor and max(floor) > target:
    print(f"the noise floor ({100 * max(floor):.3f}%) is above the {100 * target:.1f}% target: this workload cannot judge fused layers")
print(f"fused layers {'within' if max(fused) <= target else 'OUTSIDE'} {100 * target:.1f}% of native at every evaluation")
sys.exit(0 if ok else 1)
PY
fi
if [ "$WHAT" = fp8-convergence ] || [ "$WHAT" = all ]; then
  # bf16 (the reference) against the FP8 recipes: same seed and so the same
  # initial weights, fused layers, cuDNN's deterministic backward.
  C=configs/convergence
  .carry/bin/loom compare $C/fortunes-fused.toml --configs="$C/fortunes-fp8-delayed.toml,$C/fortunes-fp8-current.toml" \
    --set run.overwrite=true --steps="${CONV_STEPS:-1000}" --warmup=0 --validate=100 --out="$OUT/fp8-convergence" \
    > "$OUT/fp8-convergence.out" 2> "$OUT/fp8-convergence.log" || status=1
  grep -v '^COMPARE_JSON' "$OUT/fp8-convergence.out"
  grep -E '^.*precision: ' "$OUT/fp8-convergence.log" | tail -4
  python3 - "$OUT/fp8-convergence/compare_val_losses.csv" <<'PY' || status=1
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
ref, *others = [k for k in rows[0] if k != "step"]
ok = True
print(f"fp8 convergence: {len(rows)} evaluations against {ref} (worst relative difference / final validation loss / final difference)")
for name in others:
    d = [abs(float(r[name]) - float(r[ref])) / float(r[ref]) for r in rows]
    final = (float(rows[-1][name]) - float(rows[-1][ref])) / float(rows[-1][ref])
    ok &= abs(final) <= 0.01
    print(f"  {name:24s} worst {100 * max(d):6.3f}%  final {float(rows[-1][name]):.4f} vs {float(rows[-1][ref]):.4f}  "
          f"{100 * final:+.3f}% ({'within' if abs(final) <= 0.01 else 'OUTSIDE'} 1%)")
sys.exit(0 if ok else 1)
PY
fi
if [ "$WHAT" = trace ] || [ "$WHAT" = all ]; then
  # Steps 4-6 of 8 profiled (cudaProfilerStart/Stop around them) with a trace
  # per rank; the checker verifies its nesting and its steps against metrics.jsonl.
  rm -rf "$OUT/trace-run"
  .carry/bin/loom train configs/bench/llama-1b.toml --set model.layers=fused --set train.steps=8 \
    --set 'profile.steps=[4,6]' --set profile.trace=true --set run.out_dir="$OUT/trace-run" \
    > "$OUT/trace.log" 2>&1 || status=1
  if python3 tests/trace/check_trace.py "$OUT/trace-run/trace/rank_0.json" "$OUT/trace-run/metrics.jsonl" \
    | tee "$OUT/trace_check.txt"; then r=PASS; else r=FAIL; status=1; fi
  echo "$r trace (llama-1b fused, steps 4-6)" | tee -a "$OUT/tests.txt"
  mkdir -p "$OUT/trace" && cp "$OUT/trace-run/trace/rank_0.json" "$OUT/trace/" 2>/dev/null
fi
if [ "$WHAT" = sharding ] || [ "$WHAT" = sharding-tests ]; then
  CFG=${1:-configs/bench/llama-1b.toml}
  NP=${NP:-$(nvidia-smi -L | wc -l)}
  STEPS=${STEPS:-10}; WARMUP=${WARMUP:-3}
  # With 4+ GPUs hybrid_shard runs in groups of 2 (its default, one node, would be zero3 here).
  GROUPS2=0; [ "$NP" -ge 4 ] && [ $((NP % 2)) = 0 ] && GROUPS2=1
  HYBRID=hybrid_shard; [ $GROUPS2 = 1 ] && HYBRID=hybrid_shard:shard_group_size=2
  STRATEGIES=${STRATEGIES:-ddp,zero1,zero2,zero3,$HYBRID}
  MPI=(mpi_on "$NP")
  MPI2=(mpi_on 2)
  : > "$OUT/tests.txt"
  # NCCL communicator and every strategy on GPUs (fp32, tiny model, against one process).
  if "${MPI[@]}" .carry/bin/test_nccl_comm > "$OUT/test_nccl_comm.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
  echo "$r test_nccl_comm np=$NP $(grep -oE '\[  PASSED  \] [0-9]+' "$OUT/test_nccl_comm.log" | head -1)" | tee -a "$OUT/tests.txt"
  if "${MPI[@]}" -x LOOM_SHARDING_TEST_DEVICE=cuda .carry/bin/test_sharding > "$OUT/test_sharding_cuda.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
  echo "$r test_sharding (cuda) np=$NP $(grep -oE '\[  PASSED  \] [0-9]+' "$OUT/test_sharding_cuda.log" | head -1)" | tee -a "$OUT/tests.txt"
  grep -E "^\[ .* \] worst" "$OUT/test_sharding_cuda.log" | sort -u | head -20
  # A sharded checkpoint on the GPUs: zero3 on NP ranks saves at step 10; ddp on
  # NP ranks and one process on one GPU resume it; both must continue with the
  # losses of one uninterrupted process (same global batch), within 1e-5.
  R=$OUT/reshard; rm -rf "$R"; mkdir -p "$R"
  cat > "$R/tiny.toml" <<'TOML'
[run]
name = "gpu-reshard"
device = "cuda"
seed = 3
[model]
hidden = 128
num_layers = 2
num_heads = 4
num_kv_heads = 2
ffn_hidden = 352
vocab_size = 512
max_seq_len = 64
[train]
steps = 20
micro_batch = 4
seq_len = 64
lr = 2e-3
warmup_steps = 0
schedule = "constant"
[checkpoint]
every = 0
resume = "none"
[precision]
plugin = "fp32"
[attention]
plugin = "naive"
[sharding]
plugin = "none"
[data]
plugin = "synthetic"
TOML
  L=.carry/bin/loom
  $L train "$R/tiny.toml" --set train.grad_accum=$NP --set run.out_dir="$R/ref" > "$R/ref.log" 2>&1
  "${MPI[@]}" $L train "$R/tiny.toml" --set sharding.plugin=zero3 --set train.steps=10 --set checkpoint.every=10 \
    --set checkpoint.dir="$R/ck" --set run.out_dir="$R/save" > "$R/save.log" 2>&1
  "${MPI[@]}" $L train "$R/tiny.toml" --set sharding.plugin=ddp --set checkpoint.resume=10 \
    --set checkpoint.dir="$R/ck" --set run.out_dir="$R/ddp" > "$R/ddp.log" 2>&1
  $L train "$R/tiny.toml" --set train.grad_accum=$NP --set checkpoint.resume=10 --set checkpoint.dir="$R/ck" \
    --set run.out_dir="$R/one" > "$R/one.log" 2>&1
  # And onto 2 GPUs (zero3 again, the same global batch), where there were more.
  if [ "$NP" -gt 2 ] && [ $((NP % 2)) = 0 ]; then
    "${MPI2[@]}" $L train "$R/tiny.toml" --set sharding.plugin=zero3 --set train.grad_accum=$((NP / 2)) \
      --set checkpoint.resume=10 --set checkpoint.dir="$R/ck" --set run.out_dir="$R/two" > "$R/two.log" 2>&1
  fi
  if python3 - "$R" <<'PY'
import json, os, sys
d = sys.argv[1]
def losses(n):
    return {j["step"]: j["loss"] for j in map(json.loads, open(f"{d}/{n}/metrics.jsonl")) if "loss" in j}
ref = losses("ref")
worst = 0.0
for run in ("save", "ddp", "one") + (("two",) if os.path.exists(f"{d}/two.log") else ()):
    got = losses(run)
    assert got, run
    for k, v in got.items():
        worst = max(worst, abs(v - ref[k]) / abs(ref[k]))
two = " and -> 2 GPUs (zero3)" if os.path.exists(f"{d}/two.log") else ""
print(f"resharded resume on cuda: zero3 -> ddp and -> one GPU{two}, worst rel loss diff {worst:.2e}")
sys.exit(0 if worst <= 1e-5 else 1)
PY
  then r=PASS; else r=FAIL; status=1; fi
  echo "$r reshard (cuda) np=$NP" | tee -a "$OUT/tests.txt"
fi
if [ "$WHAT" = docmask ]; then
  T0=$(date +%s)
  DM=(--set train.reset_attention_mask=true --set train.reset_position_ids=true --set train.eod_mask_loss=true)
  SUM=$OUT/docmask_summary.md
  { echo "| check | result | detail |"; echo "| --- | --- | --- |"; } > "$SUM"
  # 1. Every GPU case with document masking (nothing may skip here): test_docmask's (naive fp32 within 1e-5
  #    and cuDNN bf16 within 3e-2 of separate documents; HF transformers' packed golden on both paths),
  #    the step's allocations and host waits with the switches on, cuDNN's ragged attention against naive.
  #    RoPE at given positions on CUDA against the CPU. Each row of the summary gives its seconds: cuDNN builds
  #    every ragged graph of a document shape at start-up (log2(S) + 1 sequence-count buckets, forward and
  #    backward, packed and fused layouts), which is where this mode's time goes.
  for t in "test_docmask DocMaskGpu.*" "test_step_alloc *DocumentMasking*" "test_gpu_train *DocumentMasking*" \
           "test_cuda_attention *Document*" "test_cuda_kernels *RopeAtPositions*"; do
    read -r n f <<< "$t"
    t1=$(date +%s)
    if .carry/bin/$n --gtest_filter="$f" --gtest_brief=1 > "$OUT/docmask_$n.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
    p=$(grep -oE '\[  PASSED  \] [0-9]+' "$OUT/docmask_$n.log" | grep -oE '[0-9]+$')
    s=$(grep -cE '^\[  SKIPPED \]' "$OUT/docmask_$n.log")
    if [ "$s" -gt 0 ] || [ "${p:-0}" -eq 0 ]; then r=FAIL; status=1; fi
    echo "| $n $f | $r | passed ${p:-0}, skipped $s, $(( $(date +%s) - t1 )) s |" >> "$SUM"
    echo "$r $n $f passed=${p:-0} skipped=$s"
    [ $r = FAIL ] && grep -E "Failure|FAILED|error|SKIPPED" "$OUT/docmask_$n.log" | head -20
    grep -hE '^\[(docmask|step allocations)' "$OUT/docmask_$n.log"
  done
  # 2. Speed: the step and the attention kernel alone (loom bench --breakdown), with and without the switches,
  #    on synthetic documents of log-normal lengths (mean 1000 tokens, sigma 1). The Llama-3-8B shape keeps 4 of
  #    its 32 layers: the whole model and its AdamW state do not fit one 80 GB GPU.
  L3=(--set model.num_layers=4 --set model.num_kv_heads=8 --set model.ffn_hidden=14336 --set model.vocab_size=128256
      --set model.max_seq_len=8192 --set model.rope_theta=500000 --set train.micro_batch=1 --set train.seq_len=8192)
  t1=$(date +%s)
  for shape in llama-1b llama3-8b-4layers; do
    if [ $shape = llama-1b ]; then CFG=configs/bench/llama-1b.toml; SH=(); else CFG=configs/bench/llama2-7b.toml; SH=("${L3[@]}"); fi
    for mode in plain masked; do
      M=(); [ $mode = masked ] && M=("${DM[@]}")
      .carry/bin/loom bench "$CFG" "${SH[@]}" --set data.document_length=1000 "${M[@]}" --steps="${DM_STEPS:-10}" \
        --warmup=3 --breakdown --json="$OUT/docmask_${shape}_$mode.json" > "$OUT/docmask_${shape}_$mode.log" 2>&1 ||
        { status=1; tail -5 "$OUT/docmask_${shape}_$mode.log"; }
    done
  done
  SPEED=$OUT/docmask_speed.md
  python3 - "$OUT" > "$SPEED" <<'PY' || status=1
import json, os, sys
out = sys.argv[1]
print("| shape | mode | step ms | tokens/s | attention fwd ms | attention bwd ms | start-up s | masked / plain: step | attention |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
ok = True
for shape in ("llama-1b", "llama3-8b-4layers"):
    r = {}
    for mode in ("plain", "masked"):
        p = os.path.join(out, f"docmask_{shape}_{mode}.json")
        r[mode] = json.load(open(p)) if os.path.exists(p) else None
    for mode in ("plain", "masked"):
        j = r[mode]
        if j is None:
            print(f"| {shape} | {mode} | failed | | | | | | |")
            ok = False
            continue
        b = j.get("breakdown_ms", {})
        att = b.get("attention.forward", 0) + b.get("attention.backward", 0)
        step_ratio = att_ratio = ""
        if mode == "masked" and r["plain"]:
            pb = r["plain"].get("breakdown_ms", {})
            patt = pb.get("attention.forward", 0) + pb.get("attention.backward", 0)
            step_ratio = f"{j['median_step_ms'] / r['plain']['median_step_ms']:.3f}x"
            att_ratio = f"{att / patt:.3f}x" if patt > 0 else ""
        print(f"| {shape} {j['batch']}x{j['seq_len']} | {mode} | {j['median_step_ms']:.2f} | {j['tokens_per_s']:.0f} | "
              f"{b.get('attention.forward', 0):.2f} | {b.get('attention.backward', 0):.2f} | {j.get('startup_s', 0):.1f} | "
              f"{step_ratio} | {att_ratio} |")
sys.exit(0 if ok else 1)
PY
  cat "$SPEED"
  # The issue's target: the masked step no slower than the plain one (<= 1.00x) at both shapes.
  for shape in llama-1b llama3-8b-4layers; do
    ratio=$(grep "^| $shape .* | masked |" "$SPEED" | awk -F'|' '{gsub(/[ x]/, "", $9); print $9}')
    if [ -n "$ratio" ] && python3 -c "import sys; sys.exit(0 if float('$ratio') <= 1.0 else 1)"; then r=PASS; else r=MISSED; fi
    echo "| masked step <= 1.00x plain, $shape | $r | ${ratio:-no measurement}x |" >> "$SUM"
  done
  echo "| speed table, 4 loom bench runs | | $(( $(date +%s) - t1 )) s |" >> "$SUM"
  t1=$(date +%s)
  # 3. Convergence on the fortune corpus (its documents as loom prepare wrote them, BOS/EOS recorded in the
  #    shards): 1000 steps with the switches on beside the same run without them, same initial weights.
  C=configs/convergence; CC=$OUT/docmask-configs
  rm -rf "$CC" && mkdir -p "$CC"
  renamed "$C/fortunes-fused.toml" fortunes-docmask "$CC" \
    -e 's/^\[train\]$/[train]\nreset_attention_mask = true\nreset_position_ids = true\neod_mask_loss = true/' > /dev/null
  # cuDNN's ordinary (non-deterministic) backward in both runs: the curves are compared, not bits.
  .carry/bin/loom compare $C/fortunes-fused.toml --configs="$CC/fortunes-docmask.toml" --set run.overwrite=true \
    --set run.deterministic=false --steps="${CONV_STEPS:-1000}" --warmup=0 --validate=100 \
    --out="$OUT/docmask-convergence" > "$OUT/docmask-convergence.out" 2> "$OUT/docmask-convergence.log" || status=1
  grep -v '^COMPARE_JSON' "$OUT/docmask-convergence.out"
  if python3 - "$OUT/docmask-convergence/compare_val_losses.csv" > "$OUT/docmask_convergence.txt" <<'PY'
import csv, math, sys
rows = list(csv.DictReader(open(sys.argv[1])))
names = [k for k in rows[0] if k != "step"]
ok = True
for name in names:
    v = [float(r[name]) for r in rows]
    print(f"{name}: validation loss {v[0]:.4f} -> {v[-1]:.4f} over {len(rows)} evaluations")
    ok = ok and all(math.isfinite(x) for x in v) and v[-1] < v[0]
sys.exit(0 if ok else 1)
PY
  then r=PASS; else r=FAIL; status=1; fi
  cat "$OUT/docmask_convergence.txt"
  echo "| convergence, fortunes ${CONV_STEPS:-1000} steps, switches on vs off | $r | $(paste -sd';' "$OUT/docmask_convergence.txt"); $(( $(date +%s) - t1 )) s |" >> "$SUM"
  # The chart. `loom compare` keeps both runs' losses in its CSV files; they become each run's
  # metrics.jsonl under $OUT/docmask-runs. `loom plot` draws with cairo, which it loads only to draw:
  # where the GPU image lacks it, the chart is drawn from those files on a machine that has it.
  python3 - "$OUT/docmask-convergence" "$OUT/docmask-runs" <<'PY' || status=1
import csv, json, os, sys
src, dst = sys.argv[1], sys.argv[2]
train = list(csv.DictReader(open(os.path.join(src, "compare_losses.csv"))))
val = list(csv.DictReader(open(os.path.join(src, "compare_val_losses.csv"))))
for name in (k for k in train[0] if k != "step"):
    os.makedirs(os.path.join(dst, name), exist_ok=True)
    with open(os.path.join(dst, name, "metrics.jsonl"), "w") as f:
        for r in train:
            f.write(json.dumps({"step": int(r["step"]), "loss": float(r[name])}) + "\n")
        for r in val:
            f.write(json.dumps({"step": int(r["step"]), "val_loss": float(r[name])}) + "\n")
PY
  if .carry/bin/loom plot "$OUT/docmask-runs/fortunes-fused" "$OUT/docmask-runs/fortunes-docmask" --out "$OUT/docmask_convergence.png" \
       > "$OUT/docmask_plot.log" 2>&1 && [ -s "$OUT/docmask_convergence.png" ]; then
    plot="drawn here: $OUT/docmask_convergence.png"
  else
    plot="not drawn here ($(tail -1 "$OUT/docmask_plot.log")); draw it where cairo is: loom plot $OUT/docmask-runs/fortunes-fused $OUT/docmask-runs/fortunes-docmask --out docmask_convergence.png"
  fi
  echo "| convergence chart | $( [ -s "$OUT/docmask_convergence.png" ] && echo drawn || echo metrics only) | $plot |" >> "$SUM"
  echo "| wall time | | $(( $(date +%s) - T0 )) s |" >> "$SUM"
  echo; echo "docmask speed ($SPEED):"; cat "$SPEED"
  echo; echo "docmask summary ($SUM):"
  cat "$SUM"
fi
if [ "$WHAT" = ep ]; then
  # Expert parallelism over NCCL: EP = NP against EP = 1 on the same ranks and
  # data (so the losses compare), and against one GPU alone (throughput).
  CFG=${1:-configs/bench/mixtral-small.toml}
  NP=${NP:-2}; STEPS=${STEPS:-10}; WARMUP=${WARMUP:-3}
  ST=ddp,ddp:expert_parallel=$NP,zero3:expert_parallel=$NP
  : > "$OUT/tests.txt"
  .carry/bin/loom bench "$CFG" --steps="$STEPS" --warmup="$WARMUP" --json="$OUT/ep_single.json" > "$OUT/ep_single.log" 2>&1 || status=1
  tail -2 "$OUT/ep_single.log"
  mpi_on "$NP" .carry/bin/loom compare "$CFG" --strategies="$ST" --steps="$STEPS" --warmup="$WARMUP" \
    > "$OUT/ep_compare.out" 2> "$OUT/ep_compare.log" || { status=1; tail -20 "$OUT/ep_compare.log"; }
  mpi_on "$NP" .carry/bin/loom compare "$CFG" --strategies="$ST" --steps=10 --warmup=0 --set run.deterministic=true \
    > "$OUT/ep_compare_det.out" 2> "$OUT/ep_compare_det.log" || { status=1; tail -20 "$OUT/ep_compare_det.log"; }
  # The expert_parallel = 1 row (ddp, every expert on every rank, all-reducing every expert's
  # gradient) is the loss reference; the 85% per-GPU target is expert parallelism's.
  if LOOM_TARGET_DENSE=0.85 LOOM_TARGET_SHARDED=0.85 LOOM_TARGET_ONLY=expert_parallel python3 benchmarks/sharding_targets.py "$OUT/ep_single.json" \
       "$OUT/ep_compare.out" "$OUT/ep_compare_det.out" | tee "$OUT/ep_table.md"; then r=PASS; else r=FAIL; status=1; fi
  echo "$r expert parallelism np=$NP ($CFG)" | tee -a "$OUT/tests.txt"
fi
if [ "$WHAT" = node ]; then
  # Llama 3 8B at 8k context on a node (issue 31): Loom bf16 and FP8 beside the
  # PyTorch FSDP2 peer, on the same GPUs, in one call.
  NP=${NP:-4}
  N=$OUT/node; mkdir -p "$N"
  BF=configs/bench/llama3-8b-8k.toml; F8=configs/bench/llama3-8b-8k-fp8.toml
  # The card's memory as nvidia-smi reports it: the plans are made for it without touching it.
  TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')
  # The random init of 8B parameters runs on every rank's host threads: share the cores.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NP > 0 ? $(nproc) / NP : 1 ))}
  # One `loom bench` of the node shape on NP ranks, its row printed:
  #   node_bench TAG CONFIG "WHAT IT RUNS WITH" [mpirun -x VAR=VALUE...] -- [loom --set ...]
  # (logs and JSON in $N/bench_TAG.log and $N/loom_TAG.json).
  node_bench() {
    local tag=$1 cfg=$2 label=$3; shift 3
    local mpi=() t0
    while [ $# -gt 0 ] && [ "$1" != -- ]; do mpi+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    t0=$(date +%s)
    mpi_on "$NP" -x OMP_NUM_THREADS "${mpi[@]}" .carry/bin/loom bench "$cfg" "$@" --steps="${STEPS:-3}" --warmup="${WARMUP:-2}" \
      --json="$N/loom_$tag.json" > "$N/bench_$tag.log" 2>&1 || { status=1; tail -20 "$N/bench_$tag.log"; }
    echo "loom bench $label: $(( $(date +%s) - t0 )) s"
    grep -E "^config|llama3-8b" "$N/bench_$tag.log" | grep -v BENCH_JSON
  }
  for name in bf16 fp8; do
    cfg=$BF; [ $name = fp8 ] && cfg=$F8
    .carry/bin/loom check "$cfg" --world-size "$NP" --device-memory "${TOTAL_MIB}MiB" --breakdown \
      > "$N/check_$name.txt" 2>&1 || { status=1; tail -5 "$N/check_$name.txt"; }
    grep -E "per rank in all|beyond the arena" "$N/check_$name.txt"
    node_bench "$name" "$cfg" "$name"
  done
  if [ -n "${NODE_FP8_SET:-}" ]; then
    # The FP8 workload again with switches (space-separated KEY=VALUE items),
    # beside the rows above: e.g. "precision.fp8_head=true".
    set_args "$NODE_FP8_SET"
    node_bench fp8_set "$F8" "fp8 with $NODE_FP8_SET" -- "${SETS[@]}"
  fi
  if [ -n "${NODE_ENV:-}" ]; then
    # Both workloads again under NCCL settings (space-separated VAR=VALUE items
    # exported to every rank), beside the rows above: e.g. "NCCL_CTA_POLICY=1"
    # (NCCL's efficiency policy: fewer CTAs for each collective, so the gathers
    # take fewer SMs from the GEMMs beside them) or "NCCL_MAX_CTAS=8".
    envx=(); for kv in $NODE_ENV; do envx+=(-x "$kv"); done
    node_bench bf16_env "$BF" "bf16 with $NODE_ENV" "${envx[@]}"
    node_bench fp8_env "$F8" "fp8 with $NODE_ENV" "${envx[@]}"
  fi
  : > "$N/peers.jsonl"
  for name in bf16 fp8; do
    extra=(); [ $name = fp8 ] && extra=(--float8)
    # torchtitan's per-op selective AC first; a peer that runs out of memory
    # with it runs again with whole layers checkpointed (the row says which).
    for ac in ${PEER_AC:-selective-op} full; do
      t0=$(date +%s)
      python3 -m torch.distributed.run --standalone --nproc_per_node="$NP" benchmarks/torch_fsdp.py "$BF" --compile \
        --ac "$ac" "${extra[@]}" --steps "${PEER_STEPS:-2}" --warmup "${PEER_WARMUP:-1}" \
        > "$N/peer_${name}_$ac.out" 2> "$N/peer_${name}_$ac.log" ||
        { echo "peer $name (AC $ac) failed: see $N/peer_${name}_$ac.log"; tail -3 "$N/peer_${name}_$ac.log"; }
      echo "peer $name (AC $ac): $(( $(date +%s) - t0 )) s"
      grep -q '"error": ".*OutOfMemory' "$N/peer_${name}_$ac.out" && [ "$ac" != full ] && continue
      grep -h '^PEER_JSON' "$N/peer_${name}_$ac.out" >> "$N/peers.jsonl"
      break
    done
  done
  python3 benchmarks/node_table.py "$N/loom_bf16.json" "$N/loom_fp8.json" "$N/peers.jsonl" \
    "$N/check_bf16.txt" "$N/check_fp8.txt" | tee "$N/table.md" || status=1
fi
if [ "$WHAT" = node-trace ]; then
  # Where the node step's time goes (docs/PERFORMANCE.md, "Where the step's time goes").
  NP=${NP:-4}
  N=$OUT/node-trace; mkdir -p "$N"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NP > 0 ? $(nproc) / NP : 1 ))}
  set_args "${NODE_SET:-}"
  for name in bf16 fp8; do
    cfg=configs/bench/llama3-8b-8k.toml; [ $name = fp8 ] && cfg=configs/bench/llama3-8b-8k-fp8.toml
    t0=$(date +%s)
    mpi_on "$NP" -x OMP_NUM_THREADS .carry/bin/loom train "$cfg" --set train.steps=3 --set 'profile.steps=[3,3]' \
      --set profile.trace=true --set run.out_dir="\"$N/run_$name\"" --set run.overwrite=true "${SETS[@]}" \
      > "$N/train_$name.log" 2>&1 || { status=1; tail -5 "$N/train_$name.log"; }
    echo "loom train $name (trace of step 3): $(( $(date +%s) - t0 )) s"
    if python3 benchmarks/trace_gaps.py "$N/run_$name/trace/rank_0.json" > "$N/gaps_$name.md"; then
      grep -E "^/|^(forward|backward):|^compute stream" "$N/gaps_$name.md"
    else
      status=1; tail -3 "$N/gaps_$name.md"
    fi
    rm -f "$N"/run_$name/trace/rank_[1-9]*.json  # rank 0's is the one analysed; keep $OUT small
  done
fi
if [ "$WHAT" = node-loss ]; then
  # FP8 against bf16 at the node shape, one micro-batch a step, on real text:
  # the same initial weights (same seed) and data order; the FP8 loss within 1%
  # of bf16's at every step after 50.
  NP=${NP:-4}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NP > 0 ? $(nproc) / NP : 1 ))}
  # The corpus: fortunes, the King James Bible and the Jargon File, 8.3M byte
  # tokens (prepared here from the texts scripts/gpu_build.sh stages), so
  # that 150 steps of 4 x 8,192 tokens read it once. LOSS_DET=1 (the default) runs deterministic kernels:
  # two bf16 runs are then bitwise equal, and what parts FP8 from bf16 is FP8.
  LOSS_DATA=${LOSS_DATA:-data/node-corpus}
  if [ "$LOSS_DATA" = data/node-corpus ] && [ ! -f data/node-corpus/val.bin ] && [ -f .carry/node-text/kjv.txt.gz ]; then
    T=$(mktemp -d); for f in .carry/node-text/*.gz; do gzip -dc "$f" > "$T/$(basename "$f" .gz)"; done
    .carry/bin/loom prepare text data/node-corpus .carry/fortunes-raw "$T"/*.txt > "$OUT/node-corpus.txt" 2>&1 ||
      { tail -3 "$OUT/node-corpus.txt"; exit 1; }
    rm -rf "$T"; grep -E "tokens:" "$OUT/node-corpus.txt"
  fi
  [ -f "$LOSS_DATA/val.bin" ] || { echo "node-loss: $LOSS_DATA is missing (prepared here from .carry/node-text, which scripts/gpu_build.sh stages)"; exit 1; }
  L=(--set data.plugin='"tokens"' --set data.train="\"$ROOT/$LOSS_DATA/train_*.bin\"" --set train.grad_accum=1
     --set train.warmup_steps="${LOSS_WARMUP:-15}" --set train.validation_every=0 --set run.overwrite=true)
  # lr 1e-4, not the configs' 3e-4: at 3e-4 this shape spikes on single steps
  # (two bf16 runs whose reductions merely add in another order part by 14% at
  # a step on one GPU), and the test would read those spikes, not FP8.
  L+=(--set train.lr="${LOSS_LR:-1e-4}")
  # LOSS_DET=1 (the default): the bf16 and FP8 runs use deterministic kernels,
  # written into copies of their configs (so that the floor run below can go
  # without them).
  DET=()
  [ "${LOSS_DET:-1}" = 1 ] && DET=(-e '/^\[run\]/a deterministic = true')
  base=$(renamed configs/bench/llama3-8b-8k.toml llama3-8b-8k "$OUT/node-loss-configs" "${DET[@]}")
  # LOSS_RECIPE: another FP8 recipe in the twin's place (fp8_block: block
  # scales, whose loss sat on bf16's on one GPU where fp8_current's ran 0.6%
  # above; docs/PERFORMANCE.md). Its weights then gather in bf16: only
  # fp8_current supplies FP8 gathers.
  if [ -n "${LOSS_RECIPE:-}" ] && [ "$LOSS_RECIPE" != fp8_current ]; then
    runs=$(renamed configs/bench/llama3-8b-8k-fp8.toml "llama3-8b-8k-$LOSS_RECIPE" "$OUT/node-loss-configs" \
           -e "s/^plugin = \"fp8_current\"/plugin = \"$LOSS_RECIPE\"/" -e '/^gather_dtype/d' "${DET[@]}")
  else
    runs=$(renamed configs/bench/llama3-8b-8k-fp8.toml llama3-8b-8k-fp8 "$OUT/node-loss-configs" "${DET[@]}")
  fi
  # LOSS_FLOOR=1 runs bf16 a second time without deterministic kernels
  # (cuBLASLt algorithms picked by timing, cuDNN's backward adding in another
  # order): how far two bf16 runs part is the noise floor the FP8 difference
  # is read against. On one GPU at lr 1e-4 that floor's worst step after 50
  # was 2.9%, FP8's 2.1% (docs/PERFORMANCE.md). About 2.5 more minutes on 4 GPUs.
  if [ "${LOSS_FLOOR:-0}" = 1 ]; then
    runs=$runs,$(renamed configs/bench/llama3-8b-8k.toml llama3-8b-8k-again "$OUT/node-loss-configs")
  fi
  t0=$(date +%s)
  if [ "${LOSS_START:-0}" -gt 0 ]; then
    # A common trained start: bf16 alone for LOSS_START steps (same corpus and
    # settings), its weights exported as a Hugging Face folder, which both runs
    # then load (model.init = "hf:..."), with fresh optimizer state, a new warm-up
    # and another data order (run.seed). From random weights the first steps
    # are chaotic: two bf16 runs whose reductions merely add in another order
    # part by more than 1% (LOSS_FLOOR=1 shows it). The checkpoint
    # and the folder stay outside $OUT (tens of GB): LOSS_WORK, default /tmp/loom-node-loss.
    W=${LOSS_WORK:-/tmp/loom-node-loss}; rm -rf "$W"; mkdir -p "$W"
    mpi_on "$NP" -x OMP_NUM_THREADS .carry/bin/loom train "$base" "${L[@]}" \
      --set train.steps="$LOSS_START" --set checkpoint.every="$LOSS_START" --set run.out_dir="\"$W/start\"" \
      > "$OUT/node-loss-start.log" 2>&1 || { status=1; tail -20 "$OUT/node-loss-start.log"; }
    .carry/bin/loom convert "$W/start/checkpoints/$(printf 'step_%08d' "$LOSS_START")" --to-hf "$W/hf" --dtype bf16 \
      >> "$OUT/node-loss-start.log" 2>&1 || { status=1; tail -5 "$OUT/node-loss-start.log"; }
    grep -E "loss" "$OUT/node-loss-start.log" | grep -v "^COMPARE" | tail -2
    echo "start: $LOSS_START bf16 steps and the export, $(( $(date +%s) - t0 )) s"
    L+=(--set model.init="\"hf:$W/hf\"" --set run.seed=7)
  fi
  mpi_on "$NP" -x OMP_NUM_THREADS .carry/bin/loom compare "$base" \
    --configs="$runs" "${L[@]}" --steps="${LOSS_STEPS:-150}" --warmup=0 \
    --out="$OUT/node-loss" > "$OUT/node-loss.out" 2> "$OUT/node-loss.log" || { status=1; tail -20 "$OUT/node-loss.log"; }
  echo "loom compare: $(( $(date +%s) - t0 )) s"
  grep -v '^COMPARE_JSON' "$OUT/node-loss.out"
  python3 - "$OUT/node-loss.out" <<'PY' || status=1
import json, sys
rows = [json.loads(l[len("COMPARE_JSON "):]) for l in open(sys.argv[1]) if l.startswith("COMPARE_JSON ")]
if len(rows) < 2 or not rows[0]["losses"] or not rows[1]["losses"]:
    sys.exit(f"node-loss: expected the bf16 and FP8 rows with losses, got {[r.get('label') for r in rows]}")
ref, fp8 = rows[0]["losses"], rows[1]["losses"]
n = min(len(ref), len(fp8))
def after_50(other):
    """(step, signed relative difference from bf16) for every step after 50 both runs have."""
    return [(s + 1, (other[s] - ref[s]) / abs(ref[s])) for s in range(50, min(len(ref), len(other)))]
def worst(late):
    return max(late, key=lambda x: abs(x[1])) if late else (0, float("nan"))
def at_steps(label, other):
    for s in (10, 25, 50, 75, 100, 125, 150):
        if s <= min(len(ref), len(other)):
            print(f"  step {s:3d}: bf16 {ref[s - 1]:.4f}  {label} {other[s - 1]:.4f}  "
                  f"({100 * (other[s - 1] - ref[s - 1]) / ref[s - 1]:+.2f}%)")
print(f"node-loss: {rows[1]['label']} against {rows[0]['label']}, {n} steps; loss at steps 1, 50, {n}: "
      f"{ref[0]:.4f}/{fp8[0]:.4f}, {ref[min(49, n - 1)]:.4f}/{fp8[min(49, n - 1)]:.4f}, {ref[-1]:.4f}/{fp8[-1]:.4f}")
at_steps("fp8", fp8)
late = after_50(fp8)
w = worst(late)
ok = bool(late) and abs(w[1]) <= 0.01
if late:
    print(f"after step 50: mean |difference| {100 * sum(abs(d) for _, d in late) / len(late):.3f}%, signed mean "
          f"{100 * sum(d for _, d in late) / len(late):+.3f}% (FP8 minus bf16)")
print(f"worst relative difference after step 50: {100 * abs(w[1]):.3f}% at step {w[0]} "
      f"({'within' if ok else 'OUTSIDE'} 1%)")
if len(rows) > 2 and rows[2]["losses"]:
    again = rows[2]["losses"]
    fw = worst(after_50(again))
    at_steps("bf16 again", again)
    print(f"noise floor (bf16 against bf16 again): worst after step 50 {100 * abs(fw[1]):.3f}% at step {fw[0]}"
          + (" -- above 1%: this workload cannot judge FP8 at 1%" if abs(fw[1]) > 0.01 else ""))
sys.exit(0 if ok else 1)
PY
fi
if [ "$WHAT" = sharding ]; then
  # One GPU alone: the baseline the per-GPU throughput targets refer to.
  .carry/bin/loom bench "$CFG" --steps="$STEPS" --warmup="$WARMUP" --json="$OUT/single.json" > "$OUT/single.log" 2>&1 || status=1
  tail -2 "$OUT/single.log"
  # The PyTorch FSDP2 peer on the same GPUs, model, batch and sequence.
  python3 -m torch.distributed.run --standalone --nproc_per_node="$NP" benchmarks/torch_fsdp.py "$CFG" --steps "$STEPS" --warmup "$WARMUP" \
    > "$OUT/fsdp.out" 2> "$OUT/fsdp.log" || echo "torch_fsdp failed: see fsdp.log" >&2
  grep -h '^PEER_JSON' "$OUT/fsdp.out" > "$OUT/peer.jsonl" || true
  tail -3 "$OUT/fsdp.log"
  if [ $GROUPS2 = 1 ]; then
    # PyTorch HSDP in the same groups of 2 as hybrid_shard.
    python3 -m torch.distributed.run --standalone --nproc_per_node="$NP" benchmarks/torch_fsdp.py "$CFG" --mode hsdp \
      --shard-group-size 2 --steps "$STEPS" --warmup "$WARMUP" > "$OUT/hsdp.out" 2> "$OUT/hsdp.log" ||
      echo "torch_fsdp --mode hsdp failed: see hsdp.log" >&2
    grep -h '^PEER_JSON' "$OUT/hsdp.out" >> "$OUT/peer.jsonl" || true
    tail -3 "$OUT/hsdp.log"
  fi
  # Every strategy, same steps and seed, in one launch; the peer rows joined in.
  "${MPI[@]}" .carry/bin/loom compare "$CFG" --strategies="$STRATEGIES" --steps="$STEPS" --warmup="$WARMUP" \
    --out="$OUT/compare" --peer="$OUT/peer.jsonl" > "$OUT/compare.out" 2> "$OUT/compare.log" || status=1
  grep -v '^COMPARE_JSON' "$OUT/compare.out"
  grep -E "error|Error" "$OUT/compare.log" | head -10
  # Loss equality across strategies: the first 10 steps again, deterministic
  # (cuDNN's deterministic backward) and with a learning-rate warmup as real
  # runs have (AdamW's first steps are sign-like, so without one a last-bit
  # difference flips whole updates); ddp runs twice, the repeat showing the
  # noise floor of one strategy against itself.
  "${MPI[@]}" .carry/bin/loom compare "$CFG" --strategies="$STRATEGIES,ddp" --steps=10 --warmup=0 \
    --set run.deterministic=true --set train.warmup_steps="${LOSS_WARMUP:-10}" --out="$OUT/compare_det" \
    > "$OUT/compare_det.out" 2> "$OUT/compare_det.log" || status=1
  grep -v '^COMPARE_JSON' "$OUT/compare_det.out"
  python3 benchmarks/sharding_targets.py "$OUT/single.json" "$OUT/compare.out" "$OUT/compare_det.out" \
    | tee "$OUT/targets.md" || status=1
fi
if [ "$WHAT" = sharding ] || [ "$WHAT" = sharding-7b ]; then
  NP=${NP:-$(nvidia-smi -L | wc -l)}
  if [ "$NP" -ge 4 ] && [ $((NP % 2)) = 0 ]; then
    # llama2-7b sharded over the GPUs: the memory plan ("planned mem") against the
    # device memory in use ("peak mem") per GPU, zero3 and hybrid_shard in groups of 2.
    mpi_on "$NP" .carry/bin/loom compare configs/bench/llama2-7b.toml --strategies=zero3,hybrid_shard:shard_group_size=2 \
      --steps="${STEPS_7B:-5}" --warmup="${WARMUP_7B:-2}" --out="$OUT/compare_7b" > "$OUT/compare_7b.out" 2> "$OUT/compare_7b.log" || status=1
    grep -v '^COMPARE_JSON' "$OUT/compare_7b.out"
    grep -E "error|Error" "$OUT/compare_7b.log" | head -10
  else
    echo "sharding-7b: needs 4 or more GPUs, an even count (hybrid_shard in groups of 2); NP=$NP" >&2; status=1
  fi
fi
exit $status
