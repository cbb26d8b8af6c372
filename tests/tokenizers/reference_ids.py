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
# More of each class: NUL and control bytes, BOM in the middle, unicode
# apostrophes, digits of every script and width, CR/LF/tab runs, keycap and
# flag emoji, stacked combining marks, noncharacters and private use, and long
# single words and whitespace runs (the heap merge path and the regex engine's
# lookahead over long runs).
HARD += [
    "\x00", "a\x00b", "\x00\x00 \x00", "nul at end\x00", "\x01\x02\x1f\x7f controls", "bell\x07 esc\x1b[0m",
    "mid\ufeffdle BOM", "\ufeff", "\ufeff\ufeff", "don\u2019t it\u2019s I\u2019M we\u2019ll", "\u02bcs \uff07s",
    "1234567890123456789012345", "a1b22c333d4444e55555", "１２３４５６ fullwidth", "ⅰⅱⅲ Ⅻ", "x² y³ ½ ¾",
    "٠١٢٣٤٥٦٧٨٩٠", "۱۲۳۴ Persian", "१२३४५ Devanagari", "12 345 678", "-1.5e+10", "$1,234.56",
    "\r", "\r\r\n\n", "a\r\n\r\nb", " \r\n x", "\r\n" * 9, "\t" * 12, "\t \t \t", "x\t\t\t\ty", "   \n\t  ",
    " \n", "\n ", "  \n  \n", "a \n b", "a\n\n b", "a \r\n\t b", "\v\f vertical tab and form feed",
    "1\ufe0f\u20e3 keycap", "🏳\ufe0f\u200d🌈 rainbow", "🧑🏿\u200d🤝\u200d🧑🏻", "🇯🇵🇺🇸🇩🇪", "😀😃😄😁" * 5,
    "a\u0300\u0301\u0302\u0303\u0304", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319",
    "\uffff\ufffe \U0010ffff", "\ue000\uf8ff private", "\ufffd literal replacement", "\u00ad soft\u00adhyphen",
    "ภาษาไทยไม่มีช่องว่าง", "עִבְרִית", "தமிழ்", "ქართული", "Հայերեն", "አማርኛ", "∀x∈ℝ: x²≥0 ⇒ ∑", "┌─┐│└┘ box",
    "<s><s></s></s>", "<<|begin_of_text|>>", "<|begin_of_text|><|end_of_text|>", "<|begin_of_text|> text",
    "<unk><pad><mask>", "<0x0A> byte piece", "a\\Eb\\E. c \\Q x \\ xx\\\\E.y", "C:\\Path\\E.txt", "xxaxx bx\\E.x", "▁ lower one eighth block ▁▁x", "<|endoftext|><|endoftext|>",
    "x" * 5000, " " * 3000 + "y", "\n" * 1000, "7" * 1000, "supercalifragilistic" * 60, "ü" * 800,
    "\t" * 500 + "z", "a b" * 700, ("lorem ipsum " * 400).strip(),
]
# Seeded random strings drawn from a pool of every class above, so the
# boundaries between classes are not only the ones written by hand.
_pool = (list("abcXYZ019 .,'-_") + [" ", "  ", "\t", "\n", "\r\n", "\r", "\x00", "\u00a0", "\u3000", "\u2019",
         "é", "e\u0301", "ß", "ſ", "İ", "ı", "K", "\u212a", "日", "本", "한", "ф", "Ω", "ع", "क्ष", "๑", "٣", "²", "Ⅻ",
         "👍", "🏽", "\u200d", "\ufe0f", "🇫", "\ufeff", "\u200b", "<s>", "</s>", "<|eot_id|>", "'s", "'LL", "\u0085",
         "\u2028", "\u180e", "\U0001d7d9", "\ufffd", "{", "}", "==", "->", "//", "#"])
rng_chars = random.Random(424242)
RANDOM = ["".join(rng_chars.choice(_pool) for _ in range(rng_chars.randint(1, 40))) for _ in range(300)]

INVALID = [
    b"\xff\xfe", b"abc\x80def", b"\xe2\x82", b"\xe2\x82 euro", b"\xc0\xaf overlong", b"\xed\xa0\x80 surrogate",
    b"\xf4\x90\x80\x80 too big", b"\xf0\x9f\x98 cut emoji", b"ok \xf0\x9f\x98\x80 ok", b"\xc3\x28 bad cont",
    b"\xe0\x80\x80", b"\xa0\xa1", b"latin-1 caf\xe9", b"\xf8\x88\x80\x80\x80", b"\xe1\x80\xe2\xf0\x91\x92\xf1\xbf\x41",
    b"\xef\xbb\xbf utf-8 BOM bytes", b"\x00\xff\x00", b"x\xc2", b"\xf0\x9f\x98", b"\xe2\x80\xa8\xc2\x85 \xfe\xff",
    b"\xed\xbf\xbf\xee\x80\x80", b"\xf4\x8f\xbf\xbf ok max", b"\x80" * 20, b"caf\xe9 " * 50,
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

cases = [s.encode("utf-8") for s in HARD + MIXED + RANDOM + DOCS] + INVALID

sp = sentencepiece.SentencePieceProcessor(model_file=FILES["sentencepiece"])
ranks = tiktoken.load.load_tiktoken_bpe(FILES["tiktoken"])
specials = {t: len(ranks) + i for i, t in enumerate(llama3_specials())}
tk = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)

