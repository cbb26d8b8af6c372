// The config system: ConfigTable's typed, located reads and finish(), the typed
// run config with its ranges and cross-field checks, --set overrides, and
// argument splitting. Messages are compared whole where their wording is the
// user interface.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "loom/config.hpp"
#include "loom/error.hpp"
#include "hf_config.hpp"

namespace fs = std::filesystem;
using loom::Config;
using loom::ConfigTable;
using loom::test::hf_config_json;
using loom::test::write_hf_config;

namespace {

// The message of the loom::Error thrown by f, or a test failure.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const loom::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected loom::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected loom::Error, nothing was thrown";
  return "";
}

Config parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return loom::parse_config_string(text, "q.toml", overrides);
}
std::string parse_error(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return error_of([&] { parse(text, overrides); });
}

class ConfigFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("loom_test_config_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path write(const std::string& name, const std::string& text) {
    fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p;
  }
  fs::path dir_;
};

// Every core key set away from its default (but model.init: an HF folder's
// config.json would define the sizes; Config.HfInit*), plus plugin keys for
// the plugins.
const char* kFullConfig = R"([run]
name = "llama-test"
out_dir = "/tmp/out"
device = "cuda"
seed = 7
deterministic = true
log_level = "debug"
threads = 4
plugin_path = ["/opt/a", "/opt/b"]

[model]
init = "random"
layers = "fused"
hidden = 512
num_layers = 6
num_heads = 8
num_kv_heads = 2
ffn_hidden = 1376
vocab_size = 50000
max_seq_len = 4096
rope_theta = 500000.0
norm_eps = 1e-6
tied_embeddings = true
init_std = 0.01
recompute = "attention"

[train]
steps = 2000
micro_batch = 4
seq_len = 1024
grad_accum = 8
lr = 6e-4
min_lr = 6e-5
warmup_steps = 200
schedule = "linear"
grad_clip = 0.5
weight_decay = 0.05
beta1 = 0.8
beta2 = 0.99
eps = 1e-6
log_every = 10
validation_every = 500
validation_batches = 16

[checkpoint]
every = 100
keep_last = 0
resume = 1500
dir = "/ckpt"

[precision]
plugin = "bf16"
stochastic_rounding = true

[attention]
plugin = "cudnn"
path = "/opt/plugins/libloom-attention-cudnn.so"

[sharding]
plugin = "zero3"

[data]
plugin = "tokens"
train = "/data/train.bin"
)";

}  // namespace

// ---------------------------------------------------------------- full config

TEST(Config, FullConfigReadsEveryField) {
  Config c = parse(kFullConfig);
  EXPECT_EQ(c.source, "q.toml");
  EXPECT_EQ(c.run.name, "llama-test");
  EXPECT_EQ(c.run.out_dir, "/tmp/out");
  EXPECT_EQ(c.run.device, "cuda");
  EXPECT_EQ(c.run.seed, 7u);
  EXPECT_TRUE(c.run.deterministic);
  EXPECT_EQ(c.run.log_level, "debug");
  EXPECT_EQ(c.run.threads, 4);
  EXPECT_EQ(c.run.plugin_path, (std::vector<std::string>{"/opt/a", "/opt/b"}));

  EXPECT_EQ(c.model.init, "random");
  EXPECT_EQ(c.model.layers, "fused");
  EXPECT_EQ(c.model.spec.hidden, 512);
  EXPECT_EQ(c.model.spec.num_layers, 6);
  EXPECT_EQ(c.model.spec.num_heads, 8);
  EXPECT_EQ(c.model.spec.num_kv_heads, 2);
  EXPECT_EQ(c.model.spec.ffn_hidden, 1376);
  EXPECT_EQ(c.model.spec.vocab_size, 50000);
  EXPECT_EQ(c.model.spec.max_seq_len, 4096);
  EXPECT_DOUBLE_EQ(c.model.spec.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.model.spec.norm_eps, 1e-6);
  EXPECT_TRUE(c.model.spec.tied_embeddings);
  EXPECT_DOUBLE_EQ(c.model.init_std, 0.01);
  EXPECT_DOUBLE_EQ(c.model.embedding_init_std, 0.01);  // init_std's unless set
  EXPECT_EQ(c.model.recompute, "attention");

  EXPECT_EQ(c.train.steps, 2000);
  EXPECT_EQ(c.train.micro_batch, 4);
  EXPECT_EQ(c.train.seq_len, 1024);
  EXPECT_EQ(c.train.grad_accum, 8);
  EXPECT_DOUBLE_EQ(c.train.lr, 6e-4);
  EXPECT_DOUBLE_EQ(c.train.min_lr, 6e-5);
  EXPECT_EQ(c.train.warmup_steps, 200);
  EXPECT_EQ(c.train.schedule, "linear");
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 0.5);
  EXPECT_DOUBLE_EQ(c.train.weight_decay, 0.05);
  EXPECT_DOUBLE_EQ(c.train.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.train.beta2, 0.99);
  EXPECT_DOUBLE_EQ(c.train.eps, 1e-6);
  EXPECT_EQ(c.train.log_every, 10);
  EXPECT_EQ(c.train.validation_every, 500);
  EXPECT_EQ(c.train.validation_batches, 16);

  EXPECT_EQ(c.checkpoint.every, 100);
  EXPECT_EQ(c.checkpoint.keep_last, 0);
  EXPECT_EQ(c.checkpoint.resume, "1500");
  EXPECT_EQ(c.checkpoint.dir, "/ckpt");

  EXPECT_EQ(c.precision.plugin, "bf16");
  EXPECT_EQ(c.precision.path, "");
  EXPECT_EQ(c.attention.plugin, "cudnn");
  EXPECT_EQ(c.attention.path, "/opt/plugins/libloom-attention-cudnn.so");
  EXPECT_EQ(c.sharding.plugin, "zero3");
  EXPECT_EQ(c.data.plugin, "tokens");
  EXPECT_EQ(c.data.table.name(), "data");
  EXPECT_EQ(c.data.table.source(), "q.toml");
  EXPECT_EQ(c.data.table.get_string("train", ""), "/data/train.bin");
  EXPECT_NO_THROW(c.data.table.finish());
  EXPECT_TRUE(c.precision.table.get_bool("stochastic_rounding", false));
  EXPECT_NO_THROW(c.precision.table.finish());
}

TEST(Config, EmptyConfigGivesDefaults) {
  Config c = parse("");
  const loom::RunSection run;
  const loom::TrainSection train;
  const loom::ModelSpec spec;
  EXPECT_EQ(c.run.name, "run");
  EXPECT_EQ(c.run.out_dir, "runs/run");
  EXPECT_EQ(c.run.device, "cpu");
  EXPECT_EQ(c.run.seed, 1234u);
  EXPECT_FALSE(c.run.deterministic);
  EXPECT_EQ(c.run.log_level, "info");
  EXPECT_EQ(c.run.threads, 0);
  EXPECT_TRUE(c.run.plugin_path.empty());
  EXPECT_EQ(c.model.init, "random");
  EXPECT_EQ(c.model.layers, "native");
  EXPECT_EQ(c.model.spec.hidden, spec.hidden);
  EXPECT_EQ(c.model.spec.num_layers, spec.num_layers);
  EXPECT_EQ(c.model.spec.num_heads, spec.num_heads);
  EXPECT_EQ(c.model.spec.num_kv_heads, spec.num_kv_heads);
  EXPECT_EQ(c.model.spec.ffn_hidden, spec.ffn_hidden);
  EXPECT_EQ(c.model.spec.vocab_size, spec.vocab_size);
  EXPECT_EQ(c.model.spec.max_seq_len, spec.max_seq_len);
  EXPECT_DOUBLE_EQ(c.model.spec.rope_theta, spec.rope_theta);
  EXPECT_DOUBLE_EQ(c.model.spec.norm_eps, spec.norm_eps);
  EXPECT_EQ(c.model.spec.tied_embeddings, spec.tied_embeddings);
  EXPECT_DOUBLE_EQ(c.model.init_std, 0.02);
  EXPECT_DOUBLE_EQ(c.model.embedding_init_std, 0.02);
  EXPECT_EQ(c.model.recompute, "none");
  EXPECT_EQ(c.train.steps, 100);
  EXPECT_EQ(c.train.micro_batch, 8);
  EXPECT_EQ(c.train.seq_len, 256);
  EXPECT_EQ(c.train.grad_accum, 1);
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.train.min_lr, 3e-5);
  EXPECT_EQ(c.train.warmup_steps, 0);
  EXPECT_EQ(c.train.schedule, "cosine");
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 1.0);
  EXPECT_DOUBLE_EQ(c.train.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(c.train.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.train.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.train.eps, 1e-8);
  EXPECT_EQ(c.train.log_every, 1);
  EXPECT_EQ(c.train.validation_every, 0);
  EXPECT_EQ(c.train.validation_batches, 8);
  EXPECT_EQ(c.checkpoint.every, 0);
  EXPECT_EQ(c.checkpoint.keep_last, 3);
  EXPECT_EQ(c.checkpoint.resume, "auto");
  EXPECT_EQ(c.checkpoint.dir, "runs/run/checkpoints");
  EXPECT_EQ(c.precision.plugin, "fp32");
  EXPECT_EQ(c.attention.plugin, "naive");
  EXPECT_EQ(c.sharding.plugin, "none");
  EXPECT_EQ(c.data.plugin, "synthetic");
  // Absent plugin sections still hand the plugin a usable (empty) table.
  EXPECT_EQ(c.data.table.name(), "data");
  EXPECT_EQ(c.data.table.get_int("seed", 5), 5);
  EXPECT_NO_THROW(c.data.table.finish());
  // The struct defaults and the parsed defaults agree.
  EXPECT_EQ(c.run.seed, run.seed);
  EXPECT_EQ(c.train.steps, train.steps);
}

