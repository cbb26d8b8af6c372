// Real tokenizers for `loom prepare text` (loom/ops/tokenizer.hpp, core/src/ops/tokenizers): ids equal
// to the reference libraries' on hard strings, invalid UTF-8 handled as
// Python's decode("utf-8", "replace"), and prepare's shards, header vocabulary,
// 4-byte tokens and parallel output.
//
// The reference ids come from tests/tokenizers/reference_ids.py (a ctest
// fixture run before this suite) on files fetched by scripts/setup.sh; a
// missing file fails the suite, it does not skip it.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <tuple>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokens/tokens_data.hpp"
#include "loom/ops/tokenizer.hpp"
#include "ops/tokenizers/bpe.hpp"
#include "prepare_text.hpp"
#include "loom/error.hpp"
#include "loom/token_shard.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using loom::data::load_tokenizer;
using loom::data::Tokenizer;
using loom::test::expect_error;
using loom::test::TmpDir;

namespace {

const fs::path kFiles = fs::path(LOOM_SOURCE_DIR) / ".cache" / "tokenizers";
const fs::path kReference = fs::path(LOOM_BINARY_DIR) / "tokenizer_refs" / "reference.json";

std::string b64decode(const std::string& s) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    const int v = val(c);
    if (v < 0) break;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

const nlohmann::json& reference() {
  static nlohmann::json j = [] {
    std::ifstream in(kReference);
    if (!in) return nlohmann::json();
    return nlohmann::json::parse(in);
  }();
  return j;
}

std::string show(const Tokenizer& t, const std::vector<uint32_t>& ids) {
  std::string s;
  for (uint32_t id : ids) s += loom::cat(id, "'", t.piece(id), "' ");
  return s;
}

// Every case of the reference corpus, through one tokenizer.
void check_parity(const std::string& key, const fs::path& file, const loom::data::TokenizerOptions& opt = {},
                  const std::string& engine = "") {
  const auto& ref = reference();
  ASSERT_FALSE(ref.is_null()) << kReference << " is missing: the ctest fixture tokenizer_reference_ids writes it "
                              << "(python3 tests/tokenizers/reference_ids.py " << kFiles << " " << kReference << ")";
  ASSERT_TRUE(fs::exists(file)) << file << " is missing: run scripts/setup.sh";
  std::unique_ptr<Tokenizer> tok = load_tokenizer(file.string(), opt);
  if (!engine.empty()) EXPECT_EQ(tok->engine(), engine);
  int failures = 0, cases = 0;
  for (const auto& c : ref["cases"]) {
    const std::string text = b64decode(c["text"]);
    std::vector<uint32_t> got;
    tok->encode(text, got);
    const auto want = c[key].get<std::vector<uint32_t>>();
    ++cases;
    if (got != want && ++failures <= 5)
      ADD_FAILURE() << key << " differs from the reference on \"" << text << "\"\n  loom: " << show(*tok, got)
                    << "\n  ref:  " << show(*tok, want);
  }
  EXPECT_EQ(failures, 0) << failures << " of " << cases << " cases differ";
  EXPECT_GT(cases, 250);
}

}  // namespace

TEST(Utf8, ReplacementMatchesPythonOnEveryCase) {
  const auto& ref = reference();
  ASSERT_FALSE(ref.is_null()) << kReference << " is missing";
  int invalid = 0;
  for (const auto& c : ref["cases"]) {
    const std::string raw = b64decode(c["bytes"]), want = b64decode(c["text"]);
    std::string got;
    const std::size_t n = loom::data::sanitize_utf8(raw, got);
    EXPECT_EQ(got, want) << "bytes: " << raw;
    EXPECT_EQ(n > 0, raw != want);
    invalid += n > 0;
  }
  EXPECT_GE(invalid, 14);  // the corpus's invalid cases all needed repair
}

TEST(Utf8, MaximalSubparts) {
  std::string out;
  EXPECT_EQ(loom::data::sanitize_utf8("\xe2\x82 x", out), 1u);  // a truncated sequence is one U+FFFD
  EXPECT_EQ(out, "\xEF\xBF\xBD x");
  EXPECT_EQ(loom::data::sanitize_utf8("\xc0\xaf", out), 2u);  // C0 is never valid: each byte
  EXPECT_EQ(loom::data::sanitize_utf8("\xed\xa0\x80", out), 3u);  // a surrogate: ED then two lone continuations
  EXPECT_EQ(loom::data::sanitize_utf8("ok \xf0\x9f\x98\x80", out), 0u);
  EXPECT_EQ(out, "ok \xf0\x9f\x98\x80");
}

TEST(TokenizerParity, SentencePieceMistralMatchesSentencepiece) {
  // Loom's BPE path for SentencePiece BPE models...
  check_parity("sentencepiece", kFiles / "mistral" / "tokenizer.model", {}, "loom-bpe");
}

