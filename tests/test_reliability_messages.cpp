// Messages (docs/RELIABILITY.md "Messages"): a refused value is told the
// range that is really accepted. The class of defect — a hidden cap, or a
// bound stated as closed when it is open — is caught by a property over every
// numeric core key: for probes across the number line, each refusal's stated
// range must exclude the value refused, and every value accepted must lie in
// that stated range. And `loom convert` pointed at a checkpoints folder lists
// the complete checkpoints and names the newest.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <regex>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "config/run_config.hpp"
#include "data/megatron/megatron_data.hpp"
#include "data/tokens/tokens_data.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "reliability_util.hpp"
#include "test_util.hpp"
#include "megatron_writer.hpp"
#include "token_shard_writer.hpp"
#include "train/session.hpp"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

// "must be in [a, b]", "in (a, b]", "in [a, b)", ">= a", "> a", "<= b",
// "a finite number", "a finite number >= a", as a predicate on values.
struct Claim {
  std::string text;
  std::optional<double> lo, hi;
  bool lo_open = false, hi_open = false;
  bool contains(double v) const {
    if (!std::isfinite(v)) return false;  // every range is of finite numbers
    if (lo && (lo_open ? !(v > *lo) : !(v >= *lo))) return false;
    if (hi && (hi_open ? !(v < *hi) : !(v <= *hi))) return false;
    return true;
  }
};

std::optional<Claim> parse_claim(const std::string& msg) {
  const size_t at = msg.find("is out of range: must be ");
  if (at == std::string::npos) return std::nullopt;
  Claim c;
  c.text = msg.substr(at + 25);
  // Non-finite values are told "a finite number >= 0": the same range, said for them.
  if (c.text.rfind("a finite number ", 0) == 0) c.text = c.text.substr(16);
  std::smatch m;
  const std::string num = R"(([-+0-9.eEinf]+))";
  if (std::regex_search(c.text, m, std::regex(R"(in ([\[(]))" + num + ", " + num + R"(([\])]))"))) {
    c.lo = std::stod(m[2]);
    c.hi = std::stod(m[3]);
    c.lo_open = m[1] == "(";
    c.hi_open = m[4] == ")";
  } else if (std::regex_search(c.text, m, std::regex("(>=|>|<=|<) " + num))) {
    const bool upper = m[1] == "<=" || m[1] == "<";
    (upper ? c.hi : c.lo) = std::stod(m[2]);
    (upper ? c.hi_open : c.lo_open) = m[1] == ">" || m[1] == "<";
  } else if (c.text.rfind("a finite number", 0) != 0) {
    ADD_FAILURE() << "unrecognised range: " << msg;
  }
  return c;
}

// How the run uses a key's value: as an integer or a host double, as an fp32
// on the device, or as RoPE's base (theta^(-2i/D) in double, then fp32 angles).
enum class Use { host, fp32, rope };

struct Key {
  std::string section, key;
  bool is_float;
  Use use = Use::host;
};

const std::vector<Key> kKeys = {
    {"run", "seed", false},           {"run", "threads", false},           {"run", "collective_timeout", true},
    {"model", "hidden", false},       {"model", "num_layers", false},      {"model", "num_heads", false},
    {"model", "num_kv_heads", false}, {"model", "ffn_hidden", false},      {"model", "vocab_size", false},
    {"model", "max_seq_len", false},  {"model", "rope_theta", true, Use::rope}, {"model", "norm_eps", true, Use::fp32},
    {"model", "init_std", true, Use::fp32}, {"model", "embedding_init_std", true, Use::fp32},
    {"model", "head_chunk", false}, {"train", "steps", false},
    {"train", "micro_batch", false},  {"train", "seq_len", false},         {"train", "grad_accum", false},
    {"train", "lr", true, Use::fp32}, {"train", "min_lr", true, Use::fp32}, {"train", "warmup_steps", false},
    {"train", "grad_clip", true, Use::fp32}, {"train", "weight_decay", true, Use::fp32},
    {"train", "beta1", true, Use::fp32}, {"train", "beta2", true, Use::fp32}, {"train", "eps", true, Use::fp32},
    {"train", "log_every", false},    {"train", "validation_every", false}, {"train", "validation_batches", false},
    {"train", "max_skipped_steps", false}, {"checkpoint", "every", false}, {"checkpoint", "keep_last", false}};

// TOML text and value of each probe: across the number line, and at the edges
// of fp32 (denormal doubles, the smallest normal fp32, FLT_MAX and beyond,
// numbers below 1 that round to 1.0f).
std::vector<std::pair<std::string, double>> probes(bool is_float) {
  if (is_float)
    return {{"-1e308", -1e308}, {"-1e300", -1e300}, {"-1.0", -1}, {"-0.0", 0}, {"0.0", 0}, {"5e-324", 5e-324},
            {"1e-300", 1e-300}, {"1e-45", 1e-45},   {"1e-39", 1e-39}, {"1.1754942e-38", 1.1754942e-38},
            {"1.17549435e-38", 1.17549435e-38}, {"1.2e-38", 1.2e-38}, {"1e-8", 1e-8}, {"0.5", 0.5},
            {"0.999", 0.999},   {"0.9999999", 0.9999999}, {"0.99999996", 0.99999996}, {"0.99999999", 0.99999999},
            {"1.0", 1},         {"1.5", 1.5},       {"10.0", 10},     {"11.0", 11},       {"86400.0", 86400},
            {"1e6", 1e6},       {"3.4e38", 3.4e38}, {"3.40282347e38", 3.40282347e38}, {"3.4028236e38", 3.4028236e38},
            {"1e39", 1e39},     {"1e300", 1e300},   {"1e301", 1e301}, {"1e308", 1e308},   {"inf", INFINITY},
            {"-inf", -INFINITY}, {"nan", NAN}};
  return {{"-9223372036854775808", -9.223372036854775808e18}, {"-1", -1}, {"0", 0}, {"1", 1}, {"2", 2},
          {"4096", 4096}, {"4097", 4097}, {"1048576", 1048576}, {"1048577", 1048577}, {"2147483647", 2147483647.0},
          {"2147483648", 2147483648.0}, {"1099511627776", 1099511627776.0}, {"1099511627777", 1099511627777.0},
          {"9223372036854775807", 9.223372036854775807e18}};
}

}  // namespace