TEST(Config, OutDirAndCheckpointDirFollowRunName) {
  Config c = parse("[run]\nname = \"exp1\"\n");
  EXPECT_EQ(c.run.out_dir, "runs/exp1");
  EXPECT_EQ(c.checkpoint.dir, "runs/exp1/checkpoints");
  c = parse("[run]\nout_dir = \"/x/y\"\n");
  EXPECT_EQ(c.checkpoint.dir, "/x/y/checkpoints");
}

// run.name is one folder name (the default out_dir is runs/<name>): '/',
// "." and "..", blank names and control characters are refused, from the file
// and from --set; any other name, spaces and dots included, is a name.
TEST(Config, RunNameIsOneFolderName) {
  const std::string use = "; it names the run in logs and its default folder runs/<name>: use one name such as "
                          "\"llama-1b\" (letters, digits, '-', '_', '.', spaces), and run.out_dir for a folder elsewhere";
  EXPECT_EQ(parse_error("[run]\nname = \"a/b/../../../escaped\"\n"),
            "q.toml:2:8: run.name = \"a/b/../../../escaped\" holds '/': runs/<name> would be a path, not a folder of "
            "runs/" + use);
  EXPECT_EQ(parse_error("", {"run.name=\"/abs\""}),
            "--set run.name=\"/abs\": run.name = \"/abs\" holds '/': runs/<name> would be a path, not a folder of "
            "runs/" + use);
  EXPECT_EQ(parse_error("[run]\nname = \"..\"\n"),
            "q.toml:2:8: run.name = \"..\" is not a folder name of its own (runs/..)" + use);
  EXPECT_EQ(parse_error("[run]\nname = \".\"\n"), "q.toml:2:8: run.name = \".\" is not a folder name of its own (runs/.)" + use);
  EXPECT_EQ(parse_error("[run]\nname = \"   \"\n"), "q.toml:2:8: run.name = \"   \" is blank" + use);
  EXPECT_EQ(parse_error("[run]\nname = \"a\\nb\"\n"), "q.toml:2:8: run.name = \"a\\nb\" holds a control character" + use);
  EXPECT_EQ(parse_error("[run]\nname = \"a\\u0000b\"\n"),
            "q.toml:2:8: run.name = \"a\\u0000b\" holds a control character" + use);
  EXPECT_EQ(parse_error("[run]\nname = \"\"\n"),
            "q.toml:2:8: run.name must not be empty: it names the run in logs and the default out_dir");
  for (const char* ok : {"llama-1b", "my run", "v1.2", "..a", "a..", "run_7"}) {
    SCOPED_TRACE(ok);
    const Config c = parse(std::string("[run]\nname = \"") + ok + "\"\n");
    EXPECT_EQ(c.run.out_dir, std::string("runs/") + ok);
  }
  // A name beside an explicit out_dir is still a name (it heads every log line).
  EXPECT_NE(parse_error("[run]\nname = \"a/b\"\nout_dir = \"/tmp/x\"\n").find("holds '/'"), std::string::npos);
}

TEST(Config, IntegersAcceptedAsFloats) {
  Config c = parse("[train]\nlr = 1\nmin_lr = 0\ngrad_clip = 2\n");
  EXPECT_DOUBLE_EQ(c.train.lr, 1.0);
  EXPECT_DOUBLE_EQ(c.train.min_lr, 0.0);
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 2.0);
}

TEST(Config, EffectiveTomlRoundTrips) {
  Config c = parse(kFullConfig, {"train.steps=777", "data.extra=\"x\""});
  EXPECT_NE(c.effective_toml.find("steps = 777"), std::string::npos) << c.effective_toml;
  Config again = parse(c.effective_toml);
  EXPECT_EQ(again.train.steps, 777);
  EXPECT_DOUBLE_EQ(again.train.lr, c.train.lr);
  EXPECT_DOUBLE_EQ(again.train.eps, c.train.eps);
  EXPECT_DOUBLE_EQ(again.model.spec.norm_eps, c.model.spec.norm_eps);
  EXPECT_EQ(again.model.init, c.model.init);
  EXPECT_EQ(again.checkpoint.resume, "1500");
  EXPECT_EQ(again.data.table.get_string("extra", ""), "x");
  EXPECT_EQ(again.run.plugin_path, c.run.plugin_path);
  // Floats are written shortest-exact and stay floats.
  EXPECT_NE(c.effective_toml.find("lr = 0.0006\n"), std::string::npos) << c.effective_toml;
  EXPECT_NE(c.effective_toml.find("rope_theta = 500000.0\n"), std::string::npos) << c.effective_toml;
  EXPECT_NE(c.effective_toml.find("eps = 1e-6\n"), std::string::npos) << c.effective_toml;
  Config odd = parse("[train]\nweight_decay = 0.30000000000000004\n[model]\nrope_theta = 1e300\n");
  Config odd2 = parse(odd.effective_toml);
  EXPECT_EQ(odd2.train.weight_decay, 0.1 + 0.2);
  EXPECT_EQ(odd2.model.spec.rope_theta, 1e300);
}

TEST(Config, EffectiveTomlQuotesKeysAndKeepsArraysOfTables) {
  ConfigTable root = loom::parse_config_table(
      "[data]\n\"odd key\" = 1.5\nlist = [1, 2.0, \"s\"]\n[[data.sources]]\npath = \"a\"\n[[data.sources]]\npath = \"b\"\n",
      "d.toml");
  std::string text = root.to_toml();
  ConfigTable again = loom::parse_config_table(text, "again.toml").table("data");
  EXPECT_DOUBLE_EQ(again.get_float("odd key", 0), 1.5) << text;
  EXPECT_NE(text.find("[[data.sources]]"), std::string::npos) << text;
  EXPECT_NE(text.find("list = [1, 2.0, \"s\"]"), std::string::npos) << text;
}

// ------------------------------------------------------------- error classes

TEST(Config, UnknownKeyWithDidYouMean) {
  EXPECT_EQ(parse_error("[train]\nlr = 0.001\n\nsetps = 10\n"),
            "q.toml:4:1: unknown key 'train.setps' (did you mean 'steps'?); keys accepted in [train]: steps, "
            "micro_batch, seq_len, grad_accum, lr, min_lr, warmup_steps, schedule, grad_clip, weight_decay, beta1, "
            "beta2, eps, log_every, validation_every, validation_batches, max_skipped_steps, reset_attention_mask, "
            "reset_position_ids, eod_mask_loss");
}

