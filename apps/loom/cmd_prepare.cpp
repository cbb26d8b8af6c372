// `loom prepare text OUT_DIR INPUT... [--tokenizer PATH] [--val-fraction F] [--shard-tokens N] [--seed S] [--force] ...`
#include <algorithm>
#include <cstdio>
#include <iterator>
#include <string>

#include "commands.hpp"
#include "prepare_text.hpp"
#include "loom/error.hpp"

namespace loom::app {
namespace {

const char* kUsage =
    "usage: loom prepare text OUT_DIR INPUT... [--tokenizer PATH] [--val-fraction F] [--shard-tokens N] [--seed S]\n"
    "                 [--threads N] [--invalid-utf8 skip|replace] [--bos TOKEN] [--eos TOKEN] [--force]\n"
    "  INPUT          UTF-8 text files or directories (recursed); other files are skipped with a warning\n"
    "  --tokenizer    a SentencePiece tokenizer.model (Llama 2, Mistral), a tiktoken file (Llama 3's\n"
    "                 tokenizer.model) or an HF tokenizer.json (byte-level BPE); default: bytes (vocab 258)\n"
    "  --threads      tokenizing threads (default 0 = every core)\n"
    "  --invalid-utf8 skip (default) files with invalid UTF-8, or replace each bad sequence by U+FFFD\n"
    "  --bos, --eos   token names overriding the tokenizer's own BOS/EOS\n"
    "  --val-fraction share of documents written to OUT_DIR/val.bin (default 0.05; 0 = none)\n"
    "  --shard-tokens tokens per train_NNN.bin shard, K/M/G suffixes allowed (default 16M)\n"
    "  --seed         seed of the train/val split (default 0)\n"
    "  --force        replace shards an earlier prepare left in OUT_DIR";

uint64_t parse_count(const std::string& flag, const std::string& v, const char* example) {
  std::size_t pos = 0;
  unsigned long long n = 0;
  try {
    if (v.empty() || v[0] == '-') throw std::invalid_argument("sign");
    n = std::stoull(v, &pos);
  } catch (const std::exception&) {
    throw Error(cat(flag, " '", v, "' is not a non-negative integer (e.g. ", flag, " ", example, ")"));
  }
  uint64_t mult = 1;
  if (pos < v.size()) {
    const std::string suffix = v.substr(pos);
    if (suffix == "K" || suffix == "k") mult = uint64_t{1} << 10;
    else if (suffix == "M" || suffix == "m") mult = uint64_t{1} << 20;
    else if (suffix == "G" || suffix == "g") mult = uint64_t{1} << 30;
    else throw Error(cat(flag, " '", v, "': unknown suffix '", suffix, "'; use K, M or G (powers of 1024) or none"));
  }
  if (n > UINT64_MAX / mult) throw Error(cat(flag, " '", v, "' is too large"));
  return n * mult;
}

double parse_fraction(const std::string& flag, const std::string& v) {
  std::size_t pos = 0;
  double f = 0;
  try {
    f = std::stod(v, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  if (pos == 0 || pos != v.size())
    throw Error(cat(flag, " '", v, "' is not a number; use a fraction in [0, 1), e.g. 0.05"));
  return f;
}

}  // namespace

int cmd_prepare(const Args& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::printf("%s\n", kUsage);
    return args.empty() ? 2 : 0;
  }
  if (args[0] != "text")
    throw Error(cat("unknown input kind '", args[0], "'; loom prepare supports: text (UTF-8 files -> byte tokens)\n",
                    kUsage));

  data::PrepareTextOptions opt;
  std::vector<std::string> positional;
  for (std::size_t i = 1; i < args.size(); ++i) {
    std::string a = args[i], value;
    const bool is_flag = a.starts_with("--");
    // An unknown option is named as such, not taken as one that needs a value.
    static const char* kValueFlags[] = {"--val-fraction", "--shard-tokens", "--seed", "--tokenizer", "--bos",
                                        "--eos", "--threads", "--invalid-utf8"};
    const std::string name = a.substr(0, a.find('='));
    if (is_flag && name != "--force" &&
        std::find(std::begin(kValueFlags), std::end(kValueFlags), name) == std::end(kValueFlags))
      throw Error(cat("unknown option '", name, "'\n", kUsage));
    if (is_flag && a != "--force") {
      const auto eq = a.find('=');
      if (eq != std::string::npos) {
        value = a.substr(eq + 1);
        a = a.substr(0, eq);
      } else {
        if (i + 1 >= args.size()) throw Error(cat(a, " needs a value\n", kUsage));
        value = args[++i];
      }
    }
    if (!is_flag) positional.push_back(a);
    else if (a == "--force") opt.force = true;
    else if (a == "--val-fraction") opt.val_fraction = parse_fraction(a, value);
    else if (a == "--shard-tokens") opt.shard_tokens = parse_count(a, value, "16M");
    else if (a == "--seed") opt.seed = parse_count(a, value, "1234");
    else if (a == "--tokenizer") opt.tokenizer = value;
    else if (a == "--bos") opt.bos = value;
    else if (a == "--eos") opt.eos = value;
    else if (a == "--threads") {
      const uint64_t t = parse_count(a, value, "8; 0 = every core");
      if (t > 4096) throw Error(cat("--threads ", value, " is out of range; use 0 (every core) to 4096"));
      opt.threads = static_cast<int>(t);
    } else if (a == "--invalid-utf8") {
      if (value != "skip" && value != "replace")
        throw Error(cat("--invalid-utf8 '", value, "' is not one of: skip, replace"));
      opt.replace_invalid_utf8 = value == "replace";
    }
    else throw Error(cat("unknown option '", a, "'\n", kUsage));
  }
  if (positional.size() < 2) throw Error(cat("loom prepare text needs OUT_DIR and at least one INPUT\n", kUsage));
  opt.out_dir = positional[0];
  opt.inputs.assign(positional.begin() + 1, positional.end());

  const auto r = data::prepare_text(opt);
  std::printf("prepared %s (tokenizer: %s, vocab %u, bos %u, eos %u, %d-byte tokens)\n", opt.out_dir.c_str(),
              r.tokenizer.c_str(), r.vocab, r.bos, r.eos, r.token_width);
  std::printf("  files:     %zu used, %zu skipped\n", r.files_used.size(), r.files_skipped.size());
  std::printf("  documents: %llu (train %llu, val %llu)\n", static_cast<unsigned long long>(r.documents),
              static_cast<unsigned long long>(r.train_documents), static_cast<unsigned long long>(r.val_documents));
  std::printf("  tokens:    train %llu in %zu shard(s), val %llu\n", static_cast<unsigned long long>(r.train_tokens),
              r.train_shards.size(), static_cast<unsigned long long>(r.val_tokens));
  std::printf("  speed:     %.1f MB of text in %.2f s on %d thread(s): %.1f MB/s\n", static_cast<double>(r.text_bytes) / 1e6,
              r.tokenize_seconds, r.threads,
              r.tokenize_seconds > 0 ? static_cast<double>(r.text_bytes) / 1e6 / r.tokenize_seconds : 0.0);
  std::printf("  manifest:  %s\n", r.manifest.c_str());
  return 0;
}

}  // namespace loom::app