TEST(ReliabilityMessages, EveryStatedRangeIsTheRangeThatIsAccepted) {
  for (const Key& k : kKeys) {
    std::optional<Claim> claim;
    std::vector<double> accepted;
    for (const auto& [text, value] : probes(k.is_float)) {
      // head_chunk is a key of fused layers (refused with native ones whatever its value).
      const std::string toml = "[" + k.section + "]\n" + k.key + " = " + text + "\n" +
                               (k.key == "head_chunk" ? "layers = \"fused\"\n" : "");
      std::string msg;
      try {
        (void)loom::parse_config_string(toml, "m.toml", {});
        accepted.push_back(value);
        continue;
      } catch (const loom::Error& e) {
        msg = e.what();
      }
      const std::optional<Claim> c = parse_claim(msg);
      if (!c) continue;  // refused by a rule across keys (e.g. seq_len > max_seq_len): not a range claim
      // The refused value lies outside the range the message states.
      EXPECT_FALSE(c->contains(value)) << k.section << "." << k.key << " = " << text << " refused with: " << msg;
      EXPECT_TRUE(has(msg, k.section + "." + k.key + " = ")) << msg;
      if (!claim) claim = c;
      EXPECT_EQ(c->text, claim->text) << k.section << "." << k.key << ": two refusals state different ranges";
    }
    // Every accepted value lies inside the stated range.
    if (claim)
      for (double v : accepted)
        EXPECT_TRUE(claim->contains(v)) << k.section << "." << k.key << " = " << v
                                        << " is accepted but outside the stated range: " << claim->text;
    // And so does the value the device computes with: the fp32 it becomes
    // (a subnormal flushed to 0, as the GPU does), never 0 for a range that
    // excludes 0, never inf, never 1.0f for a range below 1.
    if (claim && k.use == Use::fp32)
      for (double v : accepted) {
        float f = static_cast<float>(v);
        if (std::fpclassify(f) == FP_SUBNORMAL) f = 0.f;
        EXPECT_TRUE(claim->contains(static_cast<double>(f)))
            << k.section << "." << k.key << " = " << v << " is accepted but is " << f
            << " in fp32, outside the stated range: " << claim->text;
      }
    // RoPE: every angle (position x inverse frequency, in fp32) is finite, up
    // to the longest sequence a model may have.
    if (k.use == Use::rope)
      for (double v : accepted)
        for (int64_t D : {2, 64, 256})
          for (int64_t i = 0; i < D / 2; ++i)
            EXPECT_TRUE(std::isfinite(loom::cpu::rope_angle(int64_t{1} << 20, i, D, v)))
                << k.section << "." << k.key << " = " << v << " is accepted but gives a non-finite RoPE angle (D "
                << D << ", i " << i << ")";
  }
}

// The reported case: no hidden cap on rope_theta (a huge base only rounds the
// slowest frequencies to 0 in fp32), and the lower bound stated as it is.
TEST(ReliabilityMessages, RopeThetaHasNoHiddenCap) {
  EXPECT_DOUBLE_EQ(loom::parse_config_string("[model]\nrope_theta = 1e308\n", "m.toml", {}).model.spec.rope_theta,
                   1e308);
  for (const char* bad : {"0.0", "-5.0", "0.5", "5e-324"}) {
    try {
      (void)loom::parse_config_string(std::string("[model]\nrope_theta = ") + bad + "\n", "m.toml", {});
      ADD_FAILURE() << bad;
    } catch (const loom::Error& e) {
      EXPECT_CONTAINS(std::string(e.what()), "must be >= 1");
    }
  }
}

// `loom convert` of a checkpoints folder: lists the complete ones, suggests the newest.
TEST(ReliabilityMessages, ConvertOfACheckpointsFolderNamesTheNewest) {
  const fs::path dir = fresh_dir("messages_convert");
  {
    loom::Session s(loom::parse_config_string(tiny_config(dir / "run", 6), "m.toml",
                                              {"checkpoint.every=2", "checkpoint.keep_last=0"}));
    s.train();
  }
  const fs::path root = dir / "run" / "checkpoints";
  const ProcResult r = run_shell(std::string("'") + LOOM_CLI + "' convert '" + root.string() + "' --to-hf '" +
                                 (dir / "hf").string() + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "is a folder of checkpoints, not one checkpoint");
  EXPECT_CONTAINS(r.out, "complete ones: step_00000002, step_00000004, step_00000006");
  EXPECT_CONTAINS(r.out, "loom convert " + (root / "step_00000006").string());
}