TEST(Config, UnknownKeyWithoutCloseMatch) {
  std::string msg = parse_error("[model]\nhidden = 64\nnum_heads = 4\nnum_kv_heads = 4\nbanana = 3\n");
  EXPECT_EQ(msg.rfind("q.toml:5:1: unknown key 'model.banana'; keys accepted in [model]: init, layers, hidden,", 0),
            0u)
      << msg;
}

TEST(Config, FirstUnknownKeyInFileOrder) {
  // toml++ keeps keys sorted; the error must still name the first one written.
  EXPECT_EQ(parse_error("[run]\nzzz = 1\naaa = 2\n").substr(0, 40), "q.toml:2:1: unknown key 'run.zzz'; keys ");
}

TEST(Config, UnknownSection) {
  EXPECT_EQ(parse_error("[trian]\nsteps = 3\n"),
            "q.toml:1:2: unknown section [trian] (did you mean [train]?); sections: run, model, train, checkpoint, "
            "precision, attention, sharding, data, profile");
  EXPECT_EQ(parse_error("steps = 3\n"),
            "q.toml:1:1: unknown top-level key 'steps'; keys belong in one of the sections: run, model, train, "
            "checkpoint, precision, attention, sharding, data, profile");
}

TEST(Config, WrongType) {
  EXPECT_EQ(parse_error("[model]\nhidden = \"768\"\n"),
            "q.toml:2:10: model.hidden must be an integer, got string \"768\"");
  EXPECT_EQ(parse_error("[model]\nhidden = 76.8\n"), "q.toml:2:10: model.hidden must be an integer, got float 76.8");
  EXPECT_EQ(parse_error("[train]\nlr = \"fast\"\n"), "q.toml:2:6: train.lr must be a number, got string \"fast\"");
  EXPECT_EQ(parse_error("[run]\ndeterministic = 1\n"),
            "q.toml:2:17: run.deterministic must be a boolean (true or false), got integer 1");
  EXPECT_EQ(parse_error("[run]\nplugin_path = \"/opt\"\n"),
            "q.toml:2:15: run.plugin_path must be an array of strings, got string \"/opt\"");
  EXPECT_EQ(parse_error("[run]\nplugin_path = [\"/opt\", 3]\n"),
            "q.toml:2:15: run.plugin_path[1] must be a string, got integer 3");
  EXPECT_EQ(parse_error("train = 5\n"), "q.toml:1:9: train must be a table, got integer 5");
  EXPECT_EQ(parse_error("[model]\nlayers = 1\n"),
            "q.toml:2:10: model.layers must be one of the strings native, fused, got integer 1");
  EXPECT_EQ(parse_error("[checkpoint]\nresume = true\n"),
            "q.toml:2:10: checkpoint.resume must be an integer or a string, got boolean true");
}

TEST(Config, OutOfRange) {
  EXPECT_EQ(parse_error("[train]\nlr = -1\n"), "q.toml:2:6: train.lr = -1 is out of range: must be in [0, 10]");
  EXPECT_EQ(parse_error("[train]\nsteps = 0\n"), "q.toml:2:9: train.steps = 0 is out of range: must be >= 1");
  EXPECT_EQ(parse_error("[train]\ngrad_accum = -2\n"),
            "q.toml:2:14: train.grad_accum = -2 is out of range: must be in [1, 1048576]");
  EXPECT_EQ(parse_error("[train]\nbeta2 = 1.0\n"), "q.toml:2:9: train.beta2 = 1 is out of range: must be in [0, 0.9999999]");
  EXPECT_EQ(parse_error("[train]\nbeta1 = -0.1\n"),
            "q.toml:2:9: train.beta1 = -0.1 is out of range: must be in [0, 0.9999999]");
  EXPECT_EQ(parse_error("[train]\neps = 0\n"), "q.toml:2:7: train.eps = 0 is out of range: must be in [1.17549435e-38, 1]");
  EXPECT_EQ(parse_error("[train]\ngrad_clip = -1\n"),
            "q.toml:2:13: train.grad_clip = -1 is out of range: must be in [0, 3.40282347e38]");
  EXPECT_EQ(parse_error("[train]\nlr = nan\n"), "q.toml:2:6: train.lr = nan is out of range: must be in [0, 10]");
  EXPECT_EQ(parse_error("[model]\nrope_theta = -5.0\n"),
            "q.toml:2:14: model.rope_theta = -5 is out of range: must be >= 1");
  EXPECT_EQ(parse_error("[model]\nrope_theta = 0\n"),
            "q.toml:2:14: model.rope_theta = 0 is out of range: must be >= 1");
  EXPECT_EQ(parse_error("[run]\nseed = -1\n"), "q.toml:2:8: run.seed = -1 is out of range: must be >= 0");
}

TEST(Config, BadChoice) {
  EXPECT_EQ(parse_error("[train]\nschedule = \"cosin\"\n"),
            "q.toml:2:12: train.schedule = \"cosin\" is not one of: cosine, linear, constant (did you mean \"cosine\"?)");
  EXPECT_EQ(parse_error("[run]\ndevice = \"tpu\"\n"), "q.toml:2:10: run.device = \"tpu\" is not one of: cpu, cuda (did you mean \"cpu\"?)");
  EXPECT_EQ(parse_error("[run]\nlog_level = \"verbose\"\n"),
            "q.toml:2:13: run.log_level = \"verbose\" is not one of: trace, debug, info, warn, error");
  EXPECT_EQ(parse_error("[model]\nrecompute = \"partial\"\n"),
            "q.toml:2:13: model.recompute = \"partial\" is not one of: none, selective, attention, full");
  EXPECT_EQ(parse_error("[model]\ninit = \"pretrained\"\n"),
            "q.toml:2:8: model.init = \"pretrained\" is not accepted: use \"random\" or \"hf:/path/to/dir\" "
            "(a Hugging Face Llama folder)");
  EXPECT_NE(parse_error("[model]\ninit = \"hf:\"\n").find("model.init = \"hf:\" is not accepted"), std::string::npos);
  EXPECT_EQ(parse_error("[data]\nplugin = \"my data\"\n"),
            "q.toml:2:10: data.plugin = \"my data\" is not a plugin name: use letters, digits, '_' or '-' "
            "(e.g. \"synthetic\")");
}

TEST(Config, TomlSyntaxError) {
  std::string msg = parse_error("[train]\nsteps = 10\nlr = = 3\n");
  EXPECT_EQ(msg.rfind("q.toml:3:6: TOML syntax error: ", 0), 0u) << msg;
  msg = parse_error("[train\n");
  EXPECT_EQ(msg.rfind("q.toml:1:", 0), 0u) << msg;
  EXPECT_NE(msg.find("TOML syntax error"), std::string::npos) << msg;
}

// A string left open is told as that (toml++ says it met a control
// character: the newline), wherever it ends: at a line's end, at the file's
// end, basic or literal. Any other control character in a string keeps the
// parser's own description.
TEST(Config, UnclosedStringIsToldAsOne) {
  const std::string says = "TOML syntax error: a string is not closed before the end of its line (its closing quote "
                           "is missing; a string over several lines is written \"\"\"...\"\"\")";
  EXPECT_EQ(parse_error("[run]\nname = \"abc\nseed = 1\n"), "q.toml:2:12: " + says);
  EXPECT_EQ(parse_error("[run]\nname = \"abc\r\nseed = 1\r\n"), "q.toml:2:12: " + says);
  EXPECT_EQ(parse_error("[run]\nname = 'abc\nseed = 1\n"), "q.toml:2:12: " + says);
  EXPECT_EQ(parse_error("[run]\nname = \"abc"), "q.toml:2:12: " + says);
  const std::string ctl = parse_error(std::string("[run]\nname = \"a\x01z\"\n"));
  EXPECT_NE(ctl.find("control characters"), std::string::npos) << ctl;
  EXPECT_EQ(ctl.find("not closed"), std::string::npos) << ctl;
}