TEST(TokenizerParity, SentencePieceThroughTheLibraryMatchesToo) {
  // ...and libsentencepiece itself, which encodes every other model.
  loom::data::TokenizerOptions lib;
  lib.sentencepiece_library = true;
  check_parity("sentencepiece", kFiles / "mistral" / "tokenizer.model", lib, "libsentencepiece");
}

TEST(TokenizerParity, Llama3TiktokenMatchesTiktoken) { check_parity("tiktoken", kFiles / "llama3" / "tokenizer.model"); }

TEST(TokenizerParity, Llama3TokenizerJsonMatchesTokenizers) {
  check_parity("hf_llama3", kFiles / "llama3-hf" / "tokenizer.json");
}

TEST(TokenizerParity, Gpt2StyleTokenizerJsonMatchesTokenizers) {
  check_parity("hf_gpt2", kFiles / "gpt2-hf" / "tokenizer.json");
}

// The tokenizer.json layouts a user may bring besides the two files above:
// add_prefix_space, non-special added tokens (with and without a prefix
// space), ignore_merges, a literal Split in a Sequence, a Sequence of one.
// reference_ids.py writes each beside the reference ids.
TEST(TokenizerParity, TokenizerJsonVariantsMatchTokenizers) {
  const auto& ref = reference();
  ASSERT_FALSE(ref.is_null()) << kReference << " is missing";
  ASSERT_TRUE(ref.contains("variants"));
  int n = 0;
  for (const auto& name : ref["variants"]) {
    SCOPED_TRACE(name.get<std::string>());
    check_parity("variant_" + name.get<std::string>(), kReference.parent_path() / "variants" /
                                                           name.get<std::string>() / "tokenizer.json");
    ++n;
  }
  EXPECT_GE(n, 6);
}

// SentencePiece BPE models of other settings (trained by reference_ids.py):
// without byte fallback, where a run of unknown characters is one <unk>,
// without a dummy prefix, with user-defined symbols, with pieces across word
// starts; through loom's BPE path where it applies and through the library.
TEST(TokenizerParity, SentencePieceVariantsMatchSentencepiece) {
  const auto& ref = reference();
  ASSERT_FALSE(ref.is_null()) << kReference << " is missing";
  ASSERT_TRUE(ref.contains("sp_variants"));
  loom::data::TokenizerOptions lib;
  lib.sentencepiece_library = true;
  for (const auto& [name, engine] : ref["sp_variants"].items()) {
    SCOPED_TRACE(name);
    const fs::path file = kReference.parent_path() / "variants" / name / "tokenizer.model";
    check_parity("variant_" + name, file, {}, engine.get<std::string>());
    check_parity("variant_" + name, file, lib, "libsentencepiece");
  }
  EXPECT_GE(ref["sp_variants"].size(), 4u);
}

// Added tokens are found in time linear in the text: a large document with
// dozens of whitespace added tokens costs a small multiple of the plain
// tokenizer's time (searching every token again after each match made it
// minutes on 1 MB, over a thousand times the plain time).
TEST(TokenizerParity, ManyAddedTokensStayLinearInTheText) {
  const fs::path many = kReference.parent_path() / "variants" / "many_added_whitespace" / "tokenizer.json";
  ASSERT_TRUE(fs::exists(many)) << many << " is missing: reference_ids.py writes it";
  auto with = load_tokenizer(many.string());
  auto plain = load_tokenizer((kFiles / "gpt2-hf" / "tokenizer.json").string());
  std::string text;
  for (int i = 0; text.size() < (1u << 18); ++i)
    text += loom::cat("    def f", i, "(x):\n\t\treturn  x  +   ", i, "\n        pass\n");
  // The best of three, so a busy machine does not decide the ratio.
  auto seconds = [&](const Tokenizer& t) {
    double best = 1e9;
    for (int r = 0; r < 3; ++r) {
      std::vector<uint32_t> ids;
      const auto t0 = std::chrono::steady_clock::now();
      t.encode(text, ids);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  const double a = seconds(*plain), b = seconds(*with);
  EXPECT_LT(b, 10 * a + 0.05) << "added tokens: " << b << " s, plain: " << a << " s on 256 KB";
}

TEST(TokenizerParity, SpecialTokensComeFromTheTokenizer) {
  const auto& ref = reference();
  ASSERT_FALSE(ref.is_null());
  auto sp = load_tokenizer((kFiles / "mistral" / "tokenizer.model").string());
  EXPECT_EQ(sp->kind(), "sentencepiece");
  EXPECT_EQ(sp->vocab_size(), ref["special"]["sentencepiece"]["vocab"].get<uint32_t>());
  EXPECT_EQ(sp->bos(), ref["special"]["sentencepiece"]["bos"].get<uint32_t>());
  EXPECT_EQ(sp->eos(), ref["special"]["sentencepiece"]["eos"].get<uint32_t>());
  auto tt = load_tokenizer((kFiles / "llama3" / "tokenizer.model").string());
  EXPECT_EQ(tt->kind(), "tiktoken");
  EXPECT_EQ(tt->vocab_size(), 128256u);
  EXPECT_EQ(tt->bos(), 128000u);
  EXPECT_EQ(tt->eos(), 128001u);
  EXPECT_EQ(tt->piece(128009), "<|eot_id|>");
  auto hf = load_tokenizer((kFiles / "llama3-hf" / "tokenizer.json").string());
  EXPECT_EQ(hf->kind(), "hf-bpe");
  EXPECT_EQ(hf->vocab_size(), 128256u);
  EXPECT_EQ(hf->bos(), 128000u);  // from the post-processor's template
  EXPECT_EQ(hf->eos(), 128001u);  // by its usual name
  auto gpt2 = load_tokenizer((kFiles / "gpt2-hf" / "tokenizer.json").string());
  EXPECT_EQ(gpt2->bos(), 0u);  // <|endoftext|> is both
  EXPECT_EQ(gpt2->eos(), 0u);
  // Overrides name tokens of the file.
  auto eot = load_tokenizer((kFiles / "llama3" / "tokenizer.model").string(), {"", "<|eot_id|>"});
  EXPECT_EQ(eot->eos(), 128009u);
  expect_error([&] { load_tokenizer((kFiles / "llama3" / "tokenizer.model").string(), {"<|nope|>", ""}); },
               {"--bos '<|nope|>'", "not a special token"});
  expect_error([&] { load_tokenizer((kFiles / "mistral" / "tokenizer.model").string(), {"", "<nope>"}); },
               {"--eos '<nope>'", "not a piece"});
}

TEST(TokenizerParity, EncodingIsThreadSafe) {
  auto tok = load_tokenizer((kFiles / "llama3" / "tokenizer.model").string());
  std::string text;
  for (int i = 0; i < 200; ++i) text += loom::cat("word", i, " ünïcode ", i * 7919, "\n");
  std::vector<uint32_t> want;
  tok->encode(text, want);
  std::vector<std::vector<uint32_t>> got(4);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      for (int r = 0; r < 20; ++r) {
        got[t].clear();
        tok->encode(text, got[t]);
      }
    });
  for (auto& t : ts) t.join();
  for (auto& g : got) EXPECT_EQ(g, want);
}

