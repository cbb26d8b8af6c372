#!/usr/bin/env python3
"""Checks a Loom trace (<out_dir>/trace/rank_<R>.json, written with
[profile] trace = true) against the run's metrics.jsonl, and prints a summary.

usage: check_trace.py TRACE.json METRICS.jsonl [--tolerance-ms 0.5] [--tolerance 0.10]

Checks, per track (compute, comm, host, optimizer): every complete event ("X") either
nests inside the enclosing one or starts after it ends (no partial overlap).
Compute track: the top-level events are one "step" per step of the window
(and "validation" passes); every layer has its forward.layer.N and backward.layer.N inside each
step; the direct children of a step add up to no more than the step; the
step's duration agrees with metrics.jsonl's step_ms for that step (within
max(tolerance-ms, tolerance * step_ms)). Host track: one "step" per step, with
the data/forward/backward/optimizer phases inside. Optimizer track: its ops
follow one another, and every step runs AdamW (there or on compute). Counters: one memory sample
per step boundary. Exits 1 naming every failed check.
"""
import argparse
import collections
import json
import re
import sys

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("metrics")
ap.add_argument("--tolerance-ms", type=float, default=0.5)
ap.add_argument("--tolerance", type=float, default=0.10)
args = ap.parse_args()

errors = []


def fail(msg):
    errors.append(msg)


with open(args.trace) as f:
    doc = json.load(f)
events = doc["traceEvents"]
meta = doc.get("otherData", {})
start, stop = meta["loom_steps"]
window = list(range(start, stop + 1))
tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
if sorted(tracks) != [1, 2, 3, 4]:
    fail(f"expected 4 named tracks (compute, comm, host, optimizer), found {tracks}")
xs = collections.defaultdict(list)
for e in events:
    if e.get("ph") == "X":
        xs[e["tid"]].append(e)
EPS = 1e-3  # us: JSON round-off


def nest(tid):
    """Parent of each event (index or None), checking that events nest."""
    evs = xs[tid]
    parents, stack = [], []
    for i, e in enumerate(evs):
        if i and (e["ts"] < evs[i - 1]["ts"] - EPS):
            fail(f"track {tracks.get(tid)}: events are not sorted by start ({e['name']} at {e['ts']})")
        while stack and evs[stack[-1]]["ts"] + evs[stack[-1]]["dur"] <= e["ts"] + EPS:
            stack.pop()
        if stack:
            p = evs[stack[-1]]
            if e["ts"] + e["dur"] > p["ts"] + p["dur"] + EPS:
                fail(f"track {tracks.get(tid)}: {e['name']} [{e['ts']:.3f}, +{e['dur']:.3f}] overlaps the end of "
                     f"{p['name']} [{p['ts']:.3f}, +{p['dur']:.3f}] without nesting in it")
        parents.append(stack[-1] if stack else None)
        stack.append(i)
    return parents


metrics = {}
with open(args.metrics) as f:
    for line in f:
        j = json.loads(line)
        if "step_ms" in j:
            metrics[j["step"]] = j["step_ms"]

# Compute track.
comp = xs[1]
par = nest(1)
tops = [i for i, p in enumerate(par) if p is None]
steps = [i for i in tops if comp[i]["name"] == "step"]
if len(steps) != len(window):
    fail(f"compute track: {len(steps)} top-level 'step' events, expected {len(window)}")
others = sorted({comp[i]["name"] for i in tops} - {"step", "validation"})
if others:
    fail(f"compute track: top-level events other than step and validation: {others}")
layers = sorted({int(m.group(1)) for e in comp for m in [re.match(r"forward\.layer\.(\d+)$", e["name"])] if m})
if not layers:
    fail("compute track: no forward.layer.N ranges")
print(f"{args.trace}: rank {meta.get('loom_rank')}, {meta.get('loom_device')}, steps {start}..{stop}, "
      f"{len(comp)} compute ranges, {len(xs[2])} collectives, {len(layers)} layers")