TEST(Config, CrossFieldErrors) {
  EXPECT_EQ(parse_error("[model]\nhidden = 100\nnum_heads = 8\n"),
            "q.toml:3:13: model.hidden = 100 is not divisible by model.num_heads = 8: the head dimension is "
            "hidden / num_heads");
  EXPECT_EQ(parse_error("[model]\nhidden = 64\nnum_heads = 4\nnum_kv_heads = 3\n"),
            "q.toml:4:16: model.num_heads = 4 is not divisible by model.num_kv_heads = 3: grouped-query attention "
            "shares each kv head among num_heads / num_kv_heads query heads");
  EXPECT_EQ(parse_error("[model]\nhidden = 60\nnum_heads = 4\nnum_kv_heads = 4\n"),
            "q.toml:2:10: the head dimension model.hidden / model.num_heads = 60 / 4 = 15 must be even: RoPE "
            "rotates pairs of dimensions");
  EXPECT_EQ(parse_error("[train]\nseq_len = 4096\n"),
            "q.toml:2:11: train.seq_len = 4096 exceeds model.max_seq_len = 2048: raise model.max_seq_len or "
            "shorten train.seq_len");
  EXPECT_EQ(parse_error("[train]\nlr = 1e-4\nmin_lr = 1e-3\n"),
            "q.toml:3:10: train.min_lr = 0.001 exceeds train.lr = 0.0001: the cosine schedule decays from lr down to "
            "min_lr");
  EXPECT_EQ(parse_error("[train]\nsteps = 10\nwarmup_steps = 11\n"),
            "q.toml:3:16: train.warmup_steps = 11 exceeds train.steps = 10");
  // Which device a recipe runs on is the recipe's to say, when it is created
  // (TrainE2E.CudaRecipeOnTheCpuIsRefusedByThePlugin): the config does not
  // match plugin names.
  EXPECT_NO_THROW(parse("[precision]\nplugin = \"bf16\"\n"));
  EXPECT_NO_THROW(parse("[run]\ndevice = \"cuda\"\n[precision]\nplugin = \"bf16\"\n"));
}

// A key that only does something in another mode (a decaying schedule's
// min_lr, fused layers' head_chunk, the experts' keys of a mixture of
// experts) is refused when that mode is off, located at the key and naming
// it and the setting that turns it off; in its mode it is accepted. (It would
// otherwise be read and ignored.)
TEST(Config, KeysOfAnotherModeAreRefused) {
  struct Case { std::string on, off, line, says; };
  const std::string moe = "[model]\nffn = \"moe\"\n", dense = "[model]\nffn = \"dense\"\n";
  for (const Case& c : std::vector<Case>{
           {"[train]\nschedule = \"cosine\"\n", "[train]\nschedule = \"constant\"\n", "min_lr = 1e-5\n",
            "train.min_lr applies to a decaying schedule only"},
           {"[train]\nschedule = \"linear\"\n", "[train]\nschedule = \"constant\"\n", "min_lr = 0\n",
            "train.min_lr applies to a decaying schedule only"},
           {"[model]\nlayers = \"fused\"\n", "[model]\nlayers = \"native\"\n", "head_chunk = 128\n",
            "model.head_chunk applies to fused layers only"},
           {"[model]\nlayers = \"fused\"\n", "[model]\n", "head_chunk = 0\n", "model.head_chunk applies to fused layers only"},
           {moe, dense, "num_experts = 8\n", "model.num_experts applies to a mixture of experts only"},
           {moe, dense, "top_k = 1\n", "model.top_k applies to a mixture of experts only"},
           {moe, dense, "router_aux_loss_coef = 0.1\n", "model.router_aux_loss_coef applies to a mixture of experts only"},
           {moe, dense, "router_jitter_noise = 0.1\n", "model.router_jitter_noise applies to a mixture of experts only"},
           {"[model]\ntied_embeddings = false\n", "[model]\ntied_embeddings = true\n", "embedding_init_std = 1.0\n",
            "model.embedding_init_std applies to an untied embedding"}}) {
    SCOPED_TRACE(c.line);
    EXPECT_NO_THROW(parse(c.on + c.line));
    const std::string msg = parse_error(c.off + c.line);
    const int line = static_cast<int>(std::count(c.off.begin(), c.off.end(), '\n')) + 1;
    EXPECT_EQ(msg.rfind("q.toml:" + std::to_string(line) + ":", 0), 0u) << msg;
    EXPECT_NE(msg.find(c.says), std::string::npos) << msg;
  }
  EXPECT_EQ(parse_error("[train]\nschedule = \"constant\"\nmin_lr = 1e-5\n"),
            "q.toml:3:10: train.min_lr applies to a decaying schedule only (cosine, linear: the lr after the decay): "
            "train.schedule = \"constant\" keeps train.lr after the warm-up; remove train.min_lr");
  EXPECT_EQ(parse_error("[model]\nhead_chunk = 64\n"),
            "q.toml:2:14: model.head_chunk applies to fused layers only (their LM head runs in chunks of tokens): set "
            "model.layers = \"fused\" or remove model.head_chunk (model.layers is \"native\", which computes the "
            "whole micro-batch's logits at once)");
  EXPECT_DOUBLE_EQ(parse("[model]\ninit_std = 0.01\nembedding_init_std = 1.0\n").model.embedding_init_std, 1.0);
  // The min_lr <= lr rule names the schedule that decays (constant has none).
  EXPECT_EQ(parse_error("[train]\nschedule = \"linear\"\nlr = 1e-4\nmin_lr = 1e-3\n"),
            "q.toml:4:10: train.min_lr = 0.001 exceeds train.lr = 0.0001: the linear schedule decays from lr down to "
            "min_lr");
}

// sharding.expert_parallel: a core key in the plugin's section, checked against the model.
TEST(Config, ExpertParallel) {
  EXPECT_EQ(parse("").expert_parallel, 1);
  const std::string moe = "[model]\nffn = \"moe\"\nnum_experts = 8\ntop_k = 2\n";
  EXPECT_EQ(parse(moe + "[sharding]\nplugin = \"ddp\"\nexpert_parallel = 4\n").expert_parallel, 4);
  EXPECT_EQ(parse(moe, {"sharding.expert_parallel=8"}).expert_parallel, 8);
  EXPECT_EQ(parse_error("[sharding]\nexpert_parallel = 2\n"),
            "q.toml:2:19: sharding.expert_parallel = 2 splits the experts of a mixture of experts, but the model is "
            "dense (model.ffn = \"dense\"): set model.ffn = \"moe\" or sharding.expert_parallel = 1");
  EXPECT_EQ(parse_error(moe + "[sharding]\nexpert_parallel = 3\n"),
            "q.toml:6:19: sharding.expert_parallel = 3 does not divide model.num_experts = 8: every rank of an "
            "expert-parallel group holds num_experts / expert_parallel experts; pick a divisor of 8");
  // On GPUs too: the exchange runs over NCCL there (blocks/expert_parallel.hpp).
  EXPECT_EQ(parse("[run]\ndevice = \"cuda\"\n" + moe + "[sharding]\nexpert_parallel = 2\n").expert_parallel, 2);
  const std::string zero = parse_error(moe + "[sharding]\nexpert_parallel = 0\n");
  EXPECT_NE(zero.find("expert_parallel"), std::string::npos) << zero;
}

