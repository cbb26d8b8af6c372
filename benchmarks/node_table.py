#!/usr/bin/env python3
"""The table of `scripts/gpu_check.sh node`: Loom's llama3-8b-8k runs (bf16 and
FP8, `loom bench --json` under mpirun) beside the PyTorch FSDP2 peer's
(benchmarks/torch_fsdp.py PEER_JSON lines, bf16 and torchao float8), then the
issue's targets, each marked met or missed.

  python3 benchmarks/node_table.py LOOM_BF16.json LOOM_FP8.json PEERS.jsonl [CHECK_BF16.txt CHECK_FP8.txt]

Columns: tokens/s per GPU first; model TFLOP/s per GPU as NeMo counts them
(causal attention, 6N + 6LhS a token); MFU (docs/ARCHITECTURE.md "MFU", 6N + 12LhS over 989
TFLOP/s); peak GiB (Loom: the device memory in use after the steps on the
fullest rank, CUDA context, libraries and NCCL included; the peer:
torch.cuda.max_memory_reserved, context not included); planned GiB (Loom's
plan with what lies beyond the arena, the "per rank in all" that `loom check`
prints, and the ratio of the measured to it); and Loom's tokens/s as a
multiple of the peer's of the same precision. The optional `loom check`
outputs (planned for the card without touching it: --device-memory) give
"per rank in all" as planned without the GPU; the table prints its
difference from the run's own plan (cuDNN's workspace, estimated without the
GPU) and the measured memory against it.

Exit status 0 whatever the targets say (they are reported, not enforced: the
numbers are for docs/PERFORMANCE.md); 1 when an input is missing or a run
failed.
"""
import json
import re
import sys

TARGETS = {"bf16": 11000.0, "fp8": 15500.0}  # tokens/s per GPU (issue 31, H100 80 GB)
MEMORY_TARGET_GIB = 76.0
PEER_RATIO = 1.4
PLAN_TOLERANCE = 0.03


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"node_table: {path}: {e}")
        return None


def load_peers(path):
    rows = []
    try:
        for line in open(path):
            line = line.strip()
            if line.startswith("PEER_JSON "):
                line = line[len("PEER_JSON "):]
            if line:
                rows.append(json.loads(line))
    except (OSError, ValueError) as e:
        print(f"node_table: {path}: {e}")
    return rows


def check_in_all(path):
    """The 'per rank in all: X GiB' figure a `loom check` output prints, and whether it said it fits."""
    try:
        text = open(path).read()
    except OSError:
        return None, None
    m = re.search(r"per rank in all: ([0-9.]+) (GiB|MiB)", text)
    if not m:
        return None, None
    v = float(m.group(1)) / (1024.0 if m.group(2) == "MiB" else 1.0)
    return v, ("fits" in text[m.start():].split("\n")[0])


def main(argv):
    if len(argv) < 4:
        print(__doc__)
        return 1
    loom = {"bf16": load_json(argv[1]), "fp8": load_json(argv[2])}
    peers = load_peers(argv[3])
    checks = {}
    for key, path in zip(("bf16", "fp8"), argv[4:6]):
        checks[key] = check_in_all(path)
    peer = {"bf16": next((p for p in peers if not p.get("float8")), None),
            "fp8": next((p for p in peers if p.get("float8")), None)}
    bad = False
    print("| system | precision | tokens/s per GPU | model TFLOP/s | MFU | peak GiB | planned GiB (measured / planned) "
          "| vs peer |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key in ("bf16", "fp8"):
        r, p = loom[key], peer[key]
        if r is None:
            print(f"| Loom | {key} | failed (no result) | | | | | |")
            bad = True
        else:
            ratio = f"{r['tokens_per_s_per_gpu'] / p['tokens_per_s_per_gpu']:.2f}x" \
                if p and "error" not in p else ""
            print(f"| Loom, {r['ranks']} ranks ({r['device']}) | {r['precision']}, recompute {r['recompute']} | "
                  f"{r['tokens_per_s_per_gpu']:,.0f} | {r['model_tflops']:.0f} | {100 * r['mfu']:.1f}% | "
                  f"{r['device_mem_gib']:.1f} | {r['planned_gib']:.1f} ({r['mem_over_plan']:.3f}) | {ratio} |")
        if p is None:
            print(f"| PyTorch FSDP2 peer | {key} | failed (no result) | | | | | |")
            bad = True
        elif "error" in p:
            print(f"| PyTorch FSDP2 peer | {p.get('mode')} | failed: {p['error'][:80]} | | | | | |")
            bad = True
        else:
            print(f"| PyTorch FSDP2 peer, {p['world']} ranks | {p['mode']} (AC {p['activation_checkpointing']}) | "
                  f"{p['tokens_per_s_per_gpu']:,.0f} | {p['model_tflops']:.0f} | {100 * p['mfu']:.1f}% | "
                  f"{p['peak_reserved_gib']:.1f} (reserved) | | |")
    print()
    for key in ("bf16", "fp8"):
        r, p = loom[key], peer[key]
        if r is None:
            continue
        tps = r["tokens_per_s_per_gpu"]
        lines = [f"{key}: {tps:,.0f} tokens/s per GPU "
                 f"({'met' if tps >= TARGETS[key] else 'MISSED'}: >= {TARGETS[key]:,.0f})",
                 f"peak {r['device_mem_gib']:.1f} GiB ({'met' if r['device_mem_gib'] <= MEMORY_TARGET_GIB else 'MISSED'}: "
                 f"<= {MEMORY_TARGET_GIB:.0f} GiB)",
                 f"plan {r['planned_gib']:.2f} GiB, measured {100 * (r['mem_over_plan'] - 1):+.1f}% "
                 f"({'met' if abs(r['mem_over_plan'] - 1) <= PLAN_TOLERANCE else 'MISSED'}: within 3%)"]
        if p and "error" not in p:
            x = tps / p["tokens_per_s_per_gpu"]
            lines.append(f"{x:.2f}x the peer ({'met' if x >= PEER_RATIO else 'MISSED'}: >= {PEER_RATIO}x)")
        v, fits = checks.get(key, (None, None))
        if v is not None:
            # The plan made without the GPU differs from the run's own only by
            # cuDNN's workspace, estimated there (an upper bound) and asked of
            # cuDNN here.
            lines.append(f"loom check without the GPU planned {v:.2f} GiB per rank in all"
                         f"{', fits' if fits else ', does not fit'} ({1024 * (v - r['planned_gib']):+.0f} MiB "
                         f"against the run's own plan; measured {100 * (r['device_mem_gib'] / v - 1):+.1f}% of it)")
        print("- " + "; ".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
