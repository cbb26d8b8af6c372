#!/usr/bin/env python3
"""Reads a run's TensorBoard event file back and checks it against the run's
metrics.jsonl.

usage: read_tensorboard.py RUN_DIR [FILES]

1. The TFRecord framing of every record of the FILES (default 1) event files:
   length, masked CRC-32C of the length, payload, masked CRC-32C of the
   payload (checked here, independently).
2. The `tensorboard` package's EventAccumulator loads RUN_DIR/tensorboard and
   finds the scalars: train/loss, train/lr, train/grad_norm, perf/tokens_per_s,
   perf/step_ms, perf/memory_gib at every logged step, val/loss at every
   validation, each equal (as float32) to metrics.jsonl's value -- the last
   line of a step, when a resumed run logged it again -- and no step twice
   (a resumed run's event file drops the steps it repeats).
Exits 1 naming what differs.
"""
import glob
import json
import math
import os
import struct
import sys

run = sys.argv[1]
want_files = int(sys.argv[2]) if len(sys.argv) > 2 else 1
files = sorted(glob.glob(os.path.join(run, "tensorboard", "events.out.tfevents.*")))
if len(files) != want_files:
    sys.exit(f"expected {want_files} event file(s) in {run}/tensorboard, found {files}")

POLY = 0x82F63B78
TABLE = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ POLY if c & 1 else c >> 1
    TABLE.append(c)


def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c = TABLE[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked(c):
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


records = 0
for name in files:
    data = open(name, "rb").read()
    pos = 0
    while pos < len(data):
        if pos + 12 > len(data):
            sys.exit(f"{name}: truncated record header at byte {pos}")
        (n,) = struct.unpack_from("<Q", data, pos)
        (lcrc,) = struct.unpack_from("<I", data, pos + 8)
        if lcrc != masked(crc32c(data[pos:pos + 8])):
            sys.exit(f"{name}: bad length CRC at byte {pos}")
        payload = data[pos + 12:pos + 12 + n]
        if len(payload) != n or pos + 16 + n > len(data):
            sys.exit(f"{name}: truncated record at byte {pos}")
        (pcrc,) = struct.unpack_from("<I", data, pos + 12 + n)
        if pcrc != masked(crc32c(payload)):
            sys.exit(f"{name}: bad payload CRC at byte {pos}")
        pos += 12 + n + 4
        records += 1

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

acc = EventAccumulator(os.path.join(run, "tensorboard"), size_guidance={"scalars": 0})
acc.Reload()
tags = set(acc.Tags()["scalars"])
scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags}

errors = []
for t in sorted(tags):
    steps_of = [e.step for e in acc.Scalars(t)]
    if len(steps_of) != len(set(steps_of)) or steps_of != sorted(steps_of):
        errors.append(f"{t}: steps repeat or run back: {steps_of}")
# The last line of each step (a resumed run appends the steps it repeats).
lines = {}
for line in open(os.path.join(run, "metrics.jsonl")):
    m = json.loads(line)
    lines.setdefault(m["step"], {}).update(m)
want = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "perf/tokens_per_s",
        "step_ms": "perf/step_ms", "val_loss": "val/loss"}
steps = 0
for m in lines.values():
    steps += "loss" in m
    for key, tag in want.items():
        if key not in m:
            continue
        got = scalars.get(tag, {}).get(m["step"])
        if m[key] is None:  # metrics.jsonl writes a non-finite value as null
            if got is None or math.isfinite(got):
                errors.append(f"{tag} at step {m['step']}: {got} in TensorBoard, non-finite in metrics.jsonl")
            continue
        expect = struct.unpack("<f", struct.pack("<f", m[key]))[0]
        if got is None:
            errors.append(f"{tag} has no value at step {m['step']}")
        elif got != expect:
            errors.append(f"{tag} at step {m['step']}: {got} in TensorBoard, {m[key]} in metrics.jsonl")
    if "peak_mem_bytes" in m:
        got = scalars.get("perf/memory_gib", {}).get(m["step"])
        if got is None or abs(got - m["peak_mem_bytes"] / 2**30) > 1e-6 * max(1.0, got):
            errors.append(f"perf/memory_gib at step {m['step']}: {got}, metrics.jsonl {m['peak_mem_bytes'] / 2**30}")
if steps == 0:
    errors.append("metrics.jsonl holds no step")
if errors:
    print("FAILED:\n  " + "\n  ".join(errors[:20]))
    sys.exit(1)
print(f"tensorboard OK: {records} records, tags {sorted(tags)}, {steps} steps")
