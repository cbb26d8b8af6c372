#!/usr/bin/env python3
"""Where a step's time goes on the compute stream, from one rank's trace of a
`[profile]` window (`profile.trace = true`, docs/CONFIG.md): per decoder
layer, the median device time of each op in the forward and the backward,
then the compute stream's idle time — between two layers, inside a layer,
and at the other joints (micro-batch boundaries, the head, the optimizer) —
and the time each collective kind spent on the comm stream.

  mpirun -np 4 loom train configs/bench/llama3-8b-8k-fp8.toml --set train.steps=3 \\
      --set 'profile.steps=[3,3]' --set profile.trace=true --set run.out_dir='"runs/trace"'
  python3 benchmarks/trace_gaps.py runs/trace/trace/rank_0.json

Idle time on the compute stream is work outside the units' ranges (the
sharding strategy's hooks, each traced as a `sharding.*` range: an FP8
decode, a gradient buffer's padding cleared, a wait for a gather or a
reduce-scatter that was not done in time) or a wait the trace does not name.
Either way it is time the step spends outside the layers' own ops; a second
table splits each joint's gaps by hook. Work queued on the optimizer stream
(the gradient adds into the zero2/zero3 shards, AdamW under "none") runs
beside the compute stream and is listed on its own. Times are device times
from CUDA events; a window of several steps is summed over them.
"""
import bisect
import json
import re
import statistics as st
import sys
from collections import defaultdict

LAYER = re.compile(r"(forward|backward)\.layer\.(\d+)$")
# The top-level ranges of a step on the compute stream (everything else nests in them).
TOP = re.compile(r"(forward|backward)\.layer\.\d+$|head\.chunk$|forward\.(embedding|head)$|backward\.embedding$|"
                 r"adamw$|grad_norm$|clip$")


def top_level(ranges):
    out, end = [], -1.0
    for e in sorted(ranges, key=lambda e: (e["ts"], -e["dur"])):
        if out and e["ts"] + e["dur"] <= end:
            continue
        out.append(e)
        end = e["ts"] + e["dur"]
    return out


def children(ranges, parent):
    lo, hi = parent["ts"], parent["ts"] + parent["dur"]
    inner = [e for e in ranges if e is not parent and e["ts"] >= lo and e["ts"] + e["dur"] <= hi]
    return top_level(inner)


def main(path):
    events = json.load(open(path))["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    tid = {v: k for k, v in names.items()}
    ranges = [e for e in events if e.get("ph") == "X"]
    compute = [e for e in ranges if e["tid"] == tid.get("compute stream")]
    comm = [e for e in ranges if e["tid"] == tid.get("comm stream (NCCL)")]
    if not compute:
        sys.exit(f"{path}: no compute-stream ranges (was the trace written with profile.trace = true?)")
    steps = [e for e in compute if e["name"] == "step"]
    span = sum(e["dur"] for e in steps) if steps else max(e["ts"] + e["dur"] for e in compute) - min(e["ts"] for e in compute)
    print(f"{path}: {len(steps)} step(s), {span / 1e3:.1f} ms on the compute stream")

    layers = [e for e in compute if LAYER.match(e["name"])]
    for kind in ("forward", "backward"):
        mine = [e for e in layers if e["name"].startswith(kind)]
        if not mine:
            continue
        ops, inner_idle = defaultdict(list), []
        for e in mine:
            kids = children(compute, e)
            for k in kids:
                ops[k["name"]].append(k["dur"])
            inner_idle.append(e["dur"] - sum(k["dur"] for k in kids))
        durs = [e["dur"] for e in mine]
        print(f"\n{kind}: {len(mine)} layer calls, median {st.median(durs) / 1e3:.3f} ms a layer, "
              f"{sum(durs) / 1e3:.1f} ms in all; idle inside a layer: median {st.median(inner_idle) / 1e3:.3f} ms")
        print("| op | calls | median ms | total ms |")
        print("| --- | ---: | ---: | ---: |")
        for name, d in sorted(ops.items(), key=lambda kv: -sum(kv[1])):
            print(f"| {name} | {len(d)} | {st.median(d) / 1e3:.3f} | {sum(d) / 1e3:.1f} |")

    top = top_level([e for e in compute if TOP.match(e["name"])])
    busy = sum(e["dur"] for e in top)
    # What runs in the gaps: the sharding's hooks (sharding.* ranges, session.cpp)
    # and what they trace inside (gather.wait, gather.decode, ...).
    gap_ranges = sorted((e for e in compute if not TOP.match(e["name"]) and e["name"] not in ("step", "validation")),
                        key=lambda e: e["ts"])
    # A range overlaps the gap [lo, hi) only if it starts before hi and at most
    # its own length before lo: bisect the starts instead of scanning them all.
    starts = [e["ts"] for e in gap_ranges]
    longest = max((e["dur"] for e in gap_ranges), default=0)
    joints = defaultdict(list)
    inside = defaultdict(lambda: defaultdict(float))  # joint -> range name -> time inside its gaps
    for a, b in zip(top, top[1:]):
        lo, hi = a["ts"] + a["dur"], b["ts"]
        gap = hi - lo
        if gap <= 0:
            continue
        key = f"{re.sub(r'[0-9]+', 'N', a['name'])} -> {re.sub(r'[0-9]+', 'N', b['name'])}"
        joints[key].append(gap)
        for h in gap_ranges[bisect.bisect_left(starts, lo - longest):bisect.bisect_left(starts, hi)]:
            overlap = min(hi, h["ts"] + h["dur"]) - max(lo, h["ts"])
            if overlap > 0:
                inside[key][h["name"]] += overlap
    idle = sum(sum(v) for v in joints.values())
    print(f"\ncompute stream: {busy / 1e3:.1f} ms in traced ranges, {idle / 1e3:.1f} ms idle between them "
          f"({100 * idle / span:.1f}% of the window)")
    print("| between | times | median ms | total ms |")
    print("| --- | ---: | ---: | ---: |")
    for key, g in sorted(joints.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {key} | {len(g)} | {st.median(g) / 1e3:.3f} | {sum(g) / 1e3:.1f} |")
    if inside:
        # The compute stream's own work there, or its waits for a collective.
        print("\nranges inside those gaps (a nested range is part of the hook that holds it; "
              "the rest of a gap is between the ranges)")
        print("| between | range | mean ms a gap | total ms |")
        print("| --- | --- | ---: | ---: |")
        for key, g in sorted(joints.items(), key=lambda kv: -sum(kv[1])):
            for name, t in sorted(inside[key].items(), key=lambda kv: -kv[1]):
                print(f"| {key} | {name} | {t / len(g) / 1e3:.3f} | {t / 1e3:.1f} |")

    side = [e for e in ranges if e["tid"] == tid.get("optimizer stream")]
    per_name("optimizer stream (beside the compute stream)", "op", side)
    per_name("comm stream", "collective", comm)


def per_name(title, what, events):
    """Calls and time per range name on one track."""
    if not events:
        return
    kinds = defaultdict(list)
    for e in events:
        kinds[e["name"]].append(e["dur"])
    print(f"\n{title}:")
    print(f"| {what} | calls | mean ms | total ms |")
    print("| --- | ---: | ---: | ---: |")
    for name, d in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {len(d)} | {sum(d) / len(d) / 1e3:.3f} | {sum(d) / 1e3:.1f} |")

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