// `loom convert` pointed at every kind of wrong place says what the place is
// (missing, a file, a run folder, a folder of something else, an interrupted
// save) and what to give instead; and never writes its export into a checkpoint.
TEST(ReliabilityMessages, ConvertPointedAtTheWrongPlaceSaysWhatItIs) {
  const fs::path dir = fresh_dir("messages_convert_wrong");
  {
    loom::Session s(loom::parse_config_string(tiny_config(dir / "run", 4), "m.toml", {"checkpoint.every=2"}));
    s.train();
  }
  const fs::path root = dir / "run" / "checkpoints", newest = root / "step_00000004";
  std::ofstream(dir / "afile") << "x";
  fs::create_directories(dir / "other");
  fs::create_directories(root / "step_00000009");  // an interrupted save
  const std::string hf = (dir / "hf").string();
  auto convert = [&](const std::string& from, const std::string& to) {
    return run_shell(std::string("timeout 60 '") + LOOM_CLI + "' convert '" + from + "' --to-hf '" + to + "'");
  };
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {(dir / "missing").string(), {"does not exist", "give a checkpoint folder"}},
      {(dir / "afile").string(), {"is a file", "give a checkpoint folder"}},
      {(dir / "run").string(), {"is a run folder", "step_00000002, step_00000004", "loom convert " + newest.string()}},
      {(dir / "other").string(), {"is not a checkpoint (it has no meta.json)"}},
      {(root / "step_00000009").string() + "/", {"is incomplete", "complete checkpoints in " + root.string() + ": 2, 4"}},
  };
  for (const auto& [from, says] : cases) {
    SCOPED_TRACE(from);
    const ProcResult r = convert(from, hf);
    EXPECT_EQ(r.code, 1) << r.out;
    for (const std::string& s : says) EXPECT_CONTAINS(r.out, s);
    EXPECT_FALSE(fs::exists(hf));
  }
  for (const fs::path& into : {newest, newest / "hf", root / "step_00000002" / "hf"}) {
    SCOPED_TRACE(into.string());
    const ProcResult r = convert(newest.string(), into.string());
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, "is inside the checkpoint");
    EXPECT_FALSE(fs::exists(newest / "model.safetensors"));
    EXPECT_FALSE(fs::exists(newest / "hf"));
  }
  const ProcResult ok = convert(newest.string(), hf);
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// model.init = "hf:DIR" naming no folder: says so, not "no config.json in DIR (found: (empty))".
TEST(ReliabilityMessages, HfInitThatIsNoFolderSaysWhatItIs) {
  const fs::path dir = fresh_dir("messages_hf_init");
  std::ofstream(dir / "afile") << "x";
  for (const auto& [path, says] : std::vector<std::pair<std::string, std::string>>{
           {(dir / "missing").string(), " does not exist"}, {(dir / "afile").string(), " is a file"},
           {"/dev/null", " is not a folder"}}) {
    SCOPED_TRACE(path);
    // Refused with the config, located at the key that names it.
    expect_error([&] { (void)loom::parse_config_string(tiny_config(dir / "run", 2), "m.toml", {"model.init=hf:" + path}); },
                 {"--set model.init=hf:" + path + ": model.init = \"hf:" + path + "\"", path + says});
  }
}

// A number too large for TOML (beyond 64-bit integers, beyond double) is told
// as that, wherever it is written — in the file or with --set — not taken for a
// string ("must be an integer, got string"). A word starting with a digit
// is still a string on the command line.
TEST(ReliabilityMessages, NumbersBeyondWhatTomlHoldsAreToldSo) {
  for (const std::string v : {"99999999999999999999", "-9223372036854775809", "1e999", "-1e999"}) {
    SCOPED_TRACE(v);
    expect_error([&] { (void)loom::parse_config_string("", "m.toml", {"train.steps=" + v}); },
                 {"--set train.steps=" + v, "train.steps = " + v + " is not a number Loom can hold"});
    expect_error([&] { (void)loom::parse_config_string("[train]\nsteps = " + v + "\n", "m.toml", {}); },
                 {"m.toml:2:", "TOML syntax error"});
  }
  EXPECT_EQ(loom::parse_config_string("", "m.toml", {"run.name=1st_run"}).run.name, "1st_run");
}

// A data position the data plugin refuses at resume (damaged, or from other
// data) is told with the checkpoint file that holds it: the plugin sees only
// the text of its state, so the core names meta.json and its "data_state".
TEST(ReliabilityMessages, RefusedDataStateNamesTheCheckpointFile) {
  const fs::path dir = fresh_dir("messages_data_state");
  {
    loom::Session s(loom::parse_config_string(tiny_config(dir / "run", 2), "m.toml", {"checkpoint.every=2"}));
    s.train();
  }
  const fs::path root = dir / "run" / "checkpoints", meta = root / "step_00000002" / "meta.json";
  nlohmann::json j = nlohmann::json::parse(read_text(meta));
  // Text that is not JSON, and the state of another plugin.
  for (const auto& [state, says] : std::vector<std::pair<std::string, std::string>>{
           {"{oops", "it is '{oops', not valid JSON"}, {"{\"source\": \"tokens\"}", "written by data plugin 'tokens'"}}) {
    SCOPED_TRACE(state);
    j["data_state"] = state;
    // Certified again, as a checkpoint written with this state would be.
    fs::remove(root / "step_00000002" / "COMPLETE");
    loom::ckpt::CheckpointWriter::write_meta(root.string(), 2, j.dump(2));
    loom::ckpt::CheckpointWriter::mark_complete(root.string(), 2);
    expect_error(
        [&] {
          loom::Session s(loom::parse_config_string(tiny_config(dir / "run", 4), "m.toml", {}));
          s.initialise();
        },
        {"cannot resume from " + meta.string() + ": its \"data_state\" (the position of data plugin 'synthetic')",
         says});
  }
}

namespace {

// A run of data plugin `plugin` (synthetic; tokens on one shard; megatron on
// a blend of two datasets) on the tiny model, with one checkpoint, of step 2,
// whose meta.json "data_state" the data-state tests rewrite — certified again,
// as a checkpoint written with that state would be — and `loom check` and
// `loom train` run on its config as processes, as a user runs them.
struct DataStateRun {
  std::string plugin;
  fs::path dir, cfg, root, meta;
  nlohmann::json original;  // meta.json as the run wrote it
  nlohmann::json own;       // its data_state, parsed
  std::string loom = std::string("'") + LOOM_CLI + "' ";