TEST(Tokenizers, BadFilesAreRefusedByName) {
  TmpDir d;
  auto write = [&](const std::string& name, const std::string& bytes) {
    const std::string p = (d.path / name).string();
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  };
  expect_error([&] { load_tokenizer((d.path / "none.model").string()); }, {"none.model", "cannot read tokenizer"});
  expect_error([&] { load_tokenizer(write("empty", "")); }, {"empty", "is empty"});
  expect_error([&] { load_tokenizer(write("junk.bin", "\x01\x02junk")); }, {"junk.bin", "none of the formats"});
  expect_error([&] { load_tokenizer(write("bad.json", "{ not json")); }, {"bad.json", "not valid JSON"});
  expect_error([&] { load_tokenizer(write("wp.json", R"({"model": {"type": "WordPiece", "vocab": {}}})")); },
               {"wp.json", "model.type is \"WordPiece\"", "byte-level BPE"});
  expect_error(
      [&] {
        load_tokenizer(write("nfc.json", R"({"normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "ByteLevel"},
                                            "model": {"type": "BPE", "vocab": {}, "merges": []}})"));
      },
      {"nfc.json", "normalizer \"NFC\" is not supported"});
  expect_error([&] { load_tokenizer(write("small.tiktoken", "IQ== 0\nIg== 1\n")); },
               {"small.tiktoken", "has 2 ranks", "Llama 3"});
  expect_error([&] { load_tokenizer(write("gap.tiktoken", "IQ== 0\nIg== 2\n")); }, {"gap.tiktoken", "no token of rank 1"});
  expect_error([&] { load_tokenizer(write("dup.tiktoken", "IQ== 0\nIg== 0\n")); }, {"dup.tiktoken", "rank 0 is given twice"});
  expect_error([&] { load_tokenizer(write("trunc.model", "\x0a\x20\x0a\x05<unk>")); },
               {"trunc.model", "SentencePiece", "cannot load"});
  // A directory (which opens as a stream and fails on read) is named, with the file inside it.
  fs::create_directories(d.path / "tokdir");
  std::ofstream(d.path / "tokdir" / "tokenizer.json") << "{}";
  expect_error([&] { load_tokenizer((d.path / "tokdir").string()); },
               {"tokdir' is a directory", "--tokenizer " + (d.path / "tokdir" / "tokenizer.json").string()});
  expect_error([&] { load_tokenizer(write("array.json", "[1, 2]")); }, {"array.json", "JSON but not an object"});
  // A Unigram tokenizer.json without model.type, and ids that would size the piece table.
  expect_error([&] { load_tokenizer(write("uni.json", R"({"model": {"vocab": [["a", 0.0]]}, "pre_tokenizer": null})")); },
               {"uni.json", "Unigram", "byte-level BPE"});
  expect_error(
      [&] {
        load_tokenizer(write("negid.json", R"({"pre_tokenizer": {"type": "ByteLevel"},
                                               "model": {"type": "BPE", "vocab": {"a": -5}, "merges": []}})"));
      },
      {"negid.json", "gives \"a\" the id -5"});
  expect_error(
      [&] {
        load_tokenizer(write("hugeid.json", R"({"pre_tokenizer": {"type": "ByteLevel"},
                                                "model": {"type": "BPE", "vocab": {"a": 4000000000}, "merges": []}})"));
      },
      {"hugeid.json", "the id 4000000000"});
  // A tiktoken file cut mid-line says it looks truncated, whatever the cut line parses to.
  expect_error([&] { load_tokenizer(write("cut.tiktoken", "IQ== 0\nIg== 1\nIw== 2\nJA== 1")); },
               {"cut.tiktoken", "line 4", "rank 1 is given twice", "looks truncated"});
  expect_error([&] { load_tokenizer(write("cut2.tiktoken", "IQ== 0\nIg== 1\nIw")); },
               {"cut2.tiktoken", "line 3", "looks truncated"});
  // A byte-level vocabulary without every byte.
  expect_error(
      [&] {
        load_tokenizer(write("nobytes.json", R"({"pre_tokenizer": {"type": "ByteLevel"},
                                                 "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})"));
      },
      {"nobytes.json", "no token for the byte 0x00"});
}

