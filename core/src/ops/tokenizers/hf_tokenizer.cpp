// Hugging Face tokenizer.json files of byte-level BPE type (GPT-2, Llama 3,
// ...): model.type "BPE" with a byte-level alphabet, pre_tokenizer
// ByteLevel or a Sequence of Split (regex, "Isolated") stages and a
// ByteLevel, no normalizer. Anything else is refused by name rather than
// tokenized differently from the reference.
#include <algorithm>
#include <cctype>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "ops/tokenizers/bpe.hpp"
#include "ops/tokenizers/formats.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "util/files.hpp"

namespace loom::data {
namespace {

using nlohmann::json;

// Far above any real vocabulary (Llama 3: 128256, Gemma: 262144), far below
// what would make the piece table exhaust memory.
constexpr int64_t kMaxId = int64_t{1} << 24;

// GPT-2's pre-tokenizer, used by ByteLevel when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode, inverted: the code point that stands for each
// byte in the vocabulary's strings, back to the byte.
std::vector<int> byte_level_decoder() {
  std::vector<int> cp_to_byte(324, -1);
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    const int cp = printable ? b : 256 + extra++;
    cp_to_byte[static_cast<std::size_t>(cp)] = b;
  }
  return cp_to_byte;
}

// A vocabulary string to the raw bytes it stands for; false when it holds a
// character outside the byte-level alphabet (an added token such as "<s>" is
// fine: its characters are printable ASCII, which stand for themselves).
bool decode_byte_level(const std::string& s, const std::vector<int>& map, std::string& out) {
  out.clear();
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (std::size_t i = 0; i < s.size();) {
    uint32_t cp;
    int len;
    if (p[i] < 0x80) { cp = p[i]; len = 1; }
    else if ((p[i] & 0xe0) == 0xc0 && i + 1 < s.size()) { cp = ((p[i] & 0x1fu) << 6) | (p[i + 1] & 0x3fu); len = 2; }
    else return false;
    if (cp >= map.size() || map[cp] < 0) return false;
    out += static_cast<char>(map[cp]);
    i += static_cast<std::size_t>(len);
  }
  return true;
}

std::string token_content(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}

class HfBpeTokenizer final : public Tokenizer {
 public:
  HfBpeTokenizer(const std::string& path, const std::string& bytes, const TokenizerOptions& opt) : path_(path) {
    json j;
    try {
      j = json::parse(bytes);
    } catch (const json::exception& e) {
      throw Error(cat("tokenizer '", path, "' is not valid JSON (", e.what(), "); an HF tokenizer.json was expected"));
    }
    if (!j.is_object())
      throw Error(cat("tokenizer '", path, "' is JSON but not an object; an HF tokenizer.json is an object with ",
                      "\"model\", \"pre_tokenizer\" and \"added_tokens\""));
    try {
      load(j, opt);
    } catch (const json::exception& e) {
      throw Error(cat("HF tokenizer '", path, "' has a field of an unexpected type or lacks one (", e.what(),
                      "); loom reads tokenizer.json files written by the tokenizers library"));
    }
  }

  std::string kind() const override { return "hf-bpe"; }
  uint32_t vocab_size() const override { return vocab_; }
  uint32_t bos() const override { return bos_; }
  uint32_t eos() const override { return eos_; }
  std::string piece(uint32_t id) const override { return id < pieces_.size() ? pieces_[id] : cat("<", id, ">"); }

  void encode(std::string_view text, std::vector<uint32_t>& out) const override { encode_segments(text, out); }

 private:
  void fail(const std::string& what) const { throw Error(cat("HF tokenizer '", path_, "': ", what)); }

  void load(const json& j, const TokenizerOptions& opt) {
    const json& model = j.at("model");
    const std::string type = model.value("type", std::string("BPE"));
    if (type != "BPE")
      fail(cat("model.type is \"", type, "\"; loom reads byte-level BPE tokenizers only (SentencePiece models: pass the "
               "tokenizer.model file instead)"));
    // A Unigram model's vocab is a list of [piece, score] (older files carry no model.type).
    if (model.contains("vocab") && model["vocab"].is_array())
      fail("model.vocab is a list of [piece, score] pairs, as a Unigram model writes it; loom reads byte-level BPE "
           "tokenizers only (a SentencePiece model: pass its tokenizer.model instead)");
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
      fail("model.dropout is set; BPE dropout is for training-time augmentation, not for preparing a corpus");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(k) && !model[k].is_null() && !model[k].get<std::string>().empty())
        fail(cat("model.", k, " is set; loom reads byte-level BPE without subword markers"));
    if (model.value("byte_fallback", false))
      fail("model.byte_fallback is true: that is a SentencePiece-style BPE; pass its tokenizer.model instead");
    const bool ignore_merges = model.value("ignore_merges", false);

    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      const json& n = j["normalizer"];
      const bool empty_seq = n.value("type", std::string()) == "Sequence" && n.value("normalizers", json::array()).empty();
      if (!empty_seq)
        fail(cat("normalizer \"", n.value("type", std::string("?")), "\" is not supported; loom reads tokenizers ",
                 "without a normalizer (GPT-2, Llama 3)"));
    }
    read_pre_tokenizer(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json(nullptr));