  explicit DataStateRun(const std::string& name) : plugin(name) {
    // One folder per test too: ctest runs tests of this suite side by side.
    dir = fresh_dir("messages_data_state_" + plugin + "_" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::string text = tiny_config(dir / "run", 2);
    const std::string syn = "plugin = \"synthetic\"\npattern = \"ramp\"\n";
    if (plugin == "tokens") {
      write_tokens(dir / "train.bin", token_pattern(20000, 96), 2, 96);  // 645 windows of 32 tokens
      text.replace(text.find(syn), syn.size(), "plugin = \"tokens\"\ntrain = \"" + (dir / "train.bin").string() + "\"\n");
    } else if (plugin == "megatron") {
      write_megatron(dir / "a", megatron_docs(300, 50, 96));
      write_megatron(dir / "b", megatron_docs(200, 40, 96));
      text.replace(text.find(syn), syn.size(), "plugin = \"megatron\"\nprefix = [\"" + (dir / "a").string() + "\", \"" +
                                                   (dir / "b").string() + "\"]\n");
    }
    cfg = dir / "c.toml";
    std::ofstream(cfg) << text;
    {
      loom::Session s(loom::parse_config_string(text, cfg.string(), {"checkpoint.every=2"}));
      s.train();
    }
    root = dir / "run" / "checkpoints";
    meta = root / "step_00000002" / "meta.json";
    original = nlohmann::json::parse(read_text(meta));
    own = nlohmann::json::parse(original["data_state"].get<std::string>());
  }

  // Writes `state` into the checkpoint's meta.json, certified again.
  void set_state(const std::string& state) const {
    nlohmann::json j = original;
    j["data_state"] = state;
    fs::remove(root / "step_00000002" / "COMPLETE");
    loom::ckpt::CheckpointWriter::write_meta(root.string(), 2, j.dump(2));
    loom::ckpt::CheckpointWriter::mark_complete(root.string(), 2);
  }
  // The state as written with the field at JSON pointer `at` set to the JSON `value`.
  std::string with(const std::string& at, const std::string& value) const {
    nlohmann::json j = own;
    j[nlohmann::json::json_pointer(at)] = nlohmann::json::parse(value);
    return j.dump();
  }
  // The state as written with the members of `patch` in place of its own (RFC 7386 merge patch).
  std::string patched(const nlohmann::json& patch) const {
    nlohmann::json j = own;
    j.merge_patch(patch);
    return j.dump();
  }
  // The state as written without `field`.
  std::string without(const std::string& field) const {
    nlohmann::json j = own;
    j.erase(field);
    return j.dump();
  }
  ProcResult check() const { return run_shell("timeout 300 " + loom + "check '" + cfg.string() + "'"); }
  // Two steps past the checkpoint; the config saves none, so step 2 stays the one resumed.
  ProcResult train() const { return run_shell("timeout 300 " + loom + "train '" + cfg.string() + "' --set train.steps=4"); }
  std::string refused() const {
    return "cannot resume from " + meta.string() + ": its \"data_state\" (the position of data plugin '" + plugin +
           "') is refused: ";
  }
};

// The refusal, from the message on to the end of its line.
std::string refusal(const std::string& out) {
  const size_t at = out.find("cannot resume from ");
  return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
}

// `state` is refused by `loom check` before it prints the plan or scans, with
// exit 1, and by `loom train` before its first step with the same message,
// which holds each of `parts` after the core's words naming meta.json.
void expect_refused_alike(const DataStateRun& r, const std::string& state, const std::vector<std::string>& parts) {
  SCOPED_TRACE("data_state = " + state);
  r.set_state(state);
  const ProcResult check = r.check();
  EXPECT_EQ(check.code, 1) << check.out;
  EXPECT_CONTAINS(check.out, r.refused());
  const std::string said = refusal(check.out);
  for (const std::string& p : parts) EXPECT_CONTAINS(said, p);
  EXPECT_FALSE(has(check.out, ": ok")) << check.out;
  EXPECT_FALSE(has(check.out, "data: ")) << "scanned before the refusal:\n" << check.out;
  const ProcResult train = r.train();
  EXPECT_EQ(train.code, 1) << train.out;
  EXPECT_EQ(said, refusal(train.out)) << "loom check:\n" << check.out << "\nloom train:\n" << train.out;
  EXPECT_FALSE(has(train.out, "step 3/")) << train.out;
}

// `state` passes `loom check` and `loom train` resumes from it and trains on.
void expect_resumed(const DataStateRun& r, const std::string& state) {
  SCOPED_TRACE("data_state = " + state);
  r.set_state(state);
  const ProcResult check = r.check();
  EXPECT_EQ(check.code, 0) << check.out;
  const ProcResult train = r.train();
  EXPECT_EQ(train.code, 0) << train.out;
  EXPECT_CONTAINS(train.out, "resumed from " + (r.root / "step_00000002").string() + " at step 2");
  EXPECT_CONTAINS(train.out, "step 4/4");
}

// The end of every refusal of a damaged field: the run has only this
// checkpoint, so what to do is to start afresh.
const std::string kDamagedTail = " (meta.json edited or damaged); the checkpoint cannot be used. No earlier checkpoint in ";

// A field of a data state, at JSON pointer `at`, named `key` in messages.
struct StateField {
  std::string at, key;
  enum Kind { integer, number, boolean } kind = integer;
  int64_t lo = 0, hi = std::numeric_limits<int64_t>::max();
};

// The hostile values of a field, as JSON: negative, fractional, beyond 2^64
// and an int64, just outside its range, and of every other JSON type.
std::vector<std::string> hostile_values(const StateField& f) {
  if (f.kind == StateField::boolean) return {"0", "1", "\"true\"", "null", "[]", "{}"};
  if (f.kind == StateField::number) return {"-0.5", "-1", "1.5", "1e300", "-1e300", "true", "\"0.5\"", "null", "[]", "{}"};
  std::vector<std::string> v = {"-1", "1.5", "0.5", "2.0", "-9223372036854775809", "18446744073709551616", "1e300",
                                "true", "false", "\"7\"", "null", "[]", "{}"};
  if (f.lo > 0) v.push_back(std::to_string(f.lo - 1));
  v.push_back(f.hi < std::numeric_limits<int64_t>::max() ? std::to_string(f.hi + 1) : "9223372036854775808");
  return v;
}

constexpr int64_t kPos = int64_t{1} << 53;  // positions and counts: at most 2^53
constexpr int64_t kDim = int64_t{1} << 20;  // ranks, micro-batch, seq_len: at most 2^20
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// Every hostile value of every field is refused naming the field and the
// value, as damage (with what to do), by `loom check` and `loom train` alike:
// the fields every data plugin's state holds (format version, cursor, seed,
// the world and micro-batch it was cut for), then the plugin's own `fields`.
void expect_every_field_refused(const DataStateRun& r, const std::vector<StateField>& fields) {
  std::vector<StateField> all = {{"/version", "version", StateField::integer, 1, kMax},
                                 {"/cursor", "cursor", StateField::integer, 0, kPos},
                                 {"/seed", "seed", StateField::integer, 0, kMax},
                                 {"/world", "world", StateField::integer, 1, kDim},
                                 {"/batch", "batch", StateField::integer, 1, kDim}};
  all.insert(all.end(), fields.begin(), fields.end());
  for (const StateField& f : all) {
    SCOPED_TRACE(f.key);
    for (const std::string& v : hostile_values(f))
      expect_refused_alike(r, r.with(f.at, v),
                           {"\"" + f.key + "\" is " + nlohmann::json::parse(v).dump() + ", expected ", kDamagedTail,
                            "checkpoint.resume = \"none\""});
  }
}

}  // namespace

// `loom check` gives the data plugin the position of the checkpoint the run
// would resume, with the code `loom train` resumes it with: every data
// position the plugin refuses — text that is not JSON, empty, JSON of
// another shape, another plugin's state, a field missing or of another type,
// a position in other data — is refused by `loom check` before it prints the
// plan, with exit 1 and the message `loom train` gives (naming meta.json and
// its "data_state"), for each data plugin that keeps a position.
TEST(ReliabilityMessages, CheckRefusesTheDataStateTheRunWould) {
  for (const std::string plugin : {"synthetic", "tokens", "megatron"}) {
    SCOPED_TRACE(plugin);
    const DataStateRun r(plugin);
    const std::string other = plugin == "tokens" ? "synthetic" : "tokens";
    expect_refused_alike(r, "{oops", {"it is '{oops', not valid JSON", kDamagedTail});
    expect_refused_alike(r, "", {"it is '', not valid JSON", kDamagedTail});
    expect_refused_alike(r, "[1, 2]", {"it is [1,2], not a JSON object", kDamagedTail});
    expect_refused_alike(r, "42", {"it is 42, not a JSON object", kDamagedTail});
    expect_refused_alike(r, nlohmann::json{{"source", other}}.dump(),
                         {"it was written by data plugin '" + other + "', not '" + plugin + "'",
                          "resume with data.plugin = \"" + other + "\"", "checkpoint.resume = \"none\""});
    expect_refused_alike(r, r.with("/source", "5"), {"\"source\" is 5, expected a string", kDamagedTail});
    expect_refused_alike(r, r.with("/version", "2"),
                         {"format version 2 of data plugin '" + plugin + "', which reads version 1 only",
                          "checkpoint.resume = \"none\""});
    for (const std::string field : {"source", "version", "cursor", "seed", "world", "batch"})
      expect_refused_alike(r, r.without(field), {"\"" + field + "\" is missing", kDamagedTail});
    // The state as written passes.
    expect_resumed(r, r.original["data_state"].get<std::string>());
  }
}

// Every numeric field a data plugin reads from its state — positions, counts,
// seeds, ranks, sizes, file and document numbers, the blend's weights; and
// the booleans beside them — is refused for each hostile value (negative,
// fractional, beyond 2^53 where it counts samples, beyond 2^64, just outside
// its range, a boolean, a string, null, an array, an object) naming meta.json,
// the field and the value, and what to do: the same by `loom check` and `loom
// train`. A negative cursor used to be read as an unsigned number and resumed
// at 2^64 - 1. Values at the edges of each range still resume.
TEST(ReliabilityMessages, EveryFieldOfTheSyntheticDataStateIsRefusedByName) {
  const DataStateRun r("synthetic");
  expect_every_field_refused(r, {{"/vocab", "vocab", StateField::integer, 1, 2147483647}});
  expect_refused_alike(r, r.with("/pattern", "\"zigzag\""),
                       {"\"pattern\" is \"zigzag\", expected \"random\" or \"ramp\"", kDamagedTail});
  for (const auto& [at, v] : std::vector<std::pair<std::string, std::string>>{
           {"/cursor", "0"}, {"/cursor", std::to_string(kPos)}, {"/seed", "0"}, {"/seed", std::to_string(kMax)},
           {"/world", std::to_string(kDim)}, {"/batch", std::to_string(kDim)}, {"/vocab", "1"},
           {"/vocab", "2147483647"}, {"/pattern", "\"random\""}})
    expect_resumed(r, r.with(at, v));
}

TEST(ReliabilityMessages, EveryFieldOfTheTokensDataStateIsRefusedByName) {
  const DataStateRun r("tokens");
  const int64_t W = r.own["windows_per_epoch"];
  ASSERT_EQ(W, 645);
  expect_every_field_refused(r, {{"/epoch", "epoch", StateField::integer, 0, kPos},
                                 {"/windows_per_epoch", "windows_per_epoch", StateField::integer, 1, kPos},
                                 {"/seq_len", "seq_len", StateField::integer, 1, kDim},
                                 {"/train_files/0/tokens", "train_files[0].tokens", StateField::integer, 0, kMax},
                                 {"/shuffle", "shuffle", StateField::boolean}});
  // A cursor past the windows of the epoch the state records, in range or at 2^53; an epoch the cursor is not in.
  for (const int64_t c : {W, 2 * W + 5, kPos})
    expect_refused_alike(r, r.with("/cursor", std::to_string(c)),
                         {"\"cursor\" is " + std::to_string(c) + " and \"epoch\" is 0, which disagree: at 645 windows "
                          "an epoch, window " + std::to_string(c) + " lies in epoch " + std::to_string(c / W),
                          kDamagedTail});
  expect_refused_alike(r, r.with("/epoch", "1"),
                       {"\"cursor\" is 16 and \"epoch\" is 1, which disagree", "epoch 1 holds windows [645, 1290)",
                        kDamagedTail});
  expect_refused_alike(r, r.with("/windows_per_epoch", "646"),
                       {"\"windows_per_epoch\" is 646, expected 645: the windows of seq_len + 1 = 32 tokens",
                        kDamagedTail});
  expect_refused_alike(r, r.with("/train_files/0", "5"), {"\"train_files[0]\" is 5, expected a JSON object", kDamagedTail});
  expect_refused_alike(r, r.with("/train_files/0/path", "7"), {"\"train_files[0].path\" is 7, expected a string"});
  // Positions in other data: other shards, another window length.
  expect_refused_alike(r, r.with("/train_files/0/tokens", "12345"),
                       {"the data changed since the checkpoint", "(12345)", "checkpoint.resume = \"none\""});
  expect_refused_alike(r, r.with("/train_files", "[]"), {"the data changed since the checkpoint"});
  expect_refused_alike(r, r.with("/seq_len", "63"),
                       {"counts windows of seq_len 63 but train.seq_len is now 31", "checkpoint.resume = \"none\""});
  // The edges: the first window, the last of an epoch, the first of the next, 2^53.
  for (const auto& [cursor, epoch] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 0}, {W - 1, 0}, {W, 1}, {kPos, kPos / W}})
    expect_resumed(r, r.patched({{"cursor", cursor}, {"epoch", epoch}}));
  for (const auto& [at, v] : std::vector<std::pair<std::string, std::string>>{
           {"/seed", "0"}, {"/seed", std::to_string(kMax)}, {"/world", std::to_string(kDim)},
           {"/batch", std::to_string(kDim)}, {"/shuffle", "false"}})
    expect_resumed(r, r.with(at, v));
}