// A tokenizer path is read as every file a user names: a regular file
// (symlinks followed) of bounded size. A FIFO (which would block the open for
// ever), a device (/dev/zero never ends) or a file of many GB is refused at
// once, naming the path; so is a tokenizer_config.json beside a tokenizer.json
// that is one of those.
TEST(Tokenizers, TokenizerFilesThatAreNotRegularOrHugeAreRefusedAtOnce) {
  TmpDir d;
  const std::string fifo = (d.path / "tok.json").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  expect_error([&] { load_tokenizer(fifo); }, {"tokenizer '" + fifo + "' is a FIFO (named pipe), not a regular file"});
  fs::create_symlink(fifo, d.path / "link.json");
  expect_error([&] { load_tokenizer((d.path / "link.json").string()); }, {"link.json", "is a FIFO"});
  expect_error([&] { load_tokenizer("/dev/zero"); }, {"tokenizer '/dev/zero' is a character device"});
  // A sparse file of 4 GiB: refused from its size, before anything is read.
  const std::string huge = (d.path / "huge.model").string();
  std::ofstream(huge).close();
  fs::resize_file(huge, uintmax_t{4} << 30);
  const auto t0 = std::chrono::steady_clock::now();
  expect_error([&] { load_tokenizer(huge); }, {"tokenizer '" + huge + "' is larger than 1024 MiB"});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  // tokenizer_config.json beside a tokenizer.json (read for BOS and EOS).
  const fs::path src = kFiles / "gpt2-hf" / "tokenizer.json";
  ASSERT_TRUE(fs::exists(src)) << src << " is missing: run scripts/setup.sh";
  fs::create_directories(d.path / "hf");
  fs::copy_file(src, d.path / "hf" / "tokenizer.json");
  const std::string cfg = (d.path / "hf" / "tokenizer_config.json").string();
  ASSERT_EQ(::mkfifo(cfg.c_str(), 0644), 0);
  expect_error([&] { load_tokenizer((d.path / "hf" / "tokenizer.json").string()); },
               {"tokenizer_config.json (read for bos_token/eos_token) '" + cfg + "' is a FIFO"});
  fs::remove(cfg);
  fs::create_symlink("/dev/zero", cfg);
  expect_error([&] { load_tokenizer((d.path / "hf" / "tokenizer.json").string()); }, {cfg, "is a character device"});
  fs::remove(cfg);
  EXPECT_NO_THROW(load_tokenizer((d.path / "hf" / "tokenizer.json").string()));
}

// Two tokens with one id encode to the same id: an HF tokenizer.json whose
// model.vocab does that, or whose added token gets (as the tokenizers library
// gives it) an id model.vocab already gives another token, is damaged and
// refused naming the file, the id and both tokens.
TEST(Tokenizers, TokenizerJsonWithTwoTokensOfOneIdIsRefused) {
  TmpDir d;
  const fs::path src = kFiles / "gpt2-hf" / "tokenizer.json";
  ASSERT_TRUE(fs::exists(src)) << src << " is missing: run scripts/setup.sh";
  const nlohmann::json good = nlohmann::json::parse(std::ifstream(src));
  auto write = [&](const std::string& name, const nlohmann::json& j) {
    const std::string p = (d.path / name).string();
    std::ofstream(p) << j.dump();
    return p;
  };
  nlohmann::json dup = good;
  dup["model"]["vocab"]["!"] = dup["model"]["vocab"]["\""];
  const std::string id = dup["model"]["vocab"]["!"].dump();
  expect_error([&] { load_tokenizer(write("dup.json", dup)); },
               {"dup.json", "model.vocab gives \"!\" and \"\\\"\" the same id " + id, "damaged"});
  // A gap in model.vocab's ids: "ĠThe" moved to the id after the vocabulary's
  // size, which a new added token then also gets.
  nlohmann::json gap = good;
  const auto size = gap["model"]["vocab"].size();
  gap["model"]["vocab"]["\u0120The"] = size;
  gap["added_tokens"].push_back({{"id", size}, {"content", "<new>"}, {"special", true}, {"single_word", false},
                                 {"lstrip", false}, {"rstrip", false}, {"normalized", false}});
  expect_error([&] { load_tokenizer(write("gap.json", gap)); },
               {"gap.json", "added token \"<new>\" gets id " + std::to_string(size),
                "which model.vocab already gives \"\u0120The\""});
  EXPECT_NO_THROW(load_tokenizer(write("good.json", good)));
}

