#!/usr/bin/env python3
"""Writes Megatron indexed datasets with an independent writer (the published
.bin/.idx layout, nothing from Loom) and the samples a from-scratch model of
GPTDataset's index building gives for them, for test_megatron.

usage: megatron_model.py OUT_DIR      -> OUT_DIR/{a,b,c}.{bin,idx}, OUT_DIR/expected.json

The model, as Loom documents it (plugins/data/README.md):
  * a dataset's documents are split by Megatron's get_split_indices;
  * epoch e orders the split's documents by a seeded permutation (Feistel
    network over SplitMix64, the same function as core/include/loom/ops/hash.hpp) and
    concatenates them; sample j of the epoch is tokens [j*S, j*S + S + 1);
    the epoch's sample order is another seeded permutation;
  * several datasets are blended by Megatron's build_blending_indices;
  * global batch b is samples [b*B*W, (b+1)*B*W), rank r takes B of them.
"""
import json
import os
import random
import struct
import sys

M = (1 << 64) - 1
DTYPES = {"uint16": (8, "<H", 2), "int32": (4, "<i", 4)}


def write_indexed(prefix, docs, dtype, doc_starts=None):
    """docs: list of sequences (lists of ids). doc_starts: document indices (default one per sequence)."""
    code, fmt, size = DTYPES[dtype]
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(b"".join(struct.pack(fmt, t) for t in d))
    pointers, p = [], 0
    for d in docs:
        pointers.append(p)
        p += len(d) * size
    starts = doc_starts if doc_starts is not None else list(range(len(docs) + 1))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(starts)))
        f.write(struct.pack(f"<{len(docs)}i", *[len(d) for d in docs]))
        f.write(struct.pack(f"<{len(docs)}q", *pointers))
        f.write(struct.pack(f"<{len(starts)}q", *starts))


def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)


def hash_of(seed, *vs):
    h = mix64(seed & M)
    for v in vs:
        h = mix64(h ^ mix64(v & M))
    return h


class Perm:
    def __init__(self, n, seed, epoch):
        self.n, self.hb = n, 0
        while self.hb < 32 and (1 << (2 * self.hb)) < n:
            self.hb += 1
        self.mask = (1 << self.hb) - 1
        self.keys = [hash_of(seed, 0x5045524D, epoch, k) for k in range(4)]

    def _round(self, x):
        l, r = x >> self.hb, x & self.mask
        for key in self.keys:
            l, r = r, l ^ (mix64(r ^ key) & self.mask)
        return (l << self.hb) | r

    def __call__(self, i):
        x = self._round(i)
        while x >= self.n:
            x = self._round(x)
        return x


def split_indices(split, n):
    parts = [float(x) for x in split.replace("/", ",").split(",")]
    parts = (parts + [0.0, 0.0, 0.0])[:3]
    total = sum(parts)
    idx = [0]
    for p in parts:
        idx.append(idx[-1] + int(round(p / total * float(n))))
    diff = idx[-1] - n
    return [idx[0]] + [i - diff for i in idx[1:]]


class Stream:
    def __init__(self, docs, begin, end, index, seed, S):
        self.docs, self.begin, self.end, self.S = docs, begin, end, S
        self.tokens = sum(len(docs[i]) for i in range(begin, end))
        self.samples = (self.tokens - 1) // S
        self.doc_seed = hash_of(seed, 0x444F4353, index)
        self.sample_seed = hash_of(seed, 0x53414D50, index)

    def sample(self, k, shuffle):
        n = self.end - self.begin
        epoch, pos = divmod(k, self.samples)
        j = Perm(self.samples, self.sample_seed, epoch)(pos) if shuffle else pos
        order = Perm(n, self.doc_seed, epoch) if shuffle else (lambda i: i)
        stream = [t for i in range(n) for t in self.docs[self.begin + order(i)]]
        return stream[j * self.S: j * self.S + self.S + 1]