// Every size key may be anywhere in its documented range, but their products
// (parameters, experts in the model, tokens of a step) can leave 64 bits:
// over the corners of those ranges, a config is either refused naming the keys
// or its int64 counts are exact (the long double count, non-negative, active
// at most total) and inside the documented bounds.
TEST(Config, CountsOfEverySizeInRangeAreExactOrRefusedNamingTheKeys) {
  int accepted = 0, refused = 0;
  for (int64_t hidden : {int64_t{2}, int64_t{4096}, int64_t{1} << 20})
    for (int64_t ffn : {int64_t{1}, int64_t{1} << 20})
      for (int64_t layers : {1, 64, 4096})
        for (int64_t experts : {0, 8, 4096})
          for (int64_t top_k : {1, 64})
            for (int64_t vocab : {int64_t{2}, int64_t{2147483647}})
              for (bool tied : {false, true}) {
                if (top_k > std::max<int64_t>(experts, 1) || (experts == 0 && top_k != 1)) continue;
                std::ostringstream t;
                t << "[model]\nhidden = " << hidden << "\nnum_heads = 1\nnum_kv_heads = 1\nffn_hidden = " << ffn
                  << "\nnum_layers = " << layers << "\nvocab_size = " << vocab
                  << "\ntied_embeddings = " << (tied ? "true" : "false") << "\n";
                if (experts > 0) t << "ffn = \"moe\"\nnum_experts = " << experts << "\ntop_k = " << top_k << "\n";
                SCOPED_TRACE(t.str());
                try {
                  const loom::ModelSpec s = parse(t.str()).model.spec;
                  ++accepted;
                  EXPECT_EQ(static_cast<long double>(s.total_params()), s.total_params_ld());
                  EXPECT_GT(s.total_params(), 0);
                  EXPECT_LE(s.total_params(), loom::kMaxParams);
                  EXPECT_GT(s.active_params(), 0);
                  EXPECT_LE(s.active_params(), s.total_params());
                  EXPECT_GT(s.matmul_params(), 0);
                  EXPECT_LE(s.matmul_params(), s.total_matmul_params());
                  EXPECT_LE(s.total_matmul_params(), s.total_params());
                  EXPECT_GT(s.flops_per_token(2048), 0.0);
                } catch (const loom::Error& e) {
                  ++refused;
                  const std::string msg = e.what();
                  EXPECT_EQ(msg.rfind("q.toml:", 0), 0u) << msg;
                  const bool params = msg.find("parameters, more than Loom plans for (at most 2^50") != std::string::npos;
                  const bool experts_total = msg.find("experts, more than Loom plans for (at most 2^20") != std::string::npos;
                  EXPECT_TRUE(params || experts_total) << msg;
                  for (const char* key : {"model.num_layers = ", "model.hidden = "})
                    if (params) EXPECT_NE(msg.find(key), std::string::npos) << msg;
                  if (experts_total) EXPECT_NE(msg.find("model.num_experts = "), std::string::npos) << msg;
                }
              }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
  // 1024 layers of 4096 experts of 2^20 x 2^20: an int64 count of them reads -4.6e18.
  const std::string msg = parse_error("[model]\nhidden = 1048576\nnum_heads = 2\nnum_kv_heads = 2\nnum_layers = 1024\n"
                                      "ffn_hidden = 1048576\nffn = \"moe\"\nnum_experts = 4096\ntop_k = 2\n");
  EXPECT_EQ(msg.rfind("q.toml:5:14: the model would have 1.38e+19 parameters", 0), 0u) << msg;
  // Tokens of a step: each key in range, the product beyond 2^40.
  for (int64_t accum : {int64_t{1}, int64_t{1} << 20}) {
    const std::string text = "[model]\nmax_seq_len = 1048576\n[train]\nmicro_batch = 1048576\nseq_len = 1048576\n"
                             "grad_accum = " + std::to_string(accum) + "\n";
    if (accum == 1) {
      EXPECT_EQ(parse(text).train.micro_batch * parse(text).train.seq_len, int64_t{1} << 40);
    } else {
      EXPECT_EQ(parse_error(text), "q.toml:6:14: train.micro_batch = 1048576 x train.seq_len = 1048576 x "
                                   "train.grad_accum = 1048576 = 1.15e+18 tokens per rank and step, more than Loom "
                                   "plans for (at most 2^40 = 1.1e+12); lower them");
    }
  }
}

TEST(Config, TypoReportedBeforeCrossFieldError) {
  // max_seq_lne is misspelt, so max_seq_len keeps its default 2048 and
  // seq_len 4096 exceeds it: the typo is the real problem and comes first.
  std::string msg = parse_error("[model]\nmax_seq_lne = 8192\n[train]\nseq_len = 4096\n");
  EXPECT_EQ(msg.rfind("q.toml:2:1: unknown key 'model.max_seq_lne' (did you mean 'max_seq_len'?)", 0), 0u) << msg;
}

TEST(Config, ResumeValues) {
  EXPECT_EQ(parse("[checkpoint]\nresume = \"none\"\n").checkpoint.resume, "none");
  EXPECT_EQ(parse("[checkpoint]\nresume = \"auto\"\n").checkpoint.resume, "auto");
  EXPECT_EQ(parse("[checkpoint]\nresume = 0\n").checkpoint.resume, "0");
  EXPECT_EQ(parse("[checkpoint]\nresume = \"250\"\n").checkpoint.resume, "250");
  EXPECT_EQ(parse_error("[checkpoint]\nresume = \"latest\"\n"),
            "q.toml:2:10: checkpoint.resume = \"latest\" is not accepted: use \"auto\" (newest complete checkpoint), "
            "\"none\" (start fresh) or a step number >= 0");
  EXPECT_EQ(parse_error("[checkpoint]\nresume = -3\n"),
            "q.toml:2:10: checkpoint.resume = -3 is not accepted: use \"auto\" (newest complete checkpoint), "
            "\"none\" (start fresh) or a step number >= 0");
  EXPECT_NE(parse_error("[checkpoint]\nresume = \"12abc\"\n").find("checkpoint.resume = \"12abc\" is not accepted"),
            std::string::npos);
  EXPECT_NE(parse_error("[checkpoint]\nresume = \"+5\"\n").find("is not accepted"), std::string::npos);
}

// ------------------------------------------------------------------ files

TEST_F(ConfigFiles, LoadsFileAndLocatesErrorsByPath) {
  fs::path good = write("good.toml", kFullConfig);
  Config c = loom::load_config(good, {});
  EXPECT_EQ(c.source, good.string());
  EXPECT_EQ(c.train.steps, 2000);

  fs::path bad = write("bad.toml", "[train]\nsteps = 10\nlr = -1\n");
  EXPECT_EQ(error_of([&] { loom::load_config(bad, {}); }),
            bad.string() + ":3:6: train.lr = -1 is out of range: must be in [0, 10]");
}