// A tiktoken file whose first line is damaged gets the same exact message as
// one damaged further on (not "none of the formats loom reads"); a file that
// is not tiktoken after its first line either is still none of the formats.
TEST(Tokenizers, TiktokenWithADamagedFirstLineNamesTheLine) {
  TmpDir d;
  auto write = [&](const std::string& name, const std::string& bytes) {
    const std::string p = (d.path / name).string();
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  };
  const std::string rest = "Ig== 1\nIw== 2\nJA== 3\n";
  expect_error([&] { load_tokenizer(write("first.tiktoken", "IQ==0\n" + rest)); },
               {"tiktoken file '", "first.tiktoken' line 1 is not \"<base64 token> <rank>\": 'IQ==0'"});
  expect_error([&] { load_tokenizer(write("first2.tiktoken", "I!== 0\n" + rest)); }, {"line 1", "'I!== 0'"});
  expect_error([&] { load_tokenizer(write("second.tiktoken", "IQ== 0\nIg==1\nIw== 2\n")); },
               {"second.tiktoken' line 2 is not"});
  expect_error([&] { load_tokenizer(write("prose.txt", "hello there\nthis is text\n")); },
               {"prose.txt", "none of the formats"});
  expect_error([&] { load_tokenizer(write("one.txt", "IQ==0\nIg== 1\n")); }, {"one.txt", "none of the formats"});
}

namespace {

// Runs `load` in a child process whose address space may grow by at most
// `headroom` bytes past what it has: a loader that sized a table from a
// number in the file before checking it runs out there (std::bad_alloc),
// where the parent could not tell it from success. Returns the child's
// message ("" for none), or "bad_alloc" / "crash".
std::string load_with_memory_cap(const std::function<void()>& load, size_t headroom) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    size_t vm_kb = 0;
    std::ifstream st("/proc/self/status");
    for (std::string line; std::getline(st, line);)
      if (line.rfind("VmSize:", 0) == 0) vm_kb = std::stoull(line.substr(7));
    const rlimit lim{vm_kb * 1024 + headroom, vm_kb * 1024 + headroom};
    ::setrlimit(RLIMIT_AS, &lim);
    std::string msg;
    try {
      load();
    } catch (const std::bad_alloc&) {
      msg = "bad_alloc";
    } catch (const std::exception& e) {
      msg = e.what();
    }
    (void)!::write(fds[1], msg.data(), msg.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? out : "crash";
}

}  // namespace

// A tokenizer's sizes are checked before anything is sized from them: a
// tiktoken rank beyond the file's lines (10^9, 2^30 - 1, or one past the
// last), a file of more lines than the vocabulary loom reads, an HF
// tokenizer.json id beyond the tokens the file holds — each refused naming
// the file (and the line or the token), under a memory cap of 256 MiB that
// sizing a table from the number would exceed.
TEST(Tokenizers, SizesAreCheckedBeforeAnythingIsAllocated) {
  TmpDir d;
  auto write = [&](const std::string& name, const std::string& bytes) {
    const std::string p = (d.path / name).string();
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  };
  const size_t cap = size_t{256} << 20;
  for (const std::string rank : {"999999999", "1073741823", "3"}) {
    SCOPED_TRACE(rank);
    const std::string p = write("absurd" + rank + ".tiktoken", "IQ== 0\nIg== " + rank + "\nIw== 1\n");
    const std::string msg = load_with_memory_cap([&] { load_tokenizer(p); }, cap);
    for (const std::string part : {p, std::string("line 2 gives rank ") + rank, std::string("no token of rank 2"),
                                   std::string("one per line of its 3")})
      EXPECT_NE(msg.find(part), std::string::npos) << msg;
  }
  // Llama 3's real file with one absurd rank, far down.
  const fs::path llama3 = kFiles / "llama3" / "tokenizer.model";
  ASSERT_TRUE(fs::exists(llama3)) << llama3 << " is missing: run scripts/setup.sh";
  std::string text;
  {
    std::ifstream in(llama3, std::ios::binary);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  size_t line_start = 0;
  for (int l = 1; l < 5000; ++l) line_start = text.find('\n', line_start) + 1;
  const size_t sp = text.find(' ', line_start), eol = text.find('\n', line_start);
  std::string edited = text.substr(0, sp + 1) + "999999999" + text.substr(eol);
  const std::string big = write("llama3_absurd.model", edited);
  const std::string msg = load_with_memory_cap([&] { load_tokenizer(big); }, cap);
  EXPECT_NE(msg.find(big), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 5000 gives rank 999999999"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no token of rank 4999"), std::string::npos) << msg;
  // More token lines than Llama 3's ranks: refused before a table is made.
  const std::string more = write("more.model", text + "IQ== 128000\nIg== 128001\n");
  expect_error([&] { load_tokenizer(more); }, {more, "has 128002 token lines", "128000 ranks"});
  // HF: an id of 16 million in a vocabulary of 50257 (+ added tokens).
  const fs::path src = kFiles / "gpt2-hf" / "tokenizer.json";
  ASSERT_TRUE(fs::exists(src)) << src << " is missing: run scripts/setup.sh";
  nlohmann::json j = nlohmann::json::parse(std::ifstream(src));
  const size_t n = j["model"]["vocab"].size() + j["added_tokens"].size();
  for (const int64_t id : {int64_t{16777215}, static_cast<int64_t>(n)}) {
    SCOPED_TRACE(id);
    nlohmann::json bad = j;
    bad["model"]["vocab"]["\u0120The"] = id;
    const std::string p = write("hugeid" + std::to_string(id) + ".json", bad.dump());
    const std::string m = load_with_memory_cap([&] { load_tokenizer(p); }, cap);
    for (const std::string part : {p, "the id " + std::to_string(id), "ids are integers in [0, " + std::to_string(n) + ")",
                                   std::string("each with an id of its own")})
      EXPECT_NE(m.find(part), std::string::npos) << m;
  }
  // The unedited files load under the same cap.
  EXPECT_EQ(load_with_memory_cap([&] { load_tokenizer(src.string()); }, cap), "");
}