TEST(ReliabilityMessages, EveryFieldOfTheMegatronDataStateIsRefusedByName) {
  const DataStateRun r("megatron");
  const nlohmann::json& d1 = r.own["datasets"][1];
  const int64_t seqs = d1["sequences"], first = d1["train_documents"][0];
  expect_every_field_refused(r, {{"/counts/0", "counts[0]", StateField::integer, 0, kPos},
                                 {"/counts/1", "counts[1]", StateField::integer, 0, kPos},
                                 {"/weights/0", "weights[0]", StateField::number},
                                 {"/weights/1", "weights[1]", StateField::number},
                                 {"/seq_len", "seq_len", StateField::integer, 1, kDim},
                                 {"/datasets/0/sequences", "datasets[0].sequences", StateField::integer, 0, kMax},
                                 {"/datasets/0/tokens", "datasets[0].tokens", StateField::integer, 0, kMax},
                                 {"/datasets/1/train_documents/0", "datasets[1].train_documents[0]",
                                  StateField::integer, 0, seqs},
                                 {"/datasets/1/train_documents/1", "datasets[1].train_documents[1]",
                                  StateField::integer, first, seqs},
                                 {"/shuffle", "shuffle", StateField::boolean}});
  const uint64_t c0 = r.own["counts"][0], c1 = r.own["counts"][1], cursor = r.own["cursor"];
  ASSERT_EQ(c0 + c1, cursor);
  // Counts that do not sum to the cursor (a cursor moved, a count moved), or not one per dataset.
  expect_refused_alike(r, r.with("/cursor", std::to_string(cursor + 1)),
                       {"sum to " + std::to_string(cursor) + " but \"cursor\" is " + std::to_string(cursor + 1),
                        kDamagedTail});
  expect_refused_alike(r, r.with("/cursor", std::to_string(kPos)),
                       {"sum to " + std::to_string(cursor) + " but \"cursor\" is " + std::to_string(kPos), kDamagedTail});
  expect_refused_alike(r, r.with("/counts/0", std::to_string(kPos)),
                       {"sum to " + std::to_string(kPos + c1) + " but \"cursor\" is " + std::to_string(cursor),
                        kDamagedTail});
  expect_refused_alike(r, r.with("/counts", "[" + std::to_string(cursor) + "]"),
                       {"\"counts\" has 1 per-dataset count(s) for 2 dataset(s)", kDamagedTail});
  expect_refused_alike(r, r.with("/weights", "[1.0]"), {"\"weights\" has 1 weight(s) for 2 dataset(s)", kDamagedTail});
  expect_refused_alike(r, r.with("/weights", "[0.9, 0.9]"), {"\"weights\" [0.9,0.9] sum to 1.8", kDamagedTail});
  expect_refused_alike(r, r.with("/datasets/1/train_documents", "[0, 1, 2]"),
                       {"\"datasets[1].train_documents\" is [0,1,2], expected [first, end)", kDamagedTail});
  expect_refused_alike(r, r.with("/datasets/1/train_documents", "[5, 3]"),
                       {"\"datasets[1].train_documents[1]\" is 3, expected an integer in [5, " + std::to_string(seqs) + "]",
                        kDamagedTail});
  expect_refused_alike(r, r.with("/datasets/1", "[]"), {"\"datasets[1]\" is [], expected a JSON object", kDamagedTail});
  expect_refused_alike(r, r.with("/datasets/0/prefix", "7"), {"\"datasets[0].prefix\" is 7, expected a string"});
  // Positions in other data: another dataset, other train documents, another sample length.
  expect_refused_alike(r, r.with("/datasets/0/sequences", "301"),
                       {"the data changed since the checkpoint", "checkpoint.resume = \"none\""});
  expect_refused_alike(r, r.with("/datasets/1/train_documents/0", "1"), {"the data changed since the checkpoint"});
  expect_refused_alike(r, r.with("/seq_len", "63"),
                       {"counts samples of seq_len 63 but train.seq_len is now 31", "checkpoint.resume = \"none\""});
  // The edges: the first sample; 2^53 samples, all from one dataset; one dataset's weight all of the blend.
  expect_resumed(r, r.patched({{"cursor", 0}, {"counts", {0, 0}}}));
  expect_resumed(r, r.patched({{"cursor", kPos}, {"counts", {kPos, 0}}}));
  expect_resumed(r, r.patched({{"cursor", kPos}, {"counts", {0, kPos}}}));
  expect_resumed(r, r.with("/weights", "[1.0, 0.0]"));
  for (const auto& [at, v] : std::vector<std::pair<std::string, std::string>>{
           {"/seed", "0"}, {"/seed", std::to_string(kMax)}, {"/world", std::to_string(kDim)},
           {"/batch", std::to_string(kDim)}, {"/shuffle", "false"}})
    expect_resumed(r, r.with(at, v));
}

