#!/usr/bin/env bash
# Loom's bench and the PyTorch peer, side by side on the same GPU, in one go.
# Builds nothing: run it from the repository root after building (LOOM_BIN
# points at the loom binary; default build/bin/loom).
#
#   benchmarks/compare.sh [CONFIG...]        (default: configs/bench/*.toml)
#
# Env: STEPS (20), WARMUP (5), MODES (peer modes, default all four; the 7B
# workload runs only "pure" as in the table), OUT (a folder for the
# raw JSON lines; default a temp dir).
set -uo pipefail
LOOM_BIN=${LOOM_BIN:-build/bin/loom}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(configs/bench/llama-125m.toml configs/bench/llama-1b.toml configs/bench/llama2-7b.toml)
: > "$OUT/results.jsonl"
for cfg in "${configs[@]}"; do
  name=$(basename "$cfg" .toml)
  echo "== $name: loom bench" >&2
  "$LOOM_BIN" bench "$cfg" --steps="$STEPS" --warmup="$WARMUP" 2>"$OUT/$name.loom.log" | tee -a "$OUT/$name.loom.out" |
    sed -n 's/^BENCH_JSON //p' | python3 -c "import sys,json; [print(json.dumps(dict(json.loads(l), name='$name', who='loom'))) for l in sys.stdin]" >> "$OUT/results.jsonl" ||
    echo "loom bench failed for $cfg: see $OUT/$name.loom.log" >&2
  modes=${MODES:-pure,autocast,pure+compile,autocast+compile}
  case "$name" in *7b*) modes=${MODES_7B:-pure} ;; esac
  echo "== $name: PyTorch peer ($modes)" >&2
  python3 benchmarks/hf_llama.py "$cfg" --modes "$modes" --steps "$STEPS" --warmup "$WARMUP" 2>"$OUT/$name.peer.log" |
    sed -n 's/^PEER_JSON //p' | python3 -c "import sys,json; [print(json.dumps(dict(json.loads(l), name='$name', who='peer'))) for l in sys.stdin]" >> "$OUT/results.jsonl" ||
    echo "peer failed for $cfg: see $OUT/$name.peer.log" >&2
done
python3 benchmarks/table.py "$OUT/results.jsonl"