// model.init = "hf:DIR": the folder's config.json defines the model. Its
// sizes become the config's (the cross-field rules, the counts and the saved
// config see the model that is trained); every [model] key it determines,
// set by the user to another value, is refused naming both values and the
// file; the same value is accepted, and the effective config reads back.
TEST_F(ConfigFiles, HfInitSizesAreTheFoldersAndAKeyThatDiffersIsRefused) {
  const fs::path llama = write_hf_config(dir_ / "llama", hf_config_json("llama", R"("num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "tie_word_embeddings": true)",
                                                                          {.ffn = 160, .vocab = 96}));
  const std::string head = "[model]\ninit = \"hf:" + llama.string() + "\"\n";
  const Config c = parse(head + "[train]\nseq_len = 32\n");
  const loom::ModelSpec& s = c.model.spec;
  EXPECT_EQ(s.hidden, 64);
  EXPECT_EQ(s.num_layers, 2);
  EXPECT_EQ(s.num_heads, 4);
  EXPECT_EQ(s.num_kv_heads, 2);
  EXPECT_EQ(s.ffn_hidden, 160);
  EXPECT_EQ(s.vocab_size, 96);
  EXPECT_EQ(s.max_seq_len, 64);
  EXPECT_DOUBLE_EQ(s.norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(s.rope_theta, 500000.0);
  EXPECT_TRUE(s.tied_embeddings);
  EXPECT_FALSE(s.moe());
  for (const char* line : {"hidden = 64\n", "num_layers = 2\n", "num_kv_heads = 2\n", "ffn_hidden = 160\n",
                           "vocab_size = 96\n", "max_seq_len = 64\n", "norm_eps = 1e-6\n", "rope_theta = 500000.0\n",
                           "tied_embeddings = true\n", "ffn = \"dense\"\n"})
    EXPECT_NE(c.effective_toml.find(line), std::string::npos) << line << " not in:\n" << c.effective_toml;
  const Config again = parse(c.effective_toml);
  EXPECT_EQ(again.model.spec.hidden, 64);
  EXPECT_EQ(again.model.spec.max_seq_len, 64);

  // Every key the folder determines: the folder's value is accepted, another is refused.
  struct Case { const char* key; const char* same; const char* other; const char* hf_key; const char* theirs; };
  for (const Case& k : std::vector<Case>{{"hidden", "64", "128", "hidden_size", "64"},
                                        {"num_layers", "2", "3", "num_hidden_layers", "2"},
                                        {"num_heads", "4", "8", "num_attention_heads", "4"},
                                        {"num_kv_heads", "2", "4", "num_key_value_heads", "2"},
                                        {"ffn_hidden", "160", "256", "intermediate_size", "160"},
                                        {"vocab_size", "96", "258", "vocab_size", "96"},
                                        {"max_seq_len", "64", "2048", "max_position_embeddings", "64"},
                                        {"rope_theta", "500000.0", "20000", "rope_theta", "500000"},
                                        {"norm_eps", "1e-6", "1e-5", "rms_norm_eps", "1e-6"},
                                        {"tied_embeddings", "true", "false", "tie_word_embeddings", "true"},
                                        {"ffn", "\"dense\"", "\"moe\"", "model_type \"llama\": dense", "\"dense\""}}) {
    SCOPED_TRACE(k.key);
    EXPECT_NO_THROW(parse(head + k.key + " = " + k.same + "\n"));
    EXPECT_EQ(parse_error(head + k.key + " = " + k.other + "\n"),
              "q.toml:3:" + std::to_string(std::string(k.key).size() + 4) + ": model." + k.key + " = " + k.other +
                  " differs from the model in " + (llama / "config.json").string() + " (" + k.hf_key + " = " + k.theirs +
                  "): with model.init = \"hf:" + llama.string() + "\" the folder's config.json defines the model, so "
                  "model." + k.key + " would be ignored. Remove model." + k.key + " or set it to " + k.theirs);
    // The same from the command line, located at the --set.
    const std::string set = std::string(k.key) == "ffn" ? "model.ffn=moe" : std::string("model.") + k.key + "=" + k.other;
    EXPECT_EQ(parse_error(head, {set}).rfind("--set " + set + ": model." + k.key + " = ", 0), 0u) << parse_error(head, {set});
  }
  // Keys of a mixture of experts: the folder is dense.
  EXPECT_EQ(parse_error(head + "num_experts = 8\n"),
            "q.toml:3:15: model.num_experts applies to a mixture of experts, but " + (llama / "config.json").string() +
                " describes a dense Llama (model_type \"llama\"), which model.init = \"hf:" + llama.string() +
                "\" trains: remove model.num_experts");
  // A sequence longer than max_position_embeddings raises the model's max_seq_len, as the run does.
  const Config longer = parse(head + "[train]\nseq_len = 128\n");
  EXPECT_EQ(longer.model.spec.max_seq_len, 128);
  EXPECT_EQ(parse(longer.effective_toml).model.spec.max_seq_len, 128);

  // A Mixtral folder: the experts are the folder's too.
  const fs::path mixtral = write_hf_config(dir_ / "mixtral", hf_config_json("mixtral", R"("num_local_experts": 4,
    "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01)", {.ffn = 96, .vocab = 96}));
  const std::string mhead = "[model]\ninit = \"hf:" + mixtral.string() + "\"\n";
  const Config m = parse(mhead + "[train]\nseq_len = 32\n");
  EXPECT_EQ(m.model.ffn, "moe");
  EXPECT_EQ(m.model.spec.num_experts, 4);
  EXPECT_EQ(m.model.spec.top_k, 2);
  EXPECT_DOUBLE_EQ(m.model.spec.router_aux_loss_coef, 0.01);
  EXPECT_EQ(parse(m.effective_toml).model.spec.num_experts, 4);
  EXPECT_NO_THROW(parse(mhead + "top_k = 2\n"));
  EXPECT_NE(parse_error(mhead + "num_experts = 8\n").find("model.num_experts = 8 differs from the model in "),
            std::string::npos);
  EXPECT_NE(parse_error(mhead + "router_aux_loss_coef = 0.02\n").find("(router_aux_loss_coef = 0.01)"),
            std::string::npos);

  // A folder that cannot be read is refused with the config, located at model.init.
  EXPECT_EQ(parse_error("[model]\ninit = \"hf:" + (dir_ / "nope").string() + "\"\n")
                .rfind("q.toml:2:8: model.init = \"hf:" + (dir_ / "nope").string() + "\": ", 0),
            0u);
  write_hf_config(llama, R"({"model_type": "llama", "hidden_size": 64})");
  const std::string broken = parse_error(head);
  EXPECT_EQ(broken.rfind("q.toml:2:8: model.init = \"hf:" + llama.string() + "\": " + (llama / "config.json").string() +
                             ": required key \"num_hidden_layers\" is missing", 0),
            0u) << broken;
}

TEST_F(ConfigFiles, MissingFile) {
  fs::path missing = dir_ / "nope.toml";
  std::string msg = error_of([&] { loom::load_config(missing, {}); });
  EXPECT_EQ(msg.rfind("config file '" + missing.string() + "' not found", 0), 0u) << msg;
  msg = error_of([&] { loom::load_config(dir_, {}); });
  EXPECT_NE(msg.find("is a directory"), std::string::npos) << msg;
}

TEST_F(ConfigFiles, SyntaxErrorInFile) {
  fs::path bad = write("syntax.toml", "[run]\nname = \"unterminated\n");
  std::string msg = error_of([&] { loom::load_config(bad, {}); });
  EXPECT_EQ(msg.rfind(bad.string() + ":2:", 0), 0u) << msg;
  EXPECT_NE(msg.find("TOML syntax error"), std::string::npos) << msg;
}

// -------------------------------------------------------------- overrides

TEST(ConfigOverrides, TypedValues) {
  Config c = parse(kFullConfig, {"train.steps=1000", "train.lr=1e-3", "data.plugin=synthetic", "run.deterministic=false",
                                 "run.name=\"quoted name\"", "run.plugin_path=[\"/x\"]", "model.recompute=full",
                                 "train.min_lr = 0"});
  EXPECT_EQ(c.train.steps, 1000);
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-3);
  EXPECT_EQ(c.data.plugin, "synthetic");
  EXPECT_FALSE(c.run.deterministic);
  EXPECT_EQ(c.run.name, "quoted name");
  EXPECT_EQ(c.run.plugin_path, std::vector<std::string>{"/x"});
  EXPECT_EQ(c.model.recompute, "full");
  EXPECT_DOUBLE_EQ(c.train.min_lr, 0.0);
}

TEST(ConfigOverrides, LaterOverrideWinsAndCreatesSections) {
  Config c = parse("", {"train.steps=5", "train.steps=6", "data.train=/d/train.bin"});
  EXPECT_EQ(c.train.steps, 6);
  // data.train goes into the [data] table for the data plugin to read.
  EXPECT_EQ(c.data.table.get_string("train", ""), "/d/train.bin");
  EXPECT_NO_THROW(c.data.table.finish());
}

TEST(ConfigOverrides, ErrorsLocatedAtTheOverride) {
  EXPECT_EQ(parse_error(kFullConfig, {"train.steps=abc"}),
            "--set train.steps=abc: train.steps must be an integer, got string \"abc\"");
  EXPECT_EQ(parse_error(kFullConfig, {"train.lr=20"}),
            "--set train.lr=20: train.lr = 20 is out of range: must be in [0, 10]");
  EXPECT_EQ(parse_error("", {"train.setps=10"}),
            "--set train.setps=10: unknown key 'train.setps' (did you mean 'steps'?); keys accepted in [train]: "
            "steps, micro_batch, seq_len, grad_accum, lr, min_lr, warmup_steps, schedule, grad_clip, weight_decay, "
            "beta1, beta2, eps, log_every, validation_every, validation_batches, max_skipped_steps, reset_attention_mask, "
            "reset_position_ids, eod_mask_loss");
  EXPECT_EQ(parse_error("", {"trian.steps=10"}).substr(0, 60),
            "--set trian.steps=10: unknown section [trian] (did you mean ");
  EXPECT_EQ(parse_error("", {"run.device=gpu"}),
            "--set run.device=gpu: run.device = \"gpu\" is not one of: cpu, cuda (did you mean \"cpu\"?)");
}