// A damaged data position is damage of its checkpoint: the advice names the
// newest earlier checkpoint whose data position validates too (resuming from
// one whose position is damaged as well would only be refused again), the
// same by `loom check` and `loom train`.
TEST(ReliabilityMessages, DamagedDataStateAdviceNamesAnEarlierCheckpointWhosePositionIsGood) {
  const fs::path dir = fresh_dir("messages_data_state_advice");
  const std::string text = tiny_config(dir / "run", 4);
  const fs::path cfg = dir / "c.toml";
  std::ofstream(cfg) << text;
  {
    loom::Session s(loom::parse_config_string(text, cfg.string(), {"checkpoint.every=2"}));
    s.train();
  }
  const fs::path root = dir / "run" / "checkpoints";
  auto damage = [&](int step) {
    const fs::path meta = root / loom::cat("step_0000000", step) / "meta.json";
    nlohmann::json j = nlohmann::json::parse(read_text(meta));
    nlohmann::json state = nlohmann::json::parse(j["data_state"].get<std::string>());
    state["cursor"] = -1;
    j["data_state"] = state.dump();
    fs::remove(meta.parent_path() / "COMPLETE");
    loom::ckpt::CheckpointWriter::write_meta(root.string(), step, j.dump(2));
    loom::ckpt::CheckpointWriter::mark_complete(root.string(), step);
  };
  const std::string loom = std::string("'") + LOOM_CLI + "' ";
  auto expect_advice = [&](const std::string& advice) {
    const ProcResult check = run_shell("timeout 300 " + loom + "check '" + cfg.string() + "'");
    const ProcResult train = run_shell("timeout 300 " + loom + "train '" + cfg.string() + "' --set train.steps=6");
    EXPECT_EQ(check.code, 1) << check.out;
    EXPECT_EQ(train.code, 1) << train.out;
    EXPECT_CONTAINS(refusal(check.out), "step_00000004/meta.json: its \"data_state\" (the position of data plugin "
                                        "'synthetic') is refused: \"cursor\" is -1, expected an integer in [0, "
                                        "9007199254740992]" + kDamagedTail.substr(0, kDamagedTail.find(" No earlier")));
    EXPECT_CONTAINS(refusal(check.out), advice);
    EXPECT_EQ(refusal(check.out), refusal(train.out)) << check.out << "\n" << train.out;
  };
  damage(4);
  expect_advice("The newest earlier checkpoint that validates is " + (root / "step_00000002").string());
  damage(2);
  expect_advice("No earlier checkpoint in " + root.string() + " validates");
}

