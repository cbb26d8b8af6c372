#!/usr/bin/env bash
# Loom's bench and the PyTorch peer, side by side on the same GPU, in one go.
# Builds nothing: run it from the repository root after building (LOOM_BIN
# points at the loom binary; default build/bin/loom).
#
#   benchmarks/compare.sh [CONFIG...]        (default: configs/bench/*.toml)
#
# Env: STEPS (20), WARMUP (5), LAYERS (Loom's layer variants, default
# "native fused": one row each), BREAKDOWN=1 (adds --breakdown to every Loom
# row), MODES (peer modes, default all four; the 7B workload runs MODES_7B,
# default "pure,pure+compile": the autocast modes' fp32 state does not fit 80
# GB; MoE configs run MODES_MOE, default "pure,pure+compile", beside
# benchmarks/hf_mixtral.py; FP8 configs (precision.plugin fp8_*) run MODES_FP8, default
# "pure+compile,float8+compile": HF bf16 and torchao float8 tensorwise, both compiled), PEERS=0 (Loom's rows only), OUT (a folder for the raw JSON lines;
# default a temp dir).
set -uo pipefail
LOOM_BIN=${LOOM_BIN:-build/bin/loom}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(configs/bench/llama-125m.toml configs/bench/llama-1b.toml configs/bench/llama2-7b.toml)
: > "$OUT/results.jsonl"
LAYERS=${LAYERS:-native fused}
extra=()
[ "${BREAKDOWN:-0}" = 1 ] && extra+=(--breakdown)
for cfg in "${configs[@]}"; do
  name=$(basename "$cfg" .toml)
  for layers in $LAYERS; do
    echo "== $name: loom bench ($layers layers)" >&2
    "$LOOM_BIN" bench "$cfg" --steps="$STEPS" --warmup="$WARMUP" --set model.layers="\"$layers\"" "${extra[@]}" \
      2>"$OUT/$name.$layers.loom.log" | tee -a "$OUT/$name.$layers.loom.out" |
      sed -n 's/^BENCH_JSON //p' | python3 -c "import sys,json; [print(json.dumps(dict(json.loads(l), name='$name', who='loom'))) for l in sys.stdin]" >> "$OUT/results.jsonl" ||
      echo "loom bench failed for $cfg ($layers): see $OUT/$name.$layers.loom.log" >&2
  done
  [ "${PEERS:-1}" = 0 ] && continue
  modes=${MODES:-pure,autocast,pure+compile,autocast+compile}
  case "$name" in *7b*) modes=${MODES_7B:-pure,pure+compile} ;; esac
  # Mixture-of-experts configs (model.ffn = "moe") run beside MixtralForCausalLM (pure bf16 modes: the
  # autocast modes' fp32 state is not what Loom's bf16_pure bench runs), the others beside LlamaForCausalLM.
  peer=benchmarks/hf_llama.py
  if python3 -c "import sys,tomllib; sys.exit(0 if tomllib.load(open(sys.argv[1],'rb'))['precision']['plugin'].startswith('fp8') else 1)" "$cfg"; then
    modes=${MODES_FP8:-pure+compile,float8+compile}
  fi
  if python3 -c "import sys,tomllib; sys.exit(0 if tomllib.load(open(sys.argv[1],'rb'))['model'].get('ffn','dense')=='moe' else 1)" "$cfg"; then
    peer=benchmarks/hf_mixtral.py
    modes=${MODES_MOE:-pure,pure+compile}
  fi
  echo "== $name: PyTorch peer $peer ($modes)" >&2
  python3 "$peer" "$cfg" --modes "$modes" --steps "$STEPS" --warmup "$WARMUP" 2>"$OUT/$name.peer.log" |
    sed -n 's/^PEER_JSON //p' | python3 -c "import sys,json; [print(json.dumps(dict(json.loads(l), name='$name', who='peer'))) for l in sys.stdin]" >> "$OUT/results.jsonl" ||
    echo "peer failed for $cfg: see $OUT/$name.peer.log" >&2
done
python3 benchmarks/table.py "$OUT/results.jsonl"