def model(datasets, cfg):
    S, B, W = cfg["seq_len"], cfg["batch"], cfg["world"]
    seed, shuffle = cfg["seed"], cfg.get("shuffle", True)
    val_prefixes = cfg.get("val_prefix", [])
    split = cfg.get("split") or ("1,0,0" if val_prefixes else "969,30,1")
    train, val = [], []
    for i, p in enumerate(cfg["prefix"]):
        idx = split_indices(split, len(datasets[p]))
        train.append(Stream(datasets[p], idx[0], idx[1], i, seed, S))
        if not val_prefixes and idx[2] > idx[1]:
            val.append(Stream(datasets[p], idx[1], idx[2], i, seed, S))
    for i, p in enumerate(val_prefixes):
        val.append(Stream(datasets[p], 0, len(datasets[p]), len(cfg["prefix"]) + i, seed, S))
    weights = cfg.get("weights") or [s.samples for s in train]
    weights = [w / sum(weights) for w in weights]
    counts = [0] * len(train)
    out = {"train": [[] for _ in range(W)], "val": [[] for _ in range(W)], "train_samples": [s.samples for s in train]}
    g = 0
    for _ in range(cfg["steps"]):
        for i in range(B * W):
            x = max(float(g), 1.0)
            errs = [weights[d] * x - counts[d] for d in range(len(train))]
            d = max(range(len(train)), key=lambda k: (errs[k], -k))
            out["train"][i // B].append(train[d].sample(counts[d], shuffle))
            counts[d] += 1
            g += 1
    out["counts"] = counts
    out["has_val"] = bool(val)
    total = sum(s.samples for s in val)
    vc = 0
    for _ in range(cfg.get("val_batches", 0)):
        for i in range(B * W):
            v = (vc + i) % total
            k = 0
            while v >= val[k].samples:
                v -= val[k].samples
                k += 1
            out["val"][i // B].append(val[k].sample(v, False))
        vc += B * W
    return out


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(11)
    # a: uint16 tokens, one document per sequence, a few empty ones.
    a = [[rng.randrange(50000) for _ in range(rng.choice([0, 1, 3, 7, 20, 45]))] for _ in range(240)]
    # b: int32 tokens above 65535, sentence-split documents (document indices != sequences + 1).
    b = [[70000 + rng.randrange(60000) for _ in range(rng.randrange(1, 30))] for _ in range(90)]
    # c: a small validation set.
    c = [[rng.randrange(1000) for _ in range(rng.randrange(5, 25))] for _ in range(30)]
    write_indexed(os.path.join(out_dir, "a"), a, "uint16")
    write_indexed(os.path.join(out_dir, "b"), b, "int32", doc_starts=[0, 2, 5, 9, 30, 61, 90])
    write_indexed(os.path.join(out_dir, "c"), c, "uint16")
    datasets = {os.path.join(out_dir, k): v for k, v in (("a", a), ("b", b), ("c", c))}
    p = lambda k: os.path.join(out_dir, k)
    scenarios = [
        {"name": "split_two_ranks", "prefix": [p("a")], "split": "90,8,2", "seq_len": 16, "batch": 3, "world": 2,
         "steps": 60, "seed": 5, "val_batches": 4},
        {"name": "blend_val_prefix", "prefix": [p("a"), p("b")], "weights": [0.3, 0.7], "val_prefix": [p("c")],
         "seq_len": 8, "batch": 2, "world": 1, "steps": 150, "seed": 9, "val_batches": 3},
        {"name": "unshuffled_default_split", "prefix": [p("b")], "shuffle": False, "seq_len": 10, "batch": 4,
         "world": 1, "steps": 40, "seed": 1, "val_batches": 2},
        {"name": "blend_by_size", "prefix": [p("b"), p("a")], "split": "98,2", "seq_len": 12, "batch": 1, "world": 3,
         "steps": 50, "seed": 77, "val_batches": 2},
        # Few samples an epoch (seq_len near the split's size): many epochs, each reshuffled; no validation.
        {"name": "many_epochs", "prefix": [p("c")], "split": "1", "seq_len": 150, "batch": 3, "world": 2,
         "steps": 20, "seed": 123456789, "val_batches": 0},
        # The shortest sample (2 tokens), a dataset of weight 0 that is never drawn, a 64-bit seed.
        {"name": "seq_len_one_zero_weight", "prefix": [p("a"), p("c")], "weights": [1, 0], "val_prefix": [p("b")],
         "seq_len": 1, "batch": 7, "world": 3, "steps": 15, "seed": (1 << 63) + 5, "val_batches": 2},
        # Three datasets, uneven weights, a two-part split.
        {"name": "blend_of_three", "prefix": [p("c"), p("a"), p("b")], "weights": [0.2, 0.5, 0.3], "split": "80,20",
         "seq_len": 5, "batch": 2, "world": 2, "steps": 70, "seed": 31337, "val_batches": 5},
    ]
    for s in scenarios:
        s["expected"] = model(datasets, s)
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(scenarios, f)


if __name__ == "__main__":
    main()