// A table (or an array of tables) as a --set value would replace the whole
// table at that key and drop what the file sets there: refused, at any depth,
// naming the keys to set one by one; dotted keys merge into the file's table.
TEST(ConfigOverrides, TablesAreRefusedAsValuesAndDottedKeysMerge) {
  const std::string file = "[run]\nname = \"a\"\nseed = 1\nthreads = 1\n[data]\nplugin = \"synthetic\"\n";
  EXPECT_EQ(parse_error(file, {"run={name=\"zz\", out_dir=\"/tmp/o\"}"}),
            "--set run={name=\"zz\", out_dir=\"/tmp/o\"}: a table cannot be a --set value: it would replace all of "
            "run, dropping the keys the file sets there. Set its keys one by one: --set run.name=\"zz\" --set "
            "run.out_dir=\"/tmp/o\"");
  EXPECT_EQ(parse_error(file, {"model = { hidden = 64 }"}),
            "--set model = { hidden = 64 }: a table cannot be a --set value: it would replace all of model, dropping "
            "the keys the file sets there. Set its keys one by one: --set model.hidden=64");
  EXPECT_EQ(parse_error(file, {"data.sub={}"}),
            "--set data.sub={}: a table cannot be a --set value: it would replace all of data.sub, dropping the keys "
            "the file sets there. Set its keys one by one (--set data.sub.key=value)");
  EXPECT_EQ(parse_error(file, {"run.list=[{a=1}, {a=2}]"}),
            "--set run.list=[{a=1}, {a=2}]: an array of tables cannot be a --set value; write run.list in the config "
            "file ([[run.list]] tables)");
  // Arrays of values are values.
  EXPECT_EQ(parse(file, {"run.plugin_path=[\"/x\"]"}).run.plugin_path, std::vector<std::string>{"/x"});
  const Config c = parse(file, {"run.name=\"zz\"", "run.out_dir=\"/tmp/o\""});
  EXPECT_EQ(c.run.name, "zz");
  EXPECT_EQ(c.run.out_dir, "/tmp/o");
  EXPECT_EQ(c.run.seed, 1u);
  EXPECT_EQ(c.run.threads, 1);
}

TEST(ConfigOverrides, MalformedOverrides) {
  EXPECT_EQ(parse_error("", {"train.steps"}),
            "--set train.steps: expected section.key=value (e.g. --set train.steps=100)");
  EXPECT_EQ(parse_error("", {"train.steps="}),
            "--set train.steps=: missing value (write train.steps=\"\" for an empty string)");
  EXPECT_EQ(parse_error("", {"train..steps=1"}),
            "--set train..steps=1: 'train..steps' is not a dotted key: each part must be letters, digits, '_' or '-'");
  std::string msg = parse_error("", {"run.name=\"open"});
  EXPECT_EQ(msg.rfind("--set run.name=\"open: the value is not valid TOML: ", 0), 0u) << msg;
  EXPECT_EQ(parse_error("[train]\nsteps = 3\n", {"train.steps.x=1"}),
            "--set train.steps.x=1: train.steps is integer 3, not a table, so it cannot hold 'x'");
}

// -------------------------------------------------------- plugin tables

TEST(ConfigPlugin, PluginTableRejectsUnreadKeys) {
  Config c = parse("[data]\nplugin = \"tokens\"\ntrain = \"/d/t.bin\"\nseq = 4\n");
  const ConfigTable& t = c.data.table;
  EXPECT_EQ(t.get_string("train", ""), "/d/t.bin");
  EXPECT_EQ(t.get_string("valid", ""), "");  // probed, absent: still an accepted key
  EXPECT_EQ(error_of([&] { t.finish(); }),
            "q.toml:4:1: unknown key 'data.seq'; keys accepted in [data] by plugin 'tokens': "
            "plugin, path, train, valid");
}

TEST(ConfigPlugin, PluginKeyTypoFromOverride) {
  Config c = parse("[data]\nplugin = \"tokens\"\n", {"data.trian=/d"});
  (void)c.data.table.get_string("train", "");
  EXPECT_EQ(error_of([&] { c.data.table.finish(); }),
            "--set data.trian=/d: unknown key 'data.trian' (did you mean 'train'?); keys accepted in [data] by "
            "plugin 'tokens': plugin, path, train");
}

TEST(ConfigPlugin, CopiesShareTheReadRecord) {
  Config c = parse("[precision]\nplugin = \"fp32\"\namax_history = 16\n");
  ConfigTable copy = c.precision.table;  // e.g. the PluginInit a plugin receives
  EXPECT_EQ(copy.get_int("amax_history", 1, 1, 1024), 16);
  EXPECT_NO_THROW(c.precision.table.finish());
}