// A SentencePiece model the library loads but whose pieces loom's BPE path
// cannot rank or read (a NaN score, a byte piece that is not <0xHH>) is
// refused naming the file and the piece, not met deep inside (std::stoi,
// std::map::at).
TEST(Tokenizers, SentencePiecePiecesAreCheckedByName) {
  TmpDir d;
  const fs::path src = kFiles / "mistral" / "tokenizer.model";
  ASSERT_TRUE(fs::exists(src)) << src << " is missing: run scripts/setup.sh";
  std::string model;
  {
    std::ifstream in(src, std::ios::binary);
    model.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  // A normal piece's score (field 2, fixed32: tag 0x15) set to NaN, in place.
  const size_t piece = model.find(std::string("\x0a\x06") + "\xe2\x96\x81" + "the\x15");  // the piece "▁the", then its score
  ASSERT_NE(piece, std::string::npos);
  const size_t score = model.find('\x15', piece);
  ASSERT_LT(score, piece + 16);
  std::string nan_model = model;
  const uint32_t nan_bits = 0x7FC00000u;
  std::memcpy(&nan_model[score + 1], &nan_bits, 4);
  const std::string p1 = (d.path / "nan.model").string();
  std::ofstream(p1, std::ios::binary) << nan_model;
  expect_error([&] { load_tokenizer(p1); }, {p1, "('\xe2\x96\x81the')", "score nan", "finite scores"});
  // A byte piece "<0x41>" written as "<0xG1>".
  const size_t byte = model.find("<0x41>");
  ASSERT_NE(byte, std::string::npos);
  std::string bad_byte = model;
  bad_byte[byte + 3] = 'G';
  const std::string p2 = (d.path / "byte.model").string();
  std::ofstream(p2, std::ios::binary) << bad_byte;
  try {
    load_tokenizer(p2);
    ADD_FAILURE() << "a byte piece <0xG1> was taken";
  } catch (const loom::Error& e) {
    // Refused by the library when it loads the model, or by loom's path: named either way.
    const std::string m = e.what();
    EXPECT_NE(m.find(p2), std::string::npos) << m;
  }
}

// Input a pre-tokenizer regex gives up on (PCRE2's match limit) is an error
// naming the tokenizer file, and from `loom prepare`, the input file and the
// byte of it where the search that gave up started; never "pre-tokenizer
// regex failed at byte 0".
TEST(Tokenizers, InputTheRegexGivesUpOnNamesTheFilesAndTheByte) {
  TmpDir d;
  const fs::path src = kFiles / "gpt2-hf" / "tokenizer.json";
  ASSERT_TRUE(fs::exists(src)) << src << " is missing: run scripts/setup.sh";
  nlohmann::json j = nlohmann::json::parse(std::ifstream(src));
  // A Split whose pattern backtracks exponentially on a run of letters that
  // ends otherwise than it expects.
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"}, {"pattern", {{"Regex", "(?:\\w+\\s?)+$|\\s+|[^\\s\\w]+"}}},
                           {"behavior", "Isolated"}, {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                           {"use_regex", false}}}}};
  const std::string tok = (d.path / "tokenizer.json").string();
  std::ofstream(tok) << j.dump();
  const auto t = load_tokenizer(tok);
  std::vector<uint32_t> ids;
  EXPECT_NO_THROW(t->encode_document("fine text.", ids));
  const std::string bad = "ok. " + std::string(40, 'a') + " " + std::string(40, 'b') + "!";
  try {
    t->encode_document(bad, ids);
    ADD_FAILURE() << "the pattern did not give up";
  } catch (const loom::data::TokenizeInputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(tok), std::string::npos) << m;
    EXPECT_NE(m.find("match limit"), std::string::npos) << m;
    EXPECT_NE(m.find("byte " + std::to_string(e.offset) + " of the document"), std::string::npos) << m;
    EXPECT_LE(e.offset, bad.size());
  }
  // Through `loom prepare`: the input file and the byte in it.
  const fs::path in = d.path / "in.txt";
  const std::string first = "a first document.\n%\n";
  std::ofstream(in) << first << bad << "\n";
  loom::data::PrepareTextOptions opt;
  opt.inputs = {in.string()};
  opt.out_dir = (d.path / "out").string();
  opt.tokenizer = tok;
  opt.val_fraction = 0;
  opt.progress = false;
  try {
    loom::data::prepare_text(opt);
    ADD_FAILURE() << "prepare took it";
  } catch (const loom::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("input '" + in.string() + "' at byte "), std::string::npos) << m;
    EXPECT_NE(m.find("in the document that starts at byte " + std::to_string(first.size())), std::string::npos) << m;
    EXPECT_NE(m.find(tok), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(d.path / "out" / "prepare.json"));
}

