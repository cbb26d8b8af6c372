#!/usr/bin/env python3
"""Reference token ids for test_tokenizers, from the reference libraries
(sentencepiece, tiktoken, tokenizers) on a corpus of hard strings.

usage: reference_ids.py TOKENIZER_DIR OUT.json

Each case is raw bytes (some not valid UTF-8). The reference decodes them with
bytes.decode("utf-8", "replace") -- Loom's documented handling of invalid UTF-8
-- and encodes the string without BOS/EOS, treating special-token look-alikes
as text (tiktoken: disallowed_special=(); tokenizers: encode_special_tokens).
A missing tokenizer file is an error, not a skip: scripts/setup.sh fetches them.
"""
import base64
import json
import os
import random
import sys

if len(sys.argv) != 3:
    sys.exit(__doc__)
DIR, OUT = sys.argv[1], sys.argv[2]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = {
    "sentencepiece": os.path.join(DIR, "mistral", "tokenizer.model"),
    "tiktoken": os.path.join(DIR, "llama3", "tokenizer.model"),
    "hf_llama3": os.path.join(DIR, "llama3-hf", "tokenizer.json"),
    "hf_gpt2": os.path.join(DIR, "gpt2-hf", "tokenizer.json"),
}
missing = [p for p in FILES.values() if not os.path.exists(p)]
if missing:
    sys.exit("missing tokenizer files: " + ", ".join(missing) +
             "\nrun scripts/setup.sh (or python3 tests/tokenizers/fetch_tokenizers.py) to fetch them")
try:
    import sentencepiece
    import tiktoken
    import tiktoken.load
    import tokenizers
except ImportError as e:
    sys.exit(f"{e}: run scripts/setup.sh, which installs sentencepiece, tiktoken and tokenizers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fetch_tokenizers import LLAMA3_PATTERN, llama3_specials  # noqa: E402

HARD = [
    # Unicode: accents (composed and combining), CJK, scripts with marks, emoji sequences
    "héllo wörld — naïve café", "e\u0301 combining vs \u00e9", "日本語のテキストと漢字", "中文，标点。",
    "한국어 텍스트", "Привет, мир! ЁЖИК", "Ελληνικά κείμενα", "مرحبا بالعالم", "हिन्दी पाठ क्षत्रिय",
    "👩‍👩‍👧‍👦 family, 🇫🇷 flag, 👍🏽 thumbs", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝟙𝟚𝟛", "\ufeffBOM at start", "zero\u200bwidth\u200djoiner",
    # whitespace runs
    "", " ", "  ", "\t", "\n", "\n\n\n", "a  b   c    d", "  leading", "trailing   ", "tab\tsep\t\tx",
    "line\r\nwindows\r\n", "mixed \t \n \r\n  end", "\u00a0nbsp\u00a0\u00a0x", "ideographic\u3000space",
    "mongolian\u180evowel", "en\u2002em\u2003thin\u2009", "line\u2028para\u2029sep", "nel\u0085next",
    " " * 40 + "x", "\n" * 17, "x" + " " * 33,
    # digits
    "1234567890", "3.14159265358979", "1,000,000.00", "٣٤٥٦ Arabic-Indic", "①②③ circled", "x2y33z444w5555",
    "0x7fffffff 0b1010 1e-12", "2026-11-23T08:43:44Z",
    # code
    "def f(x):\n    return x ** 2  # square\n", "int main() { return 0; }\n",
    "for (size_t i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n", "SELECT * FROM t WHERE id = 42;",
    "<div class=\"x\">&amp;</div>", "a->b && c || !d; x <<= 2;", "    \n        indented\n",
    "https://example.org/path?q=1&r=2#frag", "{\"key\": [1, 2, {\"n\": null}]}",
    # special-token look-alikes (must stay text)
    "<s>", "</s>", "<unk>", "<s> hello </s>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
    "<|endoftext|>", "text<|endoftext|>more", "[INST] hi [/INST]", "<|reserved_special_token_5|>", "<|im_start|>",
    # contractions and case
    "I'M DON'T we'll they'd you're it's", "'s 't 're", "O'Neil's", "ſ's long s", "KELVIN \u212a",
    "ALL CAPS SHOUTING", "camelCaseIdentifier snake_case_name",
    # long runs (the heap merge path)
    "a" * 300, "ab" * 150, "9" * 50, "=" * 80, "é" * 70,
    base64.b64encode(bytes(range(256)) * 2).decode(),
]
INVALID = [
    b"\xff\xfe", b"abc\x80def", b"\xe2\x82", b"\xe2\x82 euro", b"\xc0\xaf overlong", b"\xed\xa0\x80 surrogate",
    b"\xf4\x90\x80\x80 too big", b"\xf0\x9f\x98 cut emoji", b"ok \xf0\x9f\x98\x80 ok", b"\xc3\x28 bad cont",
    b"\xe0\x80\x80", b"\xa0\xa1", b"latin-1 caf\xe9", b"\xf8\x88\x80\x80\x80", b"\xe1\x80\xe2\xf0\x91\x92\xf1\xbf\x41",
]

# Seeded mixtures of the pieces above: many more boundaries between them.
rng = random.Random(20261123)
pieces = [h for h in HARD if h and len(h) < 60]
MIXED = []
for _ in range(150):
    k = rng.randint(2, 6)
    MIXED.append("".join(rng.choice(pieces) + rng.choice(["", " ", "\n", "  ", "\t"]) for _ in range(k)))

# Real text: Loom's own docs, a paragraph at a time.
DOCS = []
for rel in ("README.md", "docs/ARCHITECTURE.md"):
    path = os.path.join(REPO, rel)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            DOCS.extend(p for p in f.read().split("\n\n")[:60] if p.strip())

cases = [s.encode("utf-8") for s in HARD + MIXED + DOCS] + INVALID

sp = sentencepiece.SentencePieceProcessor(model_file=FILES["sentencepiece"])
ranks = tiktoken.load.load_tiktoken_bpe(FILES["tiktoken"])
specials = {t: len(ranks) + i for i, t in enumerate(llama3_specials())}
tk = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
hf = {}
for key in ("hf_llama3", "hf_gpt2"):
    t = tokenizers.Tokenizer.from_file(FILES[key])
    t.encode_special_tokens = True
    hf[key] = t

out = {"versions": {"sentencepiece": sentencepiece.__version__, "tiktoken": tiktoken.__version__,
                    "tokenizers": tokenizers.__version__},
       "files": FILES,
       "special": {"sentencepiece": {"vocab": sp.get_piece_size(), "bos": sp.bos_id(), "eos": sp.eos_id()},
                   "tiktoken": {"vocab": len(ranks) + len(specials), "bos": specials["<|begin_of_text|>"],
                                "eos": specials["<|end_of_text|>"]}},
       "cases": []}
for raw in cases:
    text = raw.decode("utf-8", "replace")
    out["cases"].append({
        "bytes": base64.b64encode(raw).decode(),
        "text": base64.b64encode(text.encode("utf-8")).decode(),
        "sentencepiece": sp.encode(text),
        "tiktoken": tk.encode(text, allowed_special=set(), disallowed_special=()),
        "hf_llama3": hf["hf_llama3"].encode(text, add_special_tokens=False).ids,
        "hf_gpt2": hf["hf_gpt2"].encode(text, add_special_tokens=False).ids,
    })
os.makedirs(os.path.dirname(os.path.abspath(OUT)), exist_ok=True)
with open(OUT + ".tmp", "w") as f:
    json.dump(out, f)
os.replace(OUT + ".tmp", OUT)
print(f"{len(out['cases'])} cases -> {OUT}")