// The command line, the same for every command: `loom <command> --help`
// prints that command's usage and succeeds; an error names the command once
// ("loom check: error: ...", never "loom check: error: loom check: ...") and
// never an internal check; a flag that takes a value takes it as --flag=V or
// --flag V alike.
TEST(ReliabilityMessages, EveryCommandHelpsNamesItselfOnceAndTakesBothFlagForms) {
  const fs::path dir = fresh_dir("messages_cli");
  const fs::path cfg = dir / "c.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 2);
  const std::string loom = std::string("'") + LOOM_CLI + "' ";
  for (const char* cmd : {"train", "check", "bench", "compare", "convert", "plot", "plugins", "prepare"}) {
    SCOPED_TRACE(cmd);
    const ProcResult r = run_shell(loom + cmd + " --help");
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_CONTAINS(r.out, std::string("usage: loom ") + cmd);
  }
  const std::string c = "'" + cfg.string() + "'";
  struct Case { std::string cmd, args, says; };
  for (const Case& k : std::vector<Case>{
           {"train", "", "missing CONFIG"},
           {"train", c + " --bogus", "unknown argument '--bogus'"},
           {"check", c + " --world", "--world needs a value: --world=VALUE or --world VALUE"},
           {"check", c + " --world 8 --gpus-per-node 3",
            "--world 8 is not a multiple of --gpus-per-node 3: every node holds the same number of ranks"},
           {"check", c + " --world=8 --gpus-per-node=3", "--world 8 is not a multiple of --gpus-per-node 3"},
           {"check", c + " --bogus", "unknown argument '--bogus'"},
           {"bench", c + " --steps=0", "--steps needs a positive integer, got '0'"},
           {"bench", c + " --steps", "--steps needs a value"},
           {"bench", c + " --bogus", "unknown argument '--bogus'"},
           {"compare", c + " --strategies=", "--strategies= names nothing to compare"},
           {"compare", c + " --steps abc", "--steps needs a non-negative integer, got 'abc'"},
           {"compare", c + " --bogus", "unknown argument '--bogus'"},
           {"convert", "", "usage: loom convert"},
           {"convert", "'" + (dir / "none").string() + "' --to-hf=" + (dir / "hf").string(), "does not exist"},
           {"plot", "", "needs at least one RUN_DIR"},
           {"plot", "'" + dir.string() + "' --out p.jpg", "loom plot writes a PNG image; give --out a name ending in .png"},
           {"plugins", "--bogus", "unknown argument '--bogus'"},
           {"prepare", "text out in --bogus", "unknown option '--bogus'"},
           {"prepare", "text out in --threads -1", "--threads '-1' is not a non-negative integer (e.g. --threads 8"},
           {"prepare", "text out in --seed=-1", "--seed '-1' is not a non-negative integer (e.g. --seed 1234)"},
           {"version", "extra", "takes no arguments, got 'extra'"}}) {
    SCOPED_TRACE(k.cmd + " " + k.args);
    const ProcResult r = run_shell("cd '" + dir.string() + "' && " + loom + k.cmd + " " + k.args);
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_CONTAINS(r.out, k.says);
    const std::string prefix = "loom " + k.cmd + ": error: ";
    EXPECT_EQ(r.out.rfind(prefix, 0), 0u) << r.out;
    EXPECT_EQ(r.out.find(prefix, 1), std::string::npos) << r.out;
    EXPECT_FALSE(has(r.out, prefix + "loom " + k.cmd)) << r.out;
    EXPECT_FALSE(has(r.out, "[check failed")) << r.out;
  }
  // Both forms of a flag mean the same.
  for (const auto& [eq, space] : std::vector<std::pair<std::string, std::string>>{
           {"check " + c + " --set sharding.plugin=ddp --world=2 --gpus-per-node=2",
            "check " + c + " --set sharding.plugin=ddp --world 2 --gpus-per-node 2"},
           {"check --world=2 " + c + " --set sharding.plugin=ddp", "check --world 2 " + c + " --set sharding.plugin=ddp"}}) {
    SCOPED_TRACE(space);
    const ProcResult a = run_shell(loom + eq), b = run_shell(loom + space);
    EXPECT_EQ(a.code, 0) << a.out;
    EXPECT_EQ(b.code, 0) << b.out;
    EXPECT_EQ(a.out, b.out);
    EXPECT_CONTAINS(b.out, "ranks 2");
  }
}