    const auto map = byte_level_decoder();
    const json& vocab = model.at("vocab");
    if (!vocab.is_object()) fail("model.vocab is not an object of token -> id");
    std::string raw;
    std::unordered_map<std::string, uint32_t> ids;  // the vocabulary's own strings
    std::unordered_map<uint32_t, std::string> owner;  // and back: which string holds each id
    uint32_t max_id = 0;
    // Every token of the file has an id of its own, so the ids fit below the
    // number of tokens it holds (model.vocab's and added_tokens' together):
    // an id beyond that would size the piece table from nothing in the file
    // (one id of 16 million in a vocabulary of 100 asks for half a gigabyte).
    const std::size_t n_added = j.contains("added_tokens") && j["added_tokens"].is_array() ? j["added_tokens"].size() : 0;
    const int64_t id_limit = std::min<int64_t>(kMaxId, static_cast<int64_t>(vocab.size() + n_added));
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      // Checked before use: a negative or huge id would size the piece table from it.
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= id_limit)
        fail(cat("model.vocab gives \"", it.key(), "\" the id ", it.value().dump(), "; ids are integers in [0, ", id_limit,
                 ")", id_limit < kMaxId ? cat(", the ", vocab.size(), " tokens of model.vocab and ", n_added,
                                              " added token(s) the file holds, each with an id of its own")
                                        : std::string()));
      const auto id = it.value().get<uint32_t>();
      // Two tokens with one id would encode to the same id and decode to
      // only one of them: the file is damaged (the tiktoken loader refuses
      // the same, a rank given twice).
      if (const auto [o, fresh] = owner.emplace(id, it.key()); !fresh)
        fail(cat("model.vocab gives ", json(o->second).dump(), " and ", json(it.key()).dump(), " the same id ", id,
                 "; every token needs an id of its own (the file is damaged: fetch it again)"));
      ids.emplace(it.key(), id);
      max_id = std::max(max_id, id);
      if (decode_byte_level(it.key(), map, raw)) bpe_.add_token(raw, id);
    }
    bpe_.finish_tokens(ignore_merges, cat("HF tokenizer '", path_, "'"));

    const json& merges = model.at("merges");
    uint32_t rank = 0;
    for (const json& m : merges) {
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const std::size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail(cat("merges[", rank, "] = \"", s, "\" is not two tokens separated by one space"));
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        if (!m.is_array() || m.size() != 2) fail(cat("merges[", rank, "] is neither \"a b\" nor [\"a\", \"b\"]"));
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      }
      const auto ia = ids.find(a), ib = ids.find(b), im = ids.find(a + b);
      if (ia == ids.end() || ib == ids.end() || im == ids.end())
        fail(cat("merges[", rank, "] = \"", a, " ", b, "\" names a token that is not in model.vocab"));
      bpe_.add_merge(ia->second, ib->second, rank, im->second);
      ++rank;
    }
    bpe_.finish_pairs();

    pieces_.assign(max_id + 1, std::string());
    for (auto& [s, id] : ids) pieces_[id] = s;
    // Added tokens get the ids the tokenizers library gives them when it
    // loads the file, which ignores the written "id": a content already
    // added or in model.vocab keeps that id, any other takes the next one
    // after the model's vocabulary (AddedVocabulary::add_tokens). Files the
    // library wrote agree; a hand-edited one is tokenized as the library does.
    const uint32_t model_size = static_cast<uint32_t>(vocab.size());
    std::unordered_map<std::string, uint32_t> added_ids;
    bool any_added = false, warned = false;
    uint32_t max_added = 0;
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (const json& t : j["added_tokens"]) {
        const auto written = t.at("id").get<int64_t>();
        const std::string content = t.at("content").get<std::string>();
        uint32_t id;
        if (auto a = added_ids.find(content); a != added_ids.end()) id = a->second;
        else if (auto v = ids.find(content); v != ids.end()) id = v->second;
        else id = !any_added ? model_size : (max_added >= model_size || model_size == 0) ? max_added + 1 : model_size;
        // A new added token takes the id after the vocabulary's size; when
        // model.vocab's ids have gaps, that id can already be a vocabulary
        // token's, and the two would share it.
        if (const auto o = owner.find(id); o != owner.end() && o->second != content)
          fail(cat("added token ", json(content).dump(), " gets id ", id, " (the tokenizers library gives a new added token ",
                   "the id after model.vocab's size), which model.vocab already gives ", json(o->second).dump(),
                   "; every token needs an id of its own (the file is damaged: fetch it again)"));
        owner.emplace(id, content);
        added_ids.emplace(content, id);
        max_added = any_added ? std::max(max_added, id) : id;
        any_added = true;
        if (written != static_cast<int64_t>(id) && !warned) {
          log_warn(cat("HF tokenizer '", path_, "': added token \"", content, "\" is written with id ", written,
                       " but the tokenizers library gives it id ", id, " when it loads the file; loom uses ", id,
                       " (and the ids after it) as the library does"));
          warned = true;
        }
        if (id >= pieces_.size()) pieces_.resize(id + 1);
        pieces_[id] = content;
        ids[content] = id;
        if (t.value("special", false)) continue;  // special look-alikes in text stay text
        if (t.value("lstrip", false) || t.value("rstrip", false) || t.value("single_word", false))
          fail(cat("added token \"", content, "\" uses lstrip/rstrip/single_word, which loom does not implement"));
        if (!content.empty()) added_.emplace_back(content, id);
      }
    vocab_ = static_cast<uint32_t>(pieces_.size());

    // BOS/EOS: the user's choice, else tokenizer_config.json beside the file,
    // else the post-processor's template, else the usual names.
    std::string bos = opt.bos, eos = opt.eos;
    const auto cfg_path = std::filesystem::path(path_).parent_path() / "tokenizer_config.json";
    std::error_code ec;
    if ((bos.empty() || eos.empty()) && std::filesystem::exists(cfg_path, ec)) {
      // Read as every file a user names: a regular file of bounded size (a
      // FIFO or device in its place is refused at once, naming it).
      const std::string text =
          read_bounded_file(cfg_path.string(), "tokenizer_config.json (read for bos_token/eos_token)", 64 << 20);
      try {
        const json c = json::parse(text);
        if (bos.empty() && c.contains("bos_token")) bos = token_content(c["bos_token"]);
        if (eos.empty() && c.contains("eos_token")) eos = token_content(c["eos_token"]);
      } catch (const json::exception& e) {
        throw Error(cat("'", cfg_path.string(), "' (read for bos_token/eos_token) is not valid JSON: ", e.what()));
      }
    }
    if (bos.empty() && j.contains("post_processor") && j["post_processor"].is_object()) {
      const json& pp = j["post_processor"];
      if (pp.value("type", std::string()) == "TemplateProcessing" && pp.contains("single") &&
          !pp["single"].empty() && pp["single"][0].contains("SpecialToken"))
        bos = pp["single"][0]["SpecialToken"].value("id", std::string());
    }
    auto pick = [&](std::string name, std::initializer_list<const char*> usual, const char* what, const char* flag) {
      if (name.empty())
        for (const char* u : usual)
          if (ids.count(u)) { name = u; break; }
      if (name.empty())
        fail(cat("no ", what, " token: neither tokenizer_config.json beside it nor its post-processor names one, and it has none "
                 "of the usual names; name one with ", flag, " TOKEN"));
      const auto it = ids.find(name);
      if (it == ids.end()) fail(cat(what, " token \"", name, "\" is not in its vocabulary"));
      return it->second;
    };
    bos_ = pick(bos, {"<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"}, "BOS", "--bos");
    eos_ = pick(eos, {"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"}, "EOS", "--eos");
  }

  void read_pre_tokenizer(const json& pt) {
    if (pt.is_null()) fail("has no pre_tokenizer; a byte-level BPE tokenizer has at least a ByteLevel one");
    std::vector<const json*> list;
    if (pt.value("type", std::string()) == "Sequence") {
      for (const json& p : pt.at("pretokenizers")) list.push_back(&p);
    } else {
      list.push_back(&pt);
    }
    bool byte_level = false;
    for (std::size_t i = 0; i < list.size(); ++i) {
      const json& p = *list[i];
      const std::string type = p.value("type", std::string("?"));
      if (type == "Split") {
        const std::string behavior = p.value("behavior", std::string("Isolated"));
        if (behavior != "Isolated" || p.value("invert", false))
          fail(cat("pre-tokenizer Split with behavior \"", behavior, "\"", p.value("invert", false) ? " and invert" : "",
                   " is not supported (only Isolated, as in Llama 3)"));
        const json& pat = p.at("pattern");
        std::string re;
        if (pat.contains("Regex")) re = pat["Regex"].get<std::string>();
        else re = escape(pat.at("String").get<std::string>());
        stages_.push_back(std::make_unique<RegexSplitter>(re, true, cat("HF tokenizer '", path_, "'")));
      } else if (type == "ByteLevel") {
        byte_level = true;
        if (p.value("add_prefix_space", false)) {
          if (i != 0) fail("ByteLevel with add_prefix_space after another pre-tokenizer is not supported");
          prefix_space_ = true;
        }
        if (p.value("use_regex", true))
          stages_.push_back(std::make_unique<RegexSplitter>(kGpt2Pattern, true, cat("HF tokenizer '", path_, "'")));
      } else {
        fail(cat("pre-tokenizer \"", type, "\" is not supported; loom reads ByteLevel and Split (regex) pre-tokenizers"));
      }
    }
    if (!byte_level) fail("has no ByteLevel pre-tokenizer, so it is not a byte-level BPE tokenizer");
  }

  // A literal for PCRE2: every ASCII character that is not a letter or digit
  // behind a backslash (\Q...\E would end early at a "\E" in the string).
  static std::string escape(const std::string& s) {
    std::string out;
    for (char c : s) {
      const auto u = static_cast<unsigned char>(c);
      if (u < 0x80 && !std::isalnum(u)) out += '\\';
      out += c;
    }
    return out;
  }

  // Non-special added tokens are cut out of the text first (as the tokenizers
  // library does); the rest goes through the pre-tokenizer and BPE.
  void encode_segments(std::string_view text, std::vector<uint32_t>& out) const {
    if (added_.empty()) return segment(text, out);
    // Each added token's next occurrence, searched again only once a match
    // has passed it: every token scans the text once in all, where searching
    // them all from every match took time in (matches x text) -- minutes on
    // one large document with a few dozen whitespace tokens.
    constexpr std::size_t npos = std::string_view::npos;
    std::vector<std::size_t> next(added_.size());
    for (std::size_t k = 0; k < added_.size(); ++k) next[k] = text.find(added_[k].first);
    std::size_t pos = 0;
    while (pos < text.size()) {
      std::size_t best = npos, best_len = 0;
      uint32_t best_id = 0;
      for (std::size_t k = 0; k < added_.size(); ++k) {
        const auto& [content, id] = added_[k];
        if (next[k] != npos && next[k] < pos) next[k] = text.find(content, pos);
        if (next[k] < best || (next[k] == best && next[k] != npos && content.size() > best_len)) {
          best = next[k];
          best_len = content.size();
          best_id = id;
        }
      }
      if (best == npos) break;
      segment(text.substr(pos, best - pos), out);
      out.push_back(best_id);
      pos = best + best_len;
    }
    segment(text.substr(pos), out);
  }

  // One stretch of text between added tokens. ByteLevel's add_prefix_space
  // applies to each such stretch that does not start with a space, as the
  // tokenizers library pre-tokenizes every one on its own.
  void segment(std::string_view piece, std::vector<uint32_t>& out) const {
    if (piece.empty()) return;
    if (prefix_space_ && piece.front() != ' ') {
      std::string with(" ");
      with += piece;
      try {
        stage(0, with, out);
      } catch (RegexGaveUp& e) {
        // Where in `piece` (inside the document) the copy's byte is.
        if (e.at >= with.data() && e.at <= with.data() + with.size())
          e.at = piece.data() + (e.at > with.data() ? e.at - with.data() - 1 : 0);
        throw;
      }
      return;
    }
    stage(0, piece, out);
  }

  void stage(std::size_t i, std::string_view piece, std::vector<uint32_t>& out) const {
    if (piece.empty()) return;
    if (i == stages_.size()) {
      bpe_.encode_word(piece, out);
      return;
    }
    stages_[i]->split(piece, [&](std::string_view w) { stage(i + 1, w, out); });
  }

  std::string path_;
  BytePairEncoder bpe_;
  std::vector<std::unique_ptr<RegexSplitter>> stages_;
  std::vector<std::pair<std::string, uint32_t>> added_;
  std::vector<std::string> pieces_;
  bool prefix_space_ = false;
  uint32_t vocab_ = 0, bos_ = 0, eos_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path, const std::string& bytes,
                                             const TokenizerOptions& opt) {
  return std::make_unique<HfBpeTokenizer>(path, bytes, opt);
}

}  // namespace loom::data
