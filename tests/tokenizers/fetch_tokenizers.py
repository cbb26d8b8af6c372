#!/usr/bin/env python3
"""Puts the real tokenizer files the tokenizer tests need into DEST (default
<repo>/.cache/tokenizers), from PyPI wheels that ship them (none is committed):

  llama3/tokenizer.model     Llama 3's tiktoken BPE file (wheel llama-models)
  mistral/tokenizer.model    Mistral 7B v0.1's SentencePiece model, a Llama-2-style
                             BPE with byte fallback, 32000 pieces (wheel mistral-common)
  llama3-hf/tokenizer.json   Llama 3's ranks as an HF byte-level BPE tokenizer.json
                             (Split regex + ByteLevel, ignore_merges), built here with
                             the `tokenizers` library
  gpt2-hf/tokenizer.json     a GPT-2-style byte-level BPE (ByteLevel pre-tokenizer with
                             its own regex) trained here on Loom's docs with `tokenizers`

Idempotent; checks the SHA-256 of the downloaded files. Run by scripts/setup.sh.
"""
import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEST = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, ".cache", "tokenizers")

WHEELS = [
    # (requirement, member in the wheel, destination, sha256 of the member)
    ("llama-models==0.3.0", "llama_models/llama3/tokenizer.model", "llama3/tokenizer.model",
     "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"),
    ("mistral-common==1.13.1", "mistral_common/data/tokenizer.model.v1", "mistral/tokenizer.model",
     "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"),
]

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
                "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                "<|eot_id|>", "<|python_tag|>", "<|image|>"]


def llama3_specials():
    return LLAMA3_NAMED + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_NAMED))]


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def fetch_wheels():
    missing = [w for w in WHEELS if not os.path.exists(os.path.join(DEST, w[2])) or sha256(os.path.join(DEST, w[2])) != w[3]]
    if not missing:
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp]
                       + [w[0] for w in missing], check=True)
        wheels = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
        for req, member, dest, digest in missing:
            name = req.split("==")[0].replace("-", "_")
            wheel = [w for w in wheels if os.path.basename(w).startswith(name + "-")]
            if not wheel:
                sys.exit(f"fetch_tokenizers: pip did not download {req}")
            data = zipfile.ZipFile(wheel[0]).read(member)
            if hashlib.sha256(data).hexdigest() != digest:
                sys.exit(f"fetch_tokenizers: {member} in {req} has SHA-256 {hashlib.sha256(data).hexdigest()}, "
                         f"expected {digest}")
            out = os.path.join(DEST, dest)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out + ".tmp", "wb") as f:
                f.write(data)
            os.replace(out + ".tmp", out)


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_llama3_hf():
    out = os.path.join(DEST, "llama3-hf", "tokenizer.json")
    if os.path.exists(out):
        return
    from tokenizers import Tokenizer, Regex, decoders, models, pre_tokenizers, processors
    ranks = {}
    with open(os.path.join(DEST, "llama3", "tokenizer.model"), "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    table = bytes_to_unicode()
    enc = lambda b: "".join(table[x] for x in b)
    vocab = {enc(t): r for t, r in ranks.items()}
    # Merges as the usual tiktoken -> HF conversion recovers them: every split
    # of a token into two tokens, ordered by the rank of the token they make.
    merges = []
    for t, r in ranks.items():
        if len(t) < 2:
            continue
        local = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in ranks and t[k:] in ranks]
        local.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges.extend((r, enc(a), enc(b)) for a, b in local)
    merges.sort(key=lambda m: m[0])
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(llama3_specials())
    tk.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                      special_tokens=[("<|begin_of_text|>", 128000)])
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tk.save(out + ".tmp")
    os.replace(out + ".tmp", out)


def build_gpt2_hf():
    out = os.path.join(DEST, "gpt2-hf", "tokenizer.json")
    if os.path.exists(out):
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    files = [os.path.join(REPO, p) for p in ("README.md", "docs/ARCHITECTURE.md", "docs/CONFIG.md", "docs/PLUGINS.md")]
    tk.train([f for f in files if os.path.exists(f)], trainer)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tk.save(out + ".tmp")
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    os.makedirs(DEST, exist_ok=True)
    fetch_wheels()
    build_llama3_hf()
    build_gpt2_hf()
    print(f"tokenizer files in {DEST}")