TEST(ConfigPlugin, NestedTables) {
  ConfigTable root = loom::parse_config_table("[data]\nplugin = \"mix\"\n[data.weights]\na = 0.5\nb = 0.7\nc = 1\n",
                                              "m.toml");
  ConfigTable data = root.table("data");
  (void)data.get_string("plugin", "");
  ConfigTable w = data.table("weights");
  EXPECT_EQ(w.name(), "data.weights");
  EXPECT_EQ(w.keys(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_DOUBLE_EQ(w.get_float("a", 0), 0.5);
  EXPECT_DOUBLE_EQ(w.get_float("b", 0), 0.7);
  EXPECT_EQ(error_of([&] { w.finish(); }),
            "m.toml:6:1: unknown key 'data.weights.c'; keys accepted in [data.weights]: a, b");
  EXPECT_NO_THROW(data.finish());  // `weights` was taken with table()
  EXPECT_EQ(w.where("a"), "m.toml:4:5");
  EXPECT_EQ(w.where("zz"), "m.toml:3:1");  // absent key: the table header
  EXPECT_EQ(error_of([&] { w.fail("b", "too heavy"); }), "m.toml:5:5: too heavy");
}

TEST(ConfigPlugin, GettersOnPluginTables) {
  ConfigTable t = loom::parse_config_table("[p]\nmode = \"b\"\nn = 3\nf = 2.5\nflag = true\nstep = 7\nlist = [\"x\"]\n",
                                           "p.toml")
                      .table("p");
  EXPECT_TRUE(t.has("mode"));
  EXPECT_FALSE(t.has("missing"));
  EXPECT_EQ(t.get_choice("mode", "a", {"a", "b"}), "b");
  EXPECT_EQ(t.get_int("n", 0, 0, 3), 3);
  EXPECT_DOUBLE_EQ(t.get_float("f", 0, 0, 2.5), 2.5);
  EXPECT_TRUE(t.get_bool("flag", false));
  EXPECT_EQ(t.get_int_or_string("step", "auto"), "7");
  EXPECT_EQ(t.get_int_or_string("other", "auto"), "auto");
  EXPECT_EQ(t.get_string_list("list"), std::vector<std::string>{"x"});
  EXPECT_EQ(error_of([&] { t.get_int("n", 0, 4); }), "p.toml:3:5: p.n = 3 is out of range: must be >= 4");
  // An infinite bound is no bound; every finite one is stated.
  EXPECT_EQ(error_of([&] { t.get_float("f", 0, -std::numeric_limits<double>::infinity(), 2); }),
            "p.toml:4:5: p.f = 2.5 is out of range: must be <= 2");
  EXPECT_EQ(error_of([&] { t.get_float("f", 0, -1e300, 2); }),
            "p.toml:4:5: p.f = 2.5 is out of range: must be in [-1e300, 2]");
}

TEST(ConfigPlugin, DefaultConstructedTableIsEmpty) {
  ConfigTable t;
  EXPECT_FALSE(t.has("x"));
  EXPECT_EQ(t.get_int("x", 4), 4);
  EXPECT_EQ(t.get_string("s", "d"), "d");
  EXPECT_TRUE(t.keys().empty());
  EXPECT_NO_THROW(t.finish());
  EXPECT_EQ(t.table("sub").get_float("y", 1.5), 1.5);
}

TEST(ConfigPlugin, MarkUsed) {
  ConfigTable t = loom::parse_config_table("[p]\nplugin = \"x\"\nkeep = 1\n", "p.toml").table("p");
  t.mark_used("plugin");
  EXPECT_NE(error_of([&] { t.finish(); }).find("unknown key 'p.keep'"), std::string::npos);
  t.mark_used("keep");
  EXPECT_NO_THROW(t.finish());
}

// ---------------------------------------------------------- did_you_mean

TEST(DidYouMean, Cases) {
  const std::vector<std::string> keys{"steps", "lr", "min_lr", "micro_batch", "seq_len", "warmup_steps"};
  EXPECT_EQ(loom::did_you_mean("setps", keys), "steps");          // transposition = distance 2
  EXPECT_EQ(loom::did_you_mean("step", keys), "steps");           // deletion
  EXPECT_EQ(loom::did_you_mean("lr", keys), "lr");                // exact
  EXPECT_EQ(loom::did_you_mean("minlr", keys), "min_lr");
  EXPECT_EQ(loom::did_you_mean("micro_bach", keys), "micro_batch");
  EXPECT_EQ(loom::did_you_mean("warmup_stpes", keys), "warmup_steps");
  EXPECT_EQ(loom::did_you_mean("banana", keys), "");              // nothing close
  EXPECT_EQ(loom::did_you_mean("x", {}), "");
  // Long words allow len/3 edits: 12 letters -> 4.
  EXPECT_EQ(loom::did_you_mean("wrmp_stepsxx", keys), "warmup_steps");
  EXPECT_EQ(loom::did_you_mean("abcdefghijkl", {"abcdefgh"}), "abcdefgh");   // distance 4 <= 12/3
  EXPECT_EQ(loom::did_you_mean("abcdefghijkl", {"abcdefg"}), "");            // distance 5 > 4
  // Nearest wins; ties go to the first candidate.
  EXPECT_EQ(loom::did_you_mean("seq_lem", {"seq_len", "seq_lex"}), "seq_len");
  EXPECT_EQ(loom::did_you_mean("ab", {"xy", "ab_"}), "ab_");
  // Rewriting every character is no suggestion, even within the distance limit.
  EXPECT_EQ(loom::did_you_mean("c", {"a", "b"}), "");
  EXPECT_EQ(loom::did_you_mean("ab", {"lr"}), "");
  EXPECT_EQ(loom::did_you_mean("tpu", {"cpu", "cuda"}), "cpu");
}

// Case is no distance: a value, key or section written in another case gets
// the name it spells as its suggestion, in every kind of message.
TEST(DidYouMean, CaseIsNoDistance) {
  EXPECT_EQ(loom::did_you_mean("INFO", {"trace", "debug", "info"}), "info");
  EXPECT_EQ(loom::did_you_mean("usr1", {"USR1", "USR2", "none"}), "USR1");
  EXPECT_EQ(loom::did_you_mean("X", {"a", "x"}), "x");
  EXPECT_EQ(parse_error("[run]\nlog_level = \"INFO\"\n"),
            "q.toml:2:13: run.log_level = \"INFO\" is not one of: trace, debug, info, warn, error (did you mean \"info\"?)");
  EXPECT_NE(parse_error("[run]\nstop_signal = \"usr1\"\n").find("(did you mean \"USR1\"?)"), std::string::npos);
  EXPECT_NE(parse_error("[run]\ndevice = \"CPU\"\n").find("(did you mean \"cpu\"?)"), std::string::npos);
  EXPECT_NE(parse_error("[train]\nschedule = \"COSINE\"\n").find("(did you mean \"cosine\"?)"), std::string::npos);
  EXPECT_NE(parse_error("[TRAIN]\nsteps = 1\n").find("unknown section [TRAIN] (did you mean [train]?)"), std::string::npos);
  EXPECT_NE(parse_error("[train]\nSteps = 1\n").find("(did you mean 'steps'?)"), std::string::npos);
}

// ------------------------------------------------------------------ docs

namespace {
std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
std::vector<std::string> split(const std::string& s, const std::string& sep) {
  std::vector<std::string> out;
  size_t b = 0;
  for (size_t e; (e = s.find(sep, b)) != std::string::npos; b = e + sep.size()) out.push_back(s.substr(b, e - b));
  out.push_back(s.substr(b));
  return out;
}
}  // namespace

TEST(ConfigDocs, EveryCoreKeyIsDocumentedInOrder) {
  const std::string doc = read_text(fs::path(LOOM_SOURCE_DIR) / "docs" / "CONFIG.md");
  ASSERT_FALSE(doc.empty());
  for (std::string section : {"run", "model", "train", "checkpoint", "profile"}) {
    // The keys the core reads, from the accepted list of an unknown-key error.
    std::string msg = parse_error("[" + section + "]\nzzzz_not_a_key = 1\n");
    const std::string marker = "keys accepted in [" + section + "]: ";
    ASSERT_NE(msg.find(marker), std::string::npos) << msg;
    std::vector<std::string> read = split(msg.substr(msg.find(marker) + marker.size()), ", ");
    // The keys the doc's table for the section lists.
    size_t at = doc.find("## `[" + section + "]`");
    ASSERT_NE(at, std::string::npos) << section;
    size_t end = doc.find("\n## ", at + 1);
    std::istringstream rows(doc.substr(at, end - at));
    std::vector<std::string> documented;
    for (std::string line; std::getline(rows, line);)
      if (line.rfind("| `", 0) == 0) documented.push_back(line.substr(3, line.find('`', 3) - 3));
    EXPECT_EQ(documented, read) << "docs/CONFIG.md [" << section << "] is out of date";
  }
}

TEST(ConfigDocs, ExampleParses) {
  const std::string doc = read_text(fs::path(LOOM_SOURCE_DIR) / "docs" / "CONFIG.md");
  size_t at = doc.find("## Example");
  ASSERT_NE(at, std::string::npos);
  size_t b = doc.find("```toml\n", at);
  ASSERT_NE(b, std::string::npos);
  b += 8;
  std::string example = doc.substr(b, doc.find("```", b) - b);
  Config c = loom::parse_config_string(example, "CONFIG.md example", {});
  EXPECT_EQ(c.run.name, "llama-125m");
  EXPECT_EQ(c.model.spec.num_kv_heads, 4);
  EXPECT_EQ(c.sharding.plugin, "zero2");
}

// ------------------------------------------------------------- arguments

TEST(ConfigArgs, SplitsFileOverridesAndRest) {
  loom::ConfigArgs a = loom::parse_config_args(
      {"c.toml", "--set", "train.steps=5", "--set=train.lr=1e-3", "--dry-run", "extra", "--set", "data.plugin=x"});
  EXPECT_EQ(a.file, "c.toml");
  EXPECT_EQ(a.overrides, (std::vector<std::string>{"train.steps=5", "train.lr=1e-3", "data.plugin=x"}));
  EXPECT_EQ(a.rest, (std::vector<std::string>{"--dry-run", "extra"}));
  a = loom::parse_config_args({"--set", "a.b=1", "c.toml"});
  EXPECT_EQ(a.file, "c.toml");
  EXPECT_EQ(a.overrides, std::vector<std::string>{"a.b=1"});
}

// A command's flags that take a value keep it beside them in either form, so
// that "--steps 3 c.toml" does not take 3 for the CONFIG.
TEST(ConfigArgs, ValueFlagsKeepTheirValues) {
  loom::ConfigArgs a = loom::parse_config_args({"--steps", "3", "c.toml", "--json=x.json", "--warmup", "1", "--breakdown"},
                                               {"--steps", "--warmup", "--json"});
  EXPECT_EQ(a.file, "c.toml");
  EXPECT_EQ(a.rest, (std::vector<std::string>{"--steps", "3", "--json=x.json", "--warmup", "1", "--breakdown"}));
  // Last, or before another option, the flag stays alone (the command says it needs a value).
  a = loom::parse_config_args({"c.toml", "--steps", "--breakdown"}, {"--steps"});
  EXPECT_EQ(a.rest, (std::vector<std::string>{"--steps", "--breakdown"}));
}

TEST(ConfigArgs, Errors) {
  EXPECT_EQ(error_of([] { loom::parse_config_args({"c.toml", "--set"}); }),
            "--set needs a value: --set section.key=value");
  EXPECT_EQ(error_of([] { loom::parse_config_args({"--set", "a.b=1"}); }),
            "missing CONFIG: expected CONFIG [--set section.key=value]...");
}
