#!/usr/bin/env python3
"""Tokenizer throughput: `loom prepare text` against the reference libraries on
the same text and the same number of threads.

usage: benchmarks/tokenizer_throughput.py [--threads N] [--mb 64] [--loom build/bin/loom]

The corpus is the fortune(6) databases and Loom's docs, repeated to about --mb
MB of text, split into documents on '%' lines as `loom prepare` splits them.
Rows: Llama 3 -- loom's tiktoken reader vs HF `tokenizers` (the same vocabulary
as a tokenizer.json) vs `tiktoken`; Mistral (SentencePiece) -- loom (which runs
libsentencepiece) vs the `sentencepiece` package vs HF `tokenizers` on the
model converted as transformers' LlamaConverter does. Loom's time is its
tokenizing phase as `loom prepare` reports it (reading and splitting files,
writing shards excluded); the libraries' is encode_batch over the documents
(already in memory). Best of 3.
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FILES = os.path.join(REPO, ".cache", "tokenizers")

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=os.cpu_count())
ap.add_argument("--mb", type=float, default=64)
ap.add_argument("--loom", default=os.path.join(REPO, "build", "bin", "loom"))
args = ap.parse_args()
os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' thread pool
import sentencepiece  # noqa: E402
import tiktoken  # noqa: E402
import tiktoken.load  # noqa: E402
import tokenizers  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "tests", "tokenizers"))
from fetch_tokenizers import LLAMA3_PATTERN, llama3_specials  # noqa: E402

# The corpus.
texts = []
for f in sorted(glob.glob("/usr/share/games/fortunes/*")):
    if f.endswith(".dat") or f.endswith(".u8") or os.path.islink(f):
        continue
    try:
        texts.append(open(f, encoding="utf-8").read())
    except UnicodeDecodeError:
        pass
for f in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + [os.path.join(REPO, "README.md")]:
    texts.append(open(f, encoding="utf-8").read())
base = "\n%\n".join(texts)
reps = max(1, int(args.mb * 1e6 / len(base.encode())))
tmp = tempfile.mkdtemp(prefix="loom_tokbench_")
corpus = os.path.join(tmp, "corpus.txt")
with open(corpus, "w", encoding="utf-8") as f:
    f.write("\n%\n".join([base] * reps))
docs = [d for d in re.split(r"(?m)^%\n", open(corpus, encoding="utf-8").read()) if d.strip()]
mb = sum(len(d.encode()) for d in docs) / 1e6
print(f"corpus: {mb:.1f} MB in {len(docs)} documents, {args.threads} thread(s)")


def best(fn, n=3):
    t = []
    for _ in range(n):
        s = time.perf_counter()
        fn()
        t.append(time.perf_counter() - s)
    return min(t)


def loom(tok):
    rates = []
    for _ in range(3):
        out = subprocess.run([args.loom, "prepare", "text", os.path.join(tmp, "out"), corpus, "--tokenizer", tok,
                              "--threads", str(args.threads), "--val-fraction", "0", "--force"],
                             check=True, capture_output=True, text=True).stdout
        m = re.search(r"speed:\s+([\d.]+) MB of text in ([\d.]+) s", out)
        rates.append(float(m.group(1)) / float(m.group(2)))
    return max(rates)


rows = []
l3 = os.path.join(FILES, "llama3", "tokenizer.model")
rows.append(("Llama 3 (tiktoken file)", "loom", loom(l3)))
hf = tokenizers.Tokenizer.from_file(os.path.join(FILES, "llama3-hf", "tokenizer.json"))
hf.encode_special_tokens = True
rows.append(("Llama 3 (tokenizer.json)", f"HF tokenizers {tokenizers.__version__}",
             mb / best(lambda: hf.encode_batch(docs, add_special_tokens=False))))
if hasattr(hf, "encode_batch_fast"):  # no offsets: the library's fastest batch path
    rows.append(("Llama 3 (tokenizer.json)", f"HF tokenizers {tokenizers.__version__} encode_batch_fast",
                 mb / best(lambda: hf.encode_batch_fast(docs, add_special_tokens=False))))
rows.append(("Llama 3 (tokenizer.json)", "loom", loom(os.path.join(FILES, "llama3-hf", "tokenizer.json"))))
ranks = tiktoken.load.load_tiktoken_bpe(l3)
tk = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                       special_tokens={t: len(ranks) + i for i, t in enumerate(llama3_specials())})
rows.append(("Llama 3 (tiktoken file)", f"tiktoken {tiktoken.__version__}",
             mb / best(lambda: tk.encode_ordinary_batch(docs, num_threads=args.threads))))
sp_path = os.path.join(FILES, "mistral", "tokenizer.model")
sp = sentencepiece.SentencePieceProcessor(model_file=sp_path)
rows.append(("Mistral (SentencePiece)", "loom", loom(sp_path)))
rows.append(("Mistral (SentencePiece)", f"sentencepiece {sentencepiece.__version__}",
             mb / best(lambda: sp.encode(docs, num_threads=args.threads))))


def sentencepiece_as_hf(path):
    """The SentencePiece BPE model as an HF tokenizer, converted the way
    transformers' LlamaConverter does (pieces and scores -> vocab and merges,
    byte fallback, '▁' for spaces with one prepended)."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Tokenizer, models, normalizers
    m = pb.ModelProto()
    m.ParseFromString(open(path, "rb").read())
    vocab = {p.piece: i for i, p in enumerate(m.pieces)}
    merges = []
    for i, p in enumerate(m.pieces):
        local = [(p.piece[:k], p.piece[k:], p.score) for k in range(1, len(p.piece))
                 if p.piece[:k] in vocab and p.piece[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: x[2], reverse=True)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token="<unk>", fuse_unk=True,
                             byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    return t


hf_sp = sentencepiece_as_hf(sp_path)
sample = docs[:2000]
same = sum(hf_sp.encode(d, add_special_tokens=False).ids == sp.encode(d) for d in sample)
print(f"the converted SentencePiece model gives sentencepiece's ids on {same} of {len(sample)} documents")
rows.append(("Mistral (SentencePiece)", f"HF tokenizers {tokenizers.__version__} (converted), encode_batch",
             mb / best(lambda: hf_sp.encode_batch(docs, add_special_tokens=False))))
print(f"| tokenizer | implementation | MB/s ({args.threads} threads) |")
print("| --- | --- | --- |")
for name, impl, rate in rows:
    print(f"| {name} | {impl} | {rate:.1f} |")
subprocess.run(["rm", "-rf", tmp])
