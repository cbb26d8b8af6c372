// examples/plugins/jsonl, the third-party data source built from the
// installed SDK by tests/install (the ctest fixture sdk_example_plugins): its
// tokens are the SDK tokenizer's ids of the documents, it resumes exactly
// (mid-document, across epochs, under another world size), it has a
// validation split, and a bad line is refused naming the file and the line.
// The plugin is loaded as `loom train` loads it: through the registry, from
// its file.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "loom/config.hpp"
#include "loom/data.hpp"
#include "loom/error.hpp"
#include "loom/ops/tokenizer.hpp"
#include "loom/registry.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using loom::DataSource;
using loom::Split;

namespace {

const fs::path kPlugin = fs::path(LOOM_BINARY_DIR) / "tests" / "install" / "work" / "jsonl-build" / "libloom-data-jsonl.so";

// The documents of the tests: ASCII, UTF-8, an empty text, quotes and escapes.
std::vector<std::string> documents() {
  return {"The quick brown fox jumps over the lazy dog.",
          "Gr\xc3\xbc\xc3\x9f" "e aus K\xc3\xb6ln \xe2\x80\x94 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e",
          "",
          "She said \"no\".\nThen a second line\tafter a tab.",
          "short",
          "A somewhat longer document that spans more than one window of the small sequence length these tests use."};
}

std::string json_line(const std::string& text) {
  std::string out = "{\"text\": \"";
  for (char c : text) {
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else out += c;
  }
  return out + "\", \"id\": 7}\n";
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

void write_jsonl(const fs::path& p, const std::vector<std::string>& docs, bool blank_lines = false) {
  std::string text;
  for (const std::string& d : docs) text += json_line(d) + (blank_lines ? "\n  \n" : "");
  write_file(p, text);
}

struct Source {
  loom::PluginRegistry registry;
  std::unique_ptr<DataSource> data;
};

// A jsonl source for `data_toml` (the [data] table's keys), opened for rank/world.
std::unique_ptr<Source> make(const std::string& data_toml, int64_t batch, int64_t seq, int rank = 0, int world = 1,
                             int64_t vocab = 300) {
  if (!fs::exists(kPlugin))
    throw std::runtime_error("examples/plugins/jsonl was not built at " + kPlugin.string() +
                             ": the ctest fixture install_sdk_and_build_example builds it (run it first)");
  auto s = std::make_unique<Source>();
  loom::PluginInit init;
  init.config = loom::parse_config_table("[data]\n" + data_toml, "test.toml").table("data");
  init.rank = rank;
  init.world = world;
  init.seed = 5;
  s->data = s->registry.create_as<loom::PluginKind::data>("jsonl", init, kPlugin);
  loom::DataSpec spec;
  spec.batch = batch;
  spec.seq_len = seq;
  spec.vocab_size = vocab;
  spec.rank = rank;
  spec.world = world;
  spec.seed = 5;
  s->data->open(spec);
  return s;
}

// The stream the plugin promises: each document BOS + ids + EOS, repeated.
std::vector<int32_t> stream(const loom::data::Tokenizer& tok, const std::vector<std::string>& docs, size_t n) {
  std::vector<uint32_t> one;
  for (const std::string& d : docs) tok.encode_document(d, one);
  std::vector<int32_t> out;
  while (out.size() < n)
    for (uint32_t t : one) out.push_back(static_cast<int32_t>(t));
  return out;
}

std::vector<int32_t> next(DataSource& d, Split split, int64_t batch, int64_t seq) {
  std::vector<int32_t> t(static_cast<size_t>(batch * (seq + 1)));
  d.next(split, t.data());
  return t;
}

std::string train_key(const fs::path& p) { return "train = \"" + p.string() + "\"\n"; }

}  // namespace

// Every window is the stream of BOS + the SDK tokenizer's ids + EOS of each
// document in file order, across files and epochs: with the byte-level
// tokenizer and with a real one (Llama 3's tiktoken file, when setup.sh
// fetched it; the byte-level case runs everywhere).
TEST(JsonlExample, TokensAreTheTokenizersIdsOfTheText) {
  loom::test::TmpDir dir;
  const std::vector<std::string> docs = documents();
  const std::vector<std::string> first(docs.begin(), docs.begin() + 3), second(docs.begin() + 3, docs.end());
  write_jsonl(dir.path / "a.jsonl", first, /*blank_lines=*/true);
  write_jsonl(dir.path / "b.jsonl", second);
  std::vector<std::string> tokenizers = {"bytes"};
  const fs::path llama3 = fs::path(LOOM_SOURCE_DIR) / ".cache" / "tokenizers" / "llama3" / "tokenizer.model";
  if (fs::exists(llama3)) tokenizers.push_back(llama3.string());
  for (const std::string& tk : tokenizers) {
    SCOPED_TRACE(tk);
    const auto tok = loom::data::load_tokenizer(tk);
    const int64_t B = 3, S = 7;
    auto s = make("train = [\"" + (dir.path / "a.jsonl").string() + "\", \"" + (dir.path / "b.jsonl").string() +
                      "\"]\ntokenizer = \"" + tk + "\"\n",
                  B, S, 0, 1, tok->vocab_size());
    EXPECT_EQ(s->data->vocab_hint(), static_cast<int64_t>(tok->vocab_size()));
    const int steps = 40;  // several epochs of the small corpus
    const std::vector<int32_t> want = stream(*tok, docs, static_cast<size_t>(steps * B * S + 1));
    for (int g = 0; g < steps; ++g) {
      const std::vector<int32_t> got = next(*s->data, Split::train, B, S);
      for (int64_t i = 0; i < B; ++i)
        for (int64_t p = 0; p <= S; ++p)
          ASSERT_EQ(got[static_cast<size_t>(i * (S + 1) + p)], want[static_cast<size_t>((g * B + i) * S + p)])
              << "step " << g << " row " << i << " position " << p;
    }
  }
}

// state() after any step, restored into a new instance, continues with the
// very windows the first instance gives: mid-document, after several
// epochs, and under another world size (two ranks of half the batch take the
// same windows between them). A state of other files is refused.
TEST(JsonlExample, ResumesExactly) {
  loom::test::TmpDir dir;
  write_jsonl(dir.path / "t.jsonl", documents());
  const std::string table = train_key(dir.path / "t.jsonl");
  const int64_t B = 2, S = 5;
  for (int at : {0, 1, 3, 17, 30}) {
    SCOPED_TRACE(at);
    auto a = make(table, B, S);
    for (int g = 0; g < at; ++g) next(*a->data, Split::train, B, S);
    const std::string state = a->data->state();
    std::vector<int32_t> want;
    for (int g = 0; g < 6; ++g) {
      const auto t = next(*a->data, Split::train, B, S);
      want.insert(want.end(), t.begin(), t.end());
    }
    auto b = make(table, B, S);
    b->data->restore(state);
    std::vector<int32_t> got;
    for (int g = 0; g < 6; ++g) {
      const auto t = next(*b->data, Split::train, B, S);
      got.insert(got.end(), t.begin(), t.end());
    }
    EXPECT_EQ(got, want);
    // Two ranks with one row each: rank r's row of step g is row r of the world-1 step g.
    auto r0 = make(table, 1, S, 0, 2), r1 = make(table, 1, S, 1, 2);
    r0->data->restore(state);
    r1->data->restore(state);
    for (int g = 0; g < 6; ++g) {
      const auto t0 = next(*r0->data, Split::train, 1, S), t1 = next(*r1->data, Split::train, 1, S);
      const auto row = [&](int i) {
        return std::vector<int32_t>(want.begin() + (g * B + i) * (S + 1), want.begin() + (g * B + i + 1) * (S + 1));
      };
      EXPECT_EQ(t0, row(0)) << "rank 0, step " << g;
      EXPECT_EQ(t1, row(1)) << "rank 1, step " << g;
    }
  }
  auto a = make(table, B, S);
  next(*a->data, Split::train, B, S);
  const std::string state = a->data->state();
  write_jsonl(dir.path / "t.jsonl", {"other text"});
  auto c = make(table, B, S);
  loom::test::expect_error([&] { c->data->restore(state); }, {"train files changed since the checkpoint"});
}

// The validation split reads the val files' stream from its beginning,
// reset() goes back to it, and the train split is not disturbed by it.
// Without `val` there is no validation split.
TEST(JsonlExample, HasAValidationSplit) {
  loom::test::TmpDir dir;
  const std::vector<std::string> train = documents(), val = {"held out one", "held out two, a bit longer"};
  write_jsonl(dir.path / "t.jsonl", train);
  write_jsonl(dir.path / "v.jsonl", val);
  const int64_t B = 2, S = 6;
  auto s = make(train_key(dir.path / "t.jsonl") + "val = \"" + (dir.path / "v.jsonl").string() + "\"\n", B, S);
  ASSERT_TRUE(s->data->has_split(Split::validation));
  const auto tok = loom::data::load_tokenizer("bytes");
  const std::vector<int32_t> want = stream(*tok, val, static_cast<size_t>(3 * B * S + 1));
  const std::vector<int32_t> train_want = stream(*tok, train, static_cast<size_t>(2 * B * S + 1));
  const auto first = next(*s->data, Split::train, B, S);
  for (int64_t i = 0; i < B; ++i)
    for (int64_t p = 0; p <= S; ++p)
      EXPECT_EQ(first[static_cast<size_t>(i * (S + 1) + p)], train_want[static_cast<size_t>(i * S + p)]);
  for (int pass = 0; pass < 2; ++pass) {
    s->data->reset(Split::validation);
    for (int g = 0; g < 3; ++g) {
      const auto got = next(*s->data, Split::validation, B, S);
      for (int64_t i = 0; i < B; ++i)
        for (int64_t p = 0; p <= S; ++p)
          ASSERT_EQ(got[static_cast<size_t>(i * (S + 1) + p)], want[static_cast<size_t>((g * B + i) * S + p)])
              << "pass " << pass << " step " << g;
    }
  }
  // The train split continues where it was: its second step.
  const auto second = next(*s->data, Split::train, B, S);
  for (int64_t i = 0; i < B; ++i)
    for (int64_t p = 0; p <= S; ++p)
      EXPECT_EQ(second[static_cast<size_t>(i * (S + 1) + p)], train_want[static_cast<size_t>((B + i) * S + p)]);
  auto no_val = make(train_key(dir.path / "t.jsonl"), B, S);
  EXPECT_FALSE(no_val->data->has_split(Split::validation));
  loom::test::expect_error([&] { next(*no_val->data, Split::validation, B, S); }, {"no validation split", "data.val"});
}

// A line that is not one JSON object with a string "text" is refused with
// the file and the line number (blank lines count as lines); so are a
// missing file, a missing `train` key and a tokenizer larger than the model.
TEST(JsonlExample, BadLinesAreRefusedNamingFileAndLine) {
  loom::test::TmpDir dir;
  const std::string good = json_line("fine");
  struct Case {
    std::string line, says;
  };
  for (const Case& c : {Case{"{\"text\": \"unterminated}\n", "not valid JSON"},
                        Case{"[\"text\", \"in an array\"]\n", "a JSON array, not an object"},
                        Case{"{\"body\": \"no text key\"}\n", "has no \"text\""},
                        Case{"{\"text\": 42}\n", "\"text\" is a JSON number, not a string"},
                        Case{"{\"text\": \"bad utf-8 \xff\"}\n", "not valid JSON"}}) {
    SCOPED_TRACE(c.says);
    const fs::path f = dir.path / "bad.jsonl";
    write_file(f, good + "\n" + good + c.line + good);  // the bad line is line 4
    loom::test::expect_error([&] { make(train_key(f), 1, 64); }, {f.string() + ":4: ", c.says});
  }
  // A bad line past the first window is refused when a window reaches it.
  const fs::path late = dir.path / "late.jsonl";
  std::string text;
  for (int i = 0; i < 20; ++i) text += good;
  write_file(late, text + "{\"text\": }\n");
  auto s = make(train_key(late), 1, 4);
  loom::test::expect_error(
      [&] {
        for (int g = 0; g < 100; ++g) next(*s->data, Split::train, 1, 4);
      },
      {late.string() + ":21: ", "not valid JSON"});
  loom::test::expect_error([&] { make(train_key(dir.path / "missing.jsonl"), 1, 4); },
                           {"missing.jsonl", "cannot be opened"});
  loom::test::expect_error([&] { make("tokenizer = \"bytes\"\n", 1, 4); }, {"data.train is required"});
  loom::test::expect_error([&] { make(train_key(late), 1, 4, 0, 1, /*vocab=*/100); },
                           {"258 ids but model.vocab_size = 100"});
  write_file(dir.path / "empty.jsonl", "\n \n");
  loom::test::expect_error([&] { make(train_key(dir.path / "empty.jsonl"), 1, 4); }, {"hold no document"});
}

// Document starts (loom::DocumentStarts, through the SDK): 1 exactly at each
// document's BOS, for the windows next() gives.
TEST(JsonlExample, DocumentStartsAreEachDocumentsBos) {
  loom::test::TmpDir dir;
  write_jsonl(dir.path / "t.jsonl", documents());
  const int64_t B = 2, S = 9;
  auto a = make(train_key(dir.path / "t.jsonl"), B, S), b = make(train_key(dir.path / "t.jsonl"), B, S);
  auto* starts = dynamic_cast<loom::DocumentStarts*>(a->data.get());
  ASSERT_NE(starts, nullptr);
  EXPECT_EQ(starts->starts_unavailable(), "");
  const auto tok = loom::data::load_tokenizer("bytes");
  const size_t row = static_cast<size_t>(S + 1);
  for (int g = 0; g < 20; ++g) {
    std::vector<int32_t> t(B * row);
    std::vector<uint8_t> f(B * row);
    starts->next_with_starts(Split::train, t.data(), f.data());
    EXPECT_EQ(t, next(*b->data, Split::train, B, S));
    for (size_t i = 0; i < B * row; ++i) EXPECT_EQ(f[i], t[i] == static_cast<int32_t>(tok->bos()) ? 1 : 0) << i;
  }
}
