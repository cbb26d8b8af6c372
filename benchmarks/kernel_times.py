#!/usr/bin/env python3
"""Per-kernel device time of one training step, from Nsight Compute's CSV
(`ncu --metrics gpu__time_duration.sum --csv`) of a `loom bench` run: the
kernels between the third and the fourth launch of Loom's step timestamp
kernel (the second step's start and end), grouped by kernel and summed.

  ncu --metrics gpu__time_duration.sum --clock-control none --csv \\
      loom bench configs/bench/llama-1b.toml --steps=1 --warmup=1 > ncu.csv
  python3 benchmarks/kernel_times.py ncu.csv [ORDER.txt]   (ORDER.txt: every kernel of the step in order)
"""
import csv
import io
import re
import sys
from collections import defaultdict


def main(path):
    text = open(path, errors="replace").read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    kernels = []  # (id, name, ns) in launch order
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        ns = v * (1000.0 if r.get("Metric Unit") == "usecond" else 1e6 if r.get("Metric Unit") == "msecond" else 1.0)
        kernels.append((int(r["ID"]), r["Kernel Name"], ns))
    stamps = [i for i, (_, name, _) in enumerate(kernels) if "timestamp_kernel" in name]
    if len(stamps) < 4:
        sys.exit(f"{path}: found {len(stamps)} timestamp kernels, need the two of each of two steps")
    step = kernels[stamps[2]:stamps[3] + 1]
    groups = defaultdict(lambda: [0, 0.0])
    for _, name, ns in step:
        key = re.sub(r"\(.*", "", name)[:90]
        groups[key][0] += 1
        groups[key][1] += ns
    total = sum(ns for _, _, ns in step)
    print(f"one step: {len(step)} kernels, {total / 1e6:.2f} ms of kernel time (serialised by the profiler)")
    print("| kernel | launches | ms | share |")
    print("| --- | ---: | ---: | ---: |")
    for key, (n, ns) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{key}` | {n} | {ns / 1e6:.2f} | {100 * ns / total:.1f}% |")
    if len(sys.argv) > 2:  # the step's kernels in launch order, one per line
        with open(sys.argv[2], "w") as f:
            for _, name, ns in step:
                f.write(f"{ns / 1e3:10.1f} us  {name[:160]}\n")


if __name__ == "__main__":
    main(sys.argv[1])