TEST(Tokenizers, WhitespaceClassesAreUnicodeWhiteSpace) {
  using loom::data::rewrite_whitespace_classes;
  const std::string r = rewrite_whitespace_classes(R"(a\s+[^\s\p{L}]\S\\s)", "t");
  EXPECT_EQ(r.find("\\s"), r.rfind("\\s"));  // only the escaped backslash's "\\s" is left
  EXPECT_NE(r.find("[^\\t\\n"), std::string::npos);
  expect_error([] { rewrite_whitespace_classes(R"([\S])", "file.json"); }, {"file.json", "\\S inside a character class"});
  // U+180E is not White_Space (Unicode 6.3+): tiktoken and Oniguruma keep it out of \s, PCRE2 would not.
  loom::data::RegexSplitter sp(R"(\s+|\S+)", false, "t");
  std::vector<std::string> words;
  sp.split("a\xe1\xa0\x8e" "b \xe3\x80\x80" "c", [&](std::string_view w) { words.emplace_back(w); });
  EXPECT_EQ(words, (std::vector<std::string>{"a\xe1\xa0\x8e" "b", " \xe3\x80\x80", "c"}));
}

TEST(PrepareWithTokenizer, Llama3WritesFourByteShardsAndTrainingChecksTheVocabulary) {
  TmpDir d;
  fs::create_directories(d.path / "in");
  std::string corpus;
  for (int i = 0; i < 300; ++i) corpus += loom::cat("Document ", i, " says héllo to <|eot_id|> number ", i * 31, ".\n%\n");
  std::ofstream(d.path / "in" / "a.txt") << corpus;
  loom::data::PrepareTextOptions o;
  o.out_dir = (d.path / "out").string();
  o.inputs = {(d.path / "in").string()};
  o.tokenizer = (kFiles / "llama3" / "tokenizer.model").string();
  o.val_fraction = 0.1;
  o.shard_tokens = 2000;
  o.threads = 2;
  const auto r = loom::data::prepare_text(o);
  EXPECT_EQ(r.tokenizer, "tiktoken");
  EXPECT_EQ(r.vocab, 128256u);
  EXPECT_EQ(r.token_width, 4);
  ASSERT_GE(r.train_shards.size(), 2u);
  loom::TokenShard s(r.train_shards[0]);
  EXPECT_EQ(s.width(), 4);
  EXPECT_EQ(s.vocab(), 128256u);
  EXPECT_EQ(s[0], 128000u);  // BOS first
  // Every document is BOS ... EOS and the look-alike stayed text.
  uint64_t bos = 0, eos = 0, eot = 0;
  for (const auto& path : r.train_shards) {
    loom::TokenShard t(path);
    for (uint64_t i = 0; i < t.size(); ++i) {
      bos += t[i] == 128000u;
      eos += t[i] == 128001u;
      eot += t[i] == 128009u;
    }
  }
  EXPECT_EQ(bos, r.train_documents);
  EXPECT_EQ(eos, r.train_documents);
  EXPECT_EQ(eot, 0u);
  std::ifstream mf(r.manifest);
  const auto m = nlohmann::json::parse(mf);
  EXPECT_EQ(m["tokenizer"], "tiktoken");
  EXPECT_EQ(m["vocab"], 128256);
  EXPECT_EQ(m["token_width"], 4);
  EXPECT_EQ(m["bos"], 128000);
  EXPECT_EQ(m["eos"], 128001);

  // The same corpus on one thread gives the same bytes (output keeps document order).
  loom::data::PrepareTextOptions o1 = o;
  o1.out_dir = (d.path / "out1").string();
  o1.threads = 1;
  const auto r1 = loom::data::prepare_text(o1);
  ASSERT_EQ(r1.train_shards.size(), r.train_shards.size());
  for (std::size_t i = 0; i < r.train_shards.size(); ++i) {
    std::ifstream a(r.train_shards[i], std::ios::binary), b(r1.train_shards[i], std::ios::binary);
    EXPECT_TRUE(std::equal(std::istreambuf_iterator<char>(a), {}, std::istreambuf_iterator<char>(b))) << i;
  }

  // Training refuses a model whose vocab_size is smaller than the shards'.
  loom::data::TokensOptions to;
  to.train = {(d.path / "out" / "train_*.bin").string()};
  loom::plugins::TokensData src(loom::PluginInit{}, to);
  loom::DataSpec spec;
  spec.batch = 1;
  spec.seq_len = 16;
  spec.vocab_size = 32000;
  expect_error([&] { src.open(spec); }, {"vocabulary of 128256", "vocab_size = 32000", "model.vocab_size >= 128256"});
  spec.vocab_size = 128256;
  src.open(spec);
  EXPECT_EQ(src.vocab_hint(), 128256);
}

