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
    {"model", "init_std", true, Use::fp32}, {"model", "head_chunk", false}, {"train", "steps", false},
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
  for (const std::string state : {"{oops", "{\"source\": \"tokens\"}"}) {
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
         "data state"});
  }
}

// `loom check` gives the data plugin the position of the checkpoint the run
// would resume, with the code `loom train` resumes it with: every data
// position the plugin refuses — text that is not JSON, empty, JSON of
// another shape, another plugin's state, a field missing or of another type,
// a position in other data — is refused by `loom check` before it prints the
// plan, with exit 1 and the message `loom train` gives (naming meta.json and
// its "data_state"), for each data plugin that keeps a position.
TEST(ReliabilityMessages, CheckRefusesTheDataStateTheRunWould) {
  const std::string loom = std::string("'") + LOOM_CLI + "' ";
  // The refusal, from the message on to the end of its line.
  auto refusal = [](const std::string& out) {
    const size_t at = out.find("cannot resume from ");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  for (const std::string plugin : {"synthetic", "tokens"}) {
    SCOPED_TRACE(plugin);
    const fs::path dir = fresh_dir("messages_check_data_state_" + plugin);
    std::string text = tiny_config(dir / "run", 2);
    if (plugin == "tokens") {
      write_tokens(dir / "train.bin", token_pattern(20000, 96), 2, 96);
      const std::string syn = "plugin = \"synthetic\"\npattern = \"ramp\"\n";
      text.replace(text.find(syn), syn.size(), "plugin = \"tokens\"\ntrain = \"" + (dir / "train.bin").string() + "\"\n");
    }
    const fs::path cfg = dir / "c.toml";
    std::ofstream(cfg) << text;
    {
      loom::Session s(loom::parse_config_string(text, cfg.string(), {"checkpoint.every=2"}));
      s.train();
    }
    const fs::path root = dir / "run" / "checkpoints", meta = root / "step_00000002" / "meta.json";
    const nlohmann::json original = nlohmann::json::parse(read_text(meta));
    const nlohmann::json own = nlohmann::json::parse(original["data_state"].get<std::string>());
    auto set_state = [&](const std::string& state) {
      nlohmann::json j = original;
      j["data_state"] = state;
      // Certified again, as a checkpoint written with this state would be.
      fs::remove(root / "step_00000002" / "COMPLETE");
      loom::ckpt::CheckpointWriter::write_meta(root.string(), 2, j.dump(2));
      loom::ckpt::CheckpointWriter::mark_complete(root.string(), 2);
    };
    std::vector<std::string> states = {"{oops", "", "[1, 2]", "42",
                                       nlohmann::json{{"source", plugin == "tokens" ? "synthetic" : "tokens"}}.dump(),
                                       nlohmann::json{{"source", "megatron"}, {"version", 1}}.dump()};
    for (const std::string field : {"cursor", "seed", "world", "batch"}) {
      nlohmann::json missing = own, wrong = own;
      missing.erase(field);
      wrong[field] = "x";
      states.push_back(missing.dump());
      states.push_back(wrong.dump());
    }
    if (plugin == "tokens") {  // a position in other data: other shards, another window length
      nlohmann::json files = own, windows = own;
      files["train_files"][0]["tokens"] = 12345;
      windows["seq_len"] = 63;
      states.push_back(files.dump());
      states.push_back(windows.dump());
    }
    for (const std::string& state : states) {
      SCOPED_TRACE("data_state = " + state);
      set_state(state);
      const ProcResult check = run_shell("timeout 300 " + loom + "check '" + cfg.string() + "'");
      EXPECT_EQ(check.code, 1) << check.out;
      EXPECT_CONTAINS(check.out, "cannot resume from " + meta.string() + ": its \"data_state\" (the position of data "
                                 "plugin '" + plugin + "') is refused: ");
      EXPECT_FALSE(has(check.out, ": ok")) << check.out;
      EXPECT_FALSE(has(check.out, "data: ")) << "scanned before the refusal:\n" << check.out;
      const ProcResult train = run_shell("timeout 300 " + loom + "train '" + cfg.string() + "' --set train.steps=4");
      EXPECT_EQ(train.code, 1) << train.out;
      EXPECT_EQ(refusal(check.out), refusal(train.out)) << "loom check:\n" << check.out << "\nloom train:\n" << train.out;
      EXPECT_FALSE(has(train.out, "step 3/")) << train.out;
    }
    // The state as written passes.
    set_state(original["data_state"].get<std::string>());
    const ProcResult ok = run_shell("timeout 300 " + loom + "check '" + cfg.string() + "'");
    EXPECT_EQ(ok.code, 0) << ok.out;
  }
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