# Variants of the GPT-2-style tokenizer.json a user may bring, written beside
# OUT (variants/NAME/tokenizer.json): the same vocabulary with another
# pre-tokenizer layout or added tokens, each compared with `tokenizers` too.
with open(FILES["hf_gpt2"], encoding="utf-8") as f:
    GPT2 = json.load(f)


def variant(edit):
    j = json.loads(json.dumps(GPT2))
    edit(j)
    return j


def added(content, i, special=False):
    # The id a hand edit might write; `tokenizers` ignores it on load (the
    # vocabulary's id for a content it holds, else the next free one), and
    # so must Loom: written_by_tokenizers() gives the ids it would write.
    return {"id": len(GPT2["model"]["vocab"]) + i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": not special, "special": special}


def written_by_tokenizers(j):
    j = json.loads(tokenizers.Tokenizer.from_str(json.dumps(j)).to_str())
    return j


VARIANTS = {
    # RoBERTa-style: a space before the text (and, in `tokenizers`, before every piece between added tokens).
    "prefix_space": lambda j: j["pre_tokenizer"].update(add_prefix_space=True),
    # Non-special added tokens are cut out of the text before the pre-tokenizer; special ones stay text.
    "added_tokens": lambda j: j.update(written_by_tokenizers(variant(lambda k: k["added_tokens"].extend(
        [added("<tag>", 0), added("Loom", 1), added(" the", 2), added("<tag>s", 3), added("<|im_start|>", 4, True)])))),
    # The same, with the ids as written by hand ("Loom" is in model.vocab at another id).
    "added_tokens_hand_ids": lambda j: j["added_tokens"].extend(
        [added("<tag>", 0), added("Loom", 1), added(" the", 2), added("<tag>s", 3), added("<|im_start|>", 4, True)]),
    "added_tokens_prefix_space": lambda j: (j["pre_tokenizer"].update(add_prefix_space=True),
                                            j["added_tokens"].extend([added("<tag>", 0), added("\n", 1)])),
    # A word that is a token is that token, merges or not.
    "ignore_merges": lambda j: j["model"].update(ignore_merges=True),
    # A Sequence: a literal Split (Isolated) before a ByteLevel without its own regex.
    "split_string": lambda j: j.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": " "}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}),
    "sequence_of_one": lambda j: j.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [GPT2["pre_tokenizer"]]}),
    # Code models add whitespace runs as (non-special) added tokens: dozens of them.
    "many_added_whitespace": lambda j: j.update(written_by_tokenizers(variant(lambda k: k["added_tokens"].extend(
        [added(" " * n, n) for n in range(2, 32)] + [added("\t" * n, 30 + n) for n in range(1, 10)])))),
    # A literal Split holding regex syntax ("\E" ends a \Q...\E quote), and a regex that matches the empty string.
    "split_string_backslash": lambda j: j.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": "\\E."}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}),
    "split_empty_matches": lambda j: j.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "x*"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}),
}
VARIANT_DIR = os.path.join(os.path.dirname(os.path.abspath(OUT)), "variants")
for name, edit in VARIANTS.items():
    path = os.path.join(VARIANT_DIR, name, "tokenizer.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(variant(edit), f)
    FILES["variant_" + name] = path

# SentencePiece BPE models of other settings, trained here on Loom's README
# (seconds): without byte fallback (unknown characters become <unk>), and with
# byte fallback but no dummy prefix.
# Models loom's BPE path cannot reproduce word by word -- user-defined symbols,
# pieces across a word start -- must go to the library (the expected engine).
SP_VARIANTS = {
    "sp_no_byte_fallback": dict(vocab_size=400, byte_fallback=False),
    "sp_no_dummy_prefix": dict(vocab_size=600, byte_fallback=True, add_dummy_prefix=False, character_coverage=0.99),
    "sp_user_symbols": dict(vocab_size=500, byte_fallback=True, user_defined_symbols=["<tag>", "Loom", "\n"]),
    "sp_pieces_across_words": dict(vocab_size=700, byte_fallback=True, split_by_whitespace=False),
}
SP_ENGINES = {"sp_no_byte_fallback": "loom-bpe", "sp_no_dummy_prefix": "loom-bpe", "sp_user_symbols": "libsentencepiece",
              "sp_pieces_across_words": "libsentencepiece"}
sps = {}
for name, kw in SP_VARIANTS.items():
    prefix = os.path.join(VARIANT_DIR, name, "tokenizer")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(input=os.path.join(REPO, "README.md"), model_prefix=prefix, model_type="bpe",
                                             normalization_rule_name="identity", remove_extra_whitespaces=False,
                                             minloglevel=2, num_threads=1, **kw)
    sps[name] = sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")

hf = {}
for key in ["hf_llama3", "hf_gpt2"] + ["variant_" + n for n in VARIANTS]:
    t = tokenizers.Tokenizer.from_file(FILES[key])
    t.encode_special_tokens = True
    hf[key] = t

out = {"versions": {"sentencepiece": sentencepiece.__version__, "tiktoken": tiktoken.__version__,
                    "tokenizers": tokenizers.__version__},
       "files": FILES,
       "variants": sorted(VARIANTS),
       "sp_variants": SP_ENGINES,
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
        **{"variant_" + n: hf["variant_" + n].encode(text, add_special_tokens=False).ids for n in VARIANTS},
        **{"variant_" + n: sps[n].encode(text) for n in SP_VARIANTS},
    })
os.makedirs(os.path.dirname(os.path.abspath(OUT)), exist_ok=True)
with open(OUT + ".tmp", "w") as f:
    json.dump(out, f)
os.replace(OUT + ".tmp", OUT)
print(f"{len(out['cases'])} cases -> {OUT}")