// Every message about a key starts with where the value came from and names
// the key, also for checks made after the config is read: a plugin's required
// or empty key, token shard patterns that match nothing or name a folder that
// is not there (not a raw "glob error 2"), the synthetic data's vocab against
// the model, the step checkpoint.resume names — from the file or from --set.
TEST(ReliabilityMessages, EveryKeyMessageStartsWhereTheValueCameFromAndNamesTheKey) {
  const fs::path dir = fresh_dir("messages_located");
  struct Case { std::string toml; std::vector<std::string> sets; std::string at, says; };
  const std::string missing = (dir / "nope" / "*.bin").string();
  for (const Case& c : std::vector<Case>{
           {"[data]\nplugin = \"tokens\"\n", {}, "m.toml:1:1: ", "data.train is required"},
           {"[data]\nplugin = \"tokens\"\ntrain = \"\"\n", {}, "m.toml:3:9: ", "data.train is empty"},
           {"[data]\nplugin = \"tokens\"\ntrain = []\n", {}, "m.toml:3:9: ", "data.train is empty"},
           {"[data]\nplugin = \"tokens\"\ntrain = \"" + missing + "\"\nval = \"\"\n", {}, "m.toml:4:7: ", "data.val is empty"},
           {"[data]\nplugin = \"tokens\"\n", {"data.train=" + missing}, "--set data.train=" + missing + ": ",
            "data.train = \"" + missing + "\": the folder '" + (dir / "nope").string() + "' does not exist"},
           {"[data]\nplugin = \"tokens\"\ntrain = \"" + (dir / "*.none").string() + "\"\n", {}, "m.toml:3:9: ",
            "data.train = \"" + (dir / "*.none").string() + "\" matches no files"},
           {"[data]\nplugin = \"megatron\"\n", {}, "m.toml:1:1: ", "data.prefix is required"},
           {"[data]\nplugin = \"megatron\"\nprefix = \"\"\n", {}, "m.toml:3:10: ", "data.prefix is empty"},
           {"[data]\nplugin = \"megatron\"\nprefix = \"x\"\nsplit = \"\"\n", {}, "m.toml:4:9: ", "data.split is empty"},
           {"[data]\nplugin = \"megatron\"\nprefix = \"x\"\nval_prefix = [\"\"]\n", {}, "m.toml:4:14: ",
            "data.val_prefix is empty"}}) {
    SCOPED_TRACE(c.toml);
    const loom::ConfigTable t = loom::parse_config_table(c.toml, "m.toml", c.sets).table("data");
    try {
      if (t.get_string("plugin", "") == "tokens") (void)loom::plugins::TokensData::read_options(t);
      else (void)loom::plugins::MegatronData::read_options(t);
      ADD_FAILURE() << "accepted";
    } catch (const loom::Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(c.at, 0), 0u) << msg;
      EXPECT_CONTAINS(msg, c.says);
      EXPECT_FALSE(has(msg, "glob error")) << msg;
    }
  }
  // Checked when the data is opened and the run starts, still located.
  const std::string base = tiny_config(dir / "run", 2);
  expect_error([&] { loom::Session s(loom::parse_config_string(base, "m.toml", {"data.vocab=100000"})); },
               {"--set data.vocab=100000: ", "vocab = 100000 is larger than the model's vocab_size 96"});
  auto line_of = [&](const std::string& text, size_t pos) {
    return std::to_string(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(pos), '\n') + 1);
  };
  expect_error([&] { loom::Session s(loom::parse_config_string(base + "vocab = 100000\n", "m.toml", {})); },
               {"m.toml:" + line_of(base, base.size()) + ":9: ", "vocab = 100000"});
  for (const auto& [sets, at] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"checkpoint.resume=7"}, "--set checkpoint.resume=7: "},
           {{}, "m.toml:" + line_of(base, base.find("resume = ")) + ":10: "}}) {
    std::string text = base;
    if (sets.empty()) text.replace(text.find("resume = \"auto\""), 15, "resume = 7");
    loom::Session s(loom::parse_config_string(text, "m.toml", sets));
    expect_error([&] { s.initialise(); }, {at + "checkpoint.resume = 7: no checkpoint for step 7"});
  }
}

