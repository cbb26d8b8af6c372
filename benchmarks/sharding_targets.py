#!/usr/bin/env python3
"""Checks a `loom compare` run of the sharding strategies against the targets
of the multi-GPU benchmark (docs/PERFORMANCE.md):

  - losses of the first 10 steps equal across strategies within bf16
    tolerance: max relative difference to the first row <= 2e-3 at every step,
    taken from a deterministic run (run.deterministic = true, so that the
    strategy is the only difference) when one is given, else from the timed run;
  - tokens/s per GPU >= 95% of one GPU alone (`loom bench --json`) for ddp,
    zero1 and zero2, >= 90% for zero3 / full_shard / hybrid_shard (a row
    labelled "hybrid_shard:shard_group_size=2" counts as hybrid_shard);
  - every strategy >= 1.4x the tokens/s per GPU of the best PyTorch peer row
    (labels starting with "torch": FSDP2, HSDP).
The three thresholds can be set with LOOM_TARGET_DENSE, LOOM_TARGET_SHARDED
and LOOM_TARGET_VS_PEER (fractions and a ratio). LOOM_TARGET_ONLY=TEXT holds
only the rows whose label contains TEXT to the throughput targets (the others,
e.g. the expert_parallel = 1 reference of an expert-parallel run, are judged on
their losses alone).

Usage: sharding_targets.py SINGLE_BENCH.json COMPARE_OUTPUT [DETERMINISTIC_COMPARE_OUTPUT]
Prints a markdown table and exits 1 when a target is missed.
"""
import json
import os
import sys

DENSE = float(os.environ.get("LOOM_TARGET_DENSE", "0.95"))
SHARDED = float(os.environ.get("LOOM_TARGET_SHARDED", "0.90"))
VS_PEER = float(os.environ.get("LOOM_TARGET_VS_PEER", "1.4"))
ONLY = os.environ.get("LOOM_TARGET_ONLY", "")


def read_rows(path):
    return [json.loads(l[len("COMPARE_JSON "):]) for l in open(path) if l.startswith("COMPARE_JSON ")]


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    single = json.load(open(sys.argv[1]))
    base = single["tokens_per_s"]
    rows = read_rows(sys.argv[2])
    det_rows = read_rows(sys.argv[3]) if len(sys.argv) == 4 else []
    det = {}
    for r in det_rows:  # a repeated label (ddp run twice) is the noise floor: the first row stays the reference
        det.setdefault(r["label"], r)
    repeats = [r for r in det_rows[1:] if r["label"] == det_rows[0]["label"]]
    if not rows:
        sys.exit("no COMPARE_JSON rows in " + sys.argv[2])
    peers = [r for r in rows if r["label"].startswith("torch")]
    peer = max((r["tokens_per_s_per_gpu"] for r in peers), default=None)
    ok = True
    print(f"one GPU alone: {base:,.0f} tokens/s ({single['median_step_ms']:.1f} ms/step)")
    if peer:
        print(f"best PyTorch peer: {peer:,.0f} tokens/s per GPU")
    print()
    if det:
        print("loss differences from the deterministic run of the first 10 steps")
        for r in repeats:
            print(f"noise floor: {r['label']} run again differs from itself by {r['max_rel_loss_diff']:.1e} (max rel)")
    print("| run | tokens/s per GPU | vs one GPU | target | vs FSDP2 | max rel loss diff | verdict |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        label, tps = r["label"], r["tokens_per_s_per_gpu"]
        if label.startswith("torch"):
            print(f"| {label} | {tps:,.0f} | {tps / base:.1%} | - | 1.00x | - | peer |")
            continue
        target = SHARDED if label.split(":")[0] in ("zero3", "full_shard", "hybrid_shard") else DENSE
        judged = ONLY in label
        rel = (det.get(label) or r).get("max_rel_loss_diff")
        checks = [not judged or tps >= target * base, rel is not None and rel <= 2e-3]
        vs_peer = "-"
        if peer and judged:
            vs_peer = f"{tps / peer:.2f}x"
            checks.append(tps >= VS_PEER * peer)
        verdict = "ok" if all(checks) else "MISSED"
        ok = ok and all(checks)
        rel_s = "-" if rel is None else f"{rel:.1e}"
        target_s = f"{target:.0%}" if judged else "-"
        print(f"| {label} | {tps:,.0f} | {tps / base:.1%} | {target_s} | {vs_peer} | {rel_s} | {verdict} |")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