TEST(PrepareWithTokenizer, SentencePieceKeepsTwoByteTokensAndInvalidUtf8CanBeReplaced) {
  TmpDir d;
  fs::create_directories(d.path / "in");
  std::ofstream(d.path / "in" / "good.txt") << "Hello world\n%\nSecond document\n";
  std::ofstream(d.path / "in" / "latin1.txt", std::ios::binary) << "caf\xe9 au lait\n";
  loom::data::PrepareTextOptions o;
  o.out_dir = (d.path / "skip").string();
  o.inputs = {(d.path / "in").string()};
  o.tokenizer = (kFiles / "mistral" / "tokenizer.model").string();
  o.val_fraction = 0;
  auto r = loom::data::prepare_text(o);
  EXPECT_EQ(r.token_width, 2);
  EXPECT_EQ(r.vocab, 32000u);
  ASSERT_EQ(r.files_skipped.size(), 1u);  // skipped by default
  EXPECT_EQ(r.documents, 2u);
  o.out_dir = (d.path / "replace").string();
  o.replace_invalid_utf8 = true;
  r = loom::data::prepare_text(o);
  EXPECT_EQ(r.files_skipped.size(), 0u);
  EXPECT_EQ(r.documents, 3u);
  // The repaired document is what the tokenizer gives for "caf\uFFFD au lait".
  auto sp = load_tokenizer(o.tokenizer);
  std::vector<uint32_t> want;
  sp->encode_document("Hello world\n", want);
  sp->encode_document("Second document\n", want);
  sp->encode_document("caf\xEF\xBF\xBD au lait\n", want);
  loom::TokenShard s(r.train_shards.at(0));
  ASSERT_EQ(s.size(), want.size());
  for (uint64_t i = 0; i < s.size(); ++i) EXPECT_EQ(s[i], want[i]) << i;
}

TEST(PrepareWithTokenizer, CommandLine) {
  TmpDir d;
  fs::create_directories(d.path / "in");
  std::ofstream(d.path / "in" / "a.txt") << "One document.\n%\nAnother one, with ünïcode.\n";
  const std::string out = (d.path / "cmd.txt").string();
  auto run = [&](const std::string& args) {
    const int rc = std::system(loom::cat(LOOM_CLI, " prepare text ", args, " > ", out, " 2>&1").c_str());
    std::ifstream in(out);
    return std::make_pair(rc, std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
  };
  auto [rc, text] = run(loom::cat((d.path / "o").string(), " ", (d.path / "in").string(), " --tokenizer ",
                                  (kFiles / "mistral" / "tokenizer.model").string(), " --threads 2 --val-fraction 0"));
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("tokenizer: sentencepiece, vocab 32000, bos 1, eos 2, 2-byte tokens"), std::string::npos) << text;
  EXPECT_NE(text.find("MB/s"), std::string::npos) << text;
  std::tie(rc, text) = run(loom::cat((d.path / "p").string(), " ", (d.path / "in").string(), " --tokenizer ",
                                     (d.path / "missing.model").string()));
  EXPECT_NE(rc, 0);
  EXPECT_NE(text.find("missing.model"), std::string::npos) << text;
  std::tie(rc, text) = run(loom::cat((d.path / "q").string(), " ", (d.path / "in").string(), " --invalid-utf8 maybe"));
  EXPECT_NE(rc, 0);
  EXPECT_NE(text.find("--invalid-utf8 'maybe' is not one of: skip, replace"), std::string::npos) << text;
  std::tie(rc, text) = run(loom::cat((d.path / "r").string(), " ", (d.path / "in").string(), " --bos '<s>'"));
  EXPECT_NE(rc, 0);
  EXPECT_NE(text.find("byte-level tokenizer's are fixed"), std::string::npos) << text;
}