op_total = collections.Counter()
for k, si in enumerate(steps):
    st = comp[si]
    step_no = st["args"]["step"]
    kids = [i for i, p in enumerate(par) if p == si]
    inner = [i for i in range(len(comp)) if i != si and comp[i]["ts"] >= st["ts"] - EPS
             and comp[i]["ts"] + comp[i]["dur"] <= st["ts"] + st["dur"] + EPS]
    seen = {comp[i]["name"] for i in inner}
    for l in layers:
        for d in ("forward", "backward"):
            if f"{d}.layer.{l}" not in seen:
                fail(f"step {step_no}: no {d}.layer.{l} range inside it")
    kid_sum = sum(comp[i]["dur"] for i in kids)
    if kid_sum > st["dur"] + EPS:
        fail(f"step {step_no}: its ranges add up to {kid_sum / 1000:.3f} ms, more than the step's {st['dur'] / 1000:.3f} ms")
    dur_ms = st["dur"] / 1000
    want = metrics.get(step_no)
    if want is None:
        fail(f"step {step_no}: not in {args.metrics}")
    elif abs(dur_ms - want) > max(args.tolerance_ms, args.tolerance * want):
        fail(f"step {step_no}: the trace's step lasts {dur_ms:.3f} ms, metrics.jsonl says step_ms = {want:.3f}")
    for i in inner:
        if not comp[i]["name"].startswith(("forward.", "backward.", "head.")):
            op_total[comp[i]["name"]] += comp[i]["dur"]
    print(f"  step {step_no}: {dur_ms:.3f} ms (metrics {want if want is None else round(want, 3)} ms), "
          f"top-level ranges {kid_sum / 1000:.3f} ms ({100 * kid_sum / max(st['dur'], 1e-9):.0f}%)")
if op_total:
    print("  ops by device time in the window: " +
          ", ".join(f"{n} {t / 1000:.2f} ms" for n, t in op_total.most_common(8)))

# Comm track: collectives must not overlap one another on their stream.
nest(2)
# Optimizer track (CUDA: AdamW on the second stream): its ops follow one
# another. Every step of the window runs AdamW, on this track or on compute.
nest(4)
opt_total = collections.Counter()
for e in xs[4]:
    opt_total[e["name"]] += e["dur"]
adamw_steps = {e["args"]["step"] for t in (1, 4) for e in xs[t] if e["name"] == "adamw"}
missing_adamw = [s for s in window if s not in adamw_steps]
if missing_adamw:
    fail(f"no adamw range in steps {missing_adamw} (on the compute or the optimizer track)")
if opt_total:
    print("  optimizer stream in the window: " + ", ".join(f"{n} {t / 1000:.2f} ms" for n, t in opt_total.most_common()))
# Host track.
host = xs[3]
hpar = nest(3)
hsteps = [i for i, p in enumerate(hpar) if p is None and host[i]["name"] == "step"]
hothers = sorted({host[i]["name"] for i, p in enumerate(hpar) if p is None} - {"step", "validation"})
if hothers:
    fail(f"host track: top-level phases other than step and validation: {hothers}")
if len(hsteps) != len(window):
    fail(f"host track: {len(hsteps)} 'step' phases, expected {len(window)}")
for si in hsteps:
    kids = {host[i]["name"] for i, p in enumerate(hpar) if p == si}
    missing = {"data", "forward", "backward", "optimizer"} - kids
    if missing:
        fail(f"host track: step {host[si]['args']['step']} lacks the phases {sorted(missing)}")
# Counters.
mem = [e for e in events if e.get("ph") == "C"]
if len(mem) < len(window) + 1 or not all(e["args"]["in_use"] > 0 for e in mem):
    fail(f"expected {len(window) + 1} memory samples with memory in use > 0, found {len(mem)}")

if errors:
    print("FAILED:\n  " + "\n  ".join(errors))
    sys.exit(1)
print("trace OK")
