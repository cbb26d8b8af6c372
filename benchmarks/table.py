#!/usr/bin/env python3
"""Prints compare.sh's results (JSON lines) as one Markdown table: per workload,
each Loom row (native and fused layers) beside each peer mode, with the fused
row's step time as a ratio of each peer's (native's when there is no fused
row), then each Loom row's per-part breakdown when it was measured."""
import json
import sys


def main(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    print("| workload | system | step ms | tokens/s | MFU | peak mem GiB | Loom / this |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in dict.fromkeys(r["name"] for r in rows):
        looms = [r for r in rows if r["name"] == name and r["who"] == "loom" and "error" not in r]
        loom = next((r for r in looms if r.get("layers") == "fused"), looms[0] if looms else None)
        for r in [x for x in rows if x["name"] == name]:
            if "error" in r:
                print(f"| {name} | {r.get('mode', 'loom')} | failed: {r['error'][:60]} | | | | |")
                continue
            if r["who"] == "loom":
                label = f"loom {r.get('layers', 'native')} {r['precision']}+{r['attention']}"
                mem = r["device_mem_gib"]
            else:
                label = f"HF {r['mode']}"
                if "torchao" in r:
                    label += f" (torchao {r['torchao']} {r['float8_recipe']})"
                mem = r["peak_reserved_gib"]
            ratio = f"{loom['median_step_ms'] / r['median_step_ms']:.2f}x" if loom and r["who"] == "peer" else ""
            print(f"| {name} | {label} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                  f"{100 * r['mfu']:.1f}% | {mem:.1f} | {ratio} |")
    parts = [r for r in rows if r["who"] == "loom" and "breakdown_ms" in r]
    if parts:
        keys = list(dict.fromkeys(k for r in parts for k in r["breakdown_ms"]))
        print()
        print("| workload | layers | " + " | ".join(keys) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in keys) + " |")
        for r in parts:
            cells = " | ".join(f"{r['breakdown_ms'].get(k, 0):.2f}" for k in keys)
            print(f"| {r['name']} | {r.get('layers', 'native')} | {cells} |")


if __name__ == "__main__":
    main(sys.argv[1])
