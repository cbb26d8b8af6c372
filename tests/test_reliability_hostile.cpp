// Restored recipe state and what `loom convert` writes (docs/RELIABILITY.md
// "Checkpoints"):
//  - every field an FP8 recipe restores (fp8_delayed, fp8_current, fp8_block:
//    scales, amax history, counters, the options record) is checked at
//    resume like the checkpoint's own fields: a value out of range, not
//    finite, of another kind or at odds with another field is refused naming
//    the checkpoint, the rank file, the tensor, the element and the value,
//    with the way back to the newest earlier checkpoint that validates —
//    also when the checkpoint's certificate was recomputed after the edit;
//  - state an option change made stale (format, margin, amax_compute_algo)
//    starts afresh, warned with the option's old and new value, while an
//    unchanged resume keeps every bit; a change of the state's layout
//    (amax_history_len) is refused naming the key;
//  - `loom convert` refuses a checkpoint whose weights hold NaN or inf (the
//    read resuming uses refuses it), and a bf16 export that would turn a
//    finite weight into inf; it exits 1 and writes nothing.
// Each class is checked over every field and several values, not one example.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/train_checkpoint.hpp"
#include "config/run_config.hpp"
#include "gpu_test_util.hpp"
#include "loom/fp8.hpp"
#include "loom/precision.hpp"
#include "reliability_util.hpp"
#include "test_util.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;
using namespace loom::test;
using loom::Session;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();
const double kDNaN = std::numeric_limits<double>::quiet_NaN();

// `loom ARGS` as a user runs it (bounded in time).
std::string cli(const std::string& args) { return "timeout 120 '" + std::string(LOOM_CLI) + "' " + args; }

loom::Config parse(const std::string& text, const std::vector<std::string>& ov = {}) {
  return loom::parse_config_string(text, "state.toml", ov);
}

// tiny_config with a [precision] table (the synthetic ramp data, 2 layers).
std::string config_with(const fs::path& out, int64_t steps, const std::string& precision) {
  return tiny_config(out, steps) + "[precision]\n" + precision + "\n";
}

// A host tensor over `data` of the record's dtype and shape.
loom::Tensor tensor_of(void* data, const loom::ckpt::TensorRecord& rec) {
  loom::Tensor t(data, rec.dtype, loom::Device::cpu, {});
  for (int64_t d : rec.shape) t.shape[t.ndim++] = d;
  t.set_contiguous();
  return t;
}

// Rewrites tensor `tensor` of rank 0's file of a complete checkpoint and
// recertifies it (the rank file's header CRC in meta.json, COMPLETE over
// meta.json), as someone editing a checkpoint with Loom's own writer would:
// every certificate agrees, only the values are bad. `edit(data, n)` changes
// the tensor's values in place (its dtype's elements).
void rewrite_tensor(const fs::path& step_dir, const std::string& tensor, const std::function<void(void*, int64_t)>& edit) {
  using namespace loom::ckpt;
  const fs::path root = step_dir.parent_path();
  const int64_t step = CheckpointReader(step_dir.string(), 0).step();
  std::vector<std::vector<std::byte>> bufs;
  std::vector<std::pair<std::string, loom::Tensor>> items;
  {
    CheckpointReader r(step_dir.string(), 0);
    ASSERT_TRUE(r.has(tensor)) << tensor << " is not in " << step_dir.string();
    for (const std::string& name : r.names()) {
      const TensorRecord& rec = r.info(name);
      bufs.emplace_back(rec.bytes);
      loom::Tensor t = tensor_of(bufs.back().data(), rec);
      r.read(name, t);
      if (name == tensor) edit(t.data, t.numel());
      items.emplace_back(name, t);
    }
  }
  fs::remove(step_dir / "COMPLETE");
  CheckpointWriter w(root.string(), step, 0);
  for (auto& [name, t] : items) w.add(name, t);
  const uint32_t crc = w.write_shard();
  auto meta = nlohmann::json::parse(read_text(step_dir / "meta.json"));
  meta["shard_header_crc32"][0] = crc;
  fs::remove(step_dir / "meta.json");
  CheckpointWriter::write_meta(root.string(), step, meta.dump(2));
  CheckpointWriter::mark_complete(root.string(), step);
}

// A tensor of rank 0's file, as raw bytes.
std::vector<std::byte> tensor_bytes(const fs::path& step_dir, const std::string& tensor) {
  loom::ckpt::CheckpointReader r(step_dir.string(), 0);
  const loom::ckpt::TensorRecord& rec = r.info(tensor);
  std::vector<std::byte> out(rec.bytes);
  loom::Tensor t = tensor_of(out.data(), rec);
  r.read(tensor, t);
  return out;
}
template <class T>
std::vector<T> tensor_values(const fs::path& step_dir, const std::string& tensor) {
  const std::vector<std::byte> b = tensor_bytes(step_dir, tensor);
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// A recipe's state tensor of a session, by name, as raw bytes (a GPU recipe's
// scales and history live on the device: read through the backend).
std::vector<std::byte> state_of(Session& s, const std::string& name) {
  for (const loom::StateTensor& t : loom::probe(s).precision().state_tensors())
    if (t.name == name) {
      std::vector<std::byte> out(t.tensor.bytes());
      if (t.tensor.device == loom::Device::cuda) {
        loom::probe(s).backend().download(out.data(), t.tensor, out.size());
      } else {
        const auto* p = static_cast<const std::byte*>(t.tensor.data);
        std::copy(p, p + out.size(), out.begin());
      }
      return out;
    }
  ADD_FAILURE() << "no state tensor " << name;
  return {};
}
template <class T>
std::vector<T> state_values(Session& s, const std::string& name) {
  const std::vector<std::byte> b = state_of(s, name);
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// Trains `precision` for 4 steps with checkpoints at 2 and 4 into dir/run;
// returns the folder of step 4 (the one a resume takes).
fs::path trained(const fs::path& dir, const std::string& precision, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> ov = extra;
  ov.push_back("checkpoint.every=2");
  ov.push_back("train.validation_every=0");
  Session s(parse(config_with(dir / "run", 4, precision), ov));
  s.train();
  return dir / "run" / "checkpoints" / "step_00000004";
}

// A fresh copy of `good` (the trained run folder) at dir/run, for one edit.
void restore_run(const fs::path& good, const fs::path& dir) {
  fs::remove_all(dir / "run");
  fs::copy(good, dir / "run", fs::copy_options::recursive);
}

struct Edit {
  std::string tensor;   // "fp8.scale" (the recipe's name; the file holds "precision.<name>")
  int64_t index;        // the element changed
  double value;         // written as the tensor's dtype
  std::string shown;    // how the message shows it
  std::string says;     // what else the message must say about it
  std::vector<std::pair<int64_t, double>> also = {};  // other elements set with it
};

void apply(const fs::path& step, const Edit& e) {
  const bool f64 = loom::ckpt::CheckpointReader(step.string(), 0).info("precision." + e.tensor).dtype == loom::DType::f64;
  rewrite_tensor(step, "precision." + e.tensor, [&](void* data, int64_t n) {
    std::vector<std::pair<int64_t, double>> sets = e.also;
    sets.emplace_back(e.index, e.value);
    for (const auto& [i, v] : sets) {
      ASSERT_LT(i, n);
      if (f64) static_cast<double*>(data)[i] = v;
      else static_cast<float*>(data)[i] = static_cast<float>(v);
    }
  });
}

// Each edit of the step-4 checkpoint's recipe state is refused at resume with
// the checkpoint, rank file, tensor, value and the way back to step 2.
void expect_every_edit_refused(const std::string& name, const std::string& precision, const std::vector<Edit>& edits,
                               const std::vector<std::string>& ov = {}) {
  const fs::path dir = fresh_dir("state_" + name);
  const fs::path good = dir / "good";
  trained(dir, precision, ov);
  fs::rename(dir / "run", good);
  for (const Edit& e : edits) {
    SCOPED_TRACE(e.tensor + "[" + std::to_string(e.index) + "] = " + e.shown);
    restore_run(good, dir);
    const fs::path step = dir / "run" / "checkpoints" / "step_00000004";
    apply(step, e);
    // The certificates agree: only the value is bad.
    ASSERT_NO_THROW(loom::ckpt::CheckpointSet(step.string()).check_files());
    expect_error(
        [&] {
          std::vector<std::string> o = ov;
          o.push_back("checkpoint.every=2");
          Session s(parse(config_with(dir / "run", 6, precision), o));
          s.initialise();
        },
        {step.string(), (step / "rank_00000.bin").string(), "'" + e.tensor + "'", e.shown, e.says,
         "is refused", "step_00000002", "(it resumes from step 2)"});
  }
}

}  // namespace

// fp8_delayed: every field of its state — scales (each role), the amax
// history (written rows and rows no step wrote yet), the four counters and
// the options record — refused with the value.
TEST(ReliabilityHostile, EveryFieldOfFp8DelayedStateIsCheckedAtResume) {
  // 4 steps of a history of 8: rows 1..4 hold amaxes, rows 0 and 5..7 are 0.
  // 14 linears (2 layers x 7) x 3 roles = 42 tensors.
  const int64_t T = 42;
  const std::vector<Edit> edits = {
      {"fp8.scale", 0, kNaN, "nan", "a scale is positive and finite"},
      {"fp8.scale", 1, kInf, "inf", "a scale is positive and finite"},
      {"fp8.scale", 2, -kInf, "-inf", "(the scale of linear"},
      {"fp8.scale", 5, 0.0, "is 0:", " dy)"},
      {"fp8.scale", 7, -1.0, "is -1:", " w)"},
      {"fp8.scale", 41, -0.0, "is -0:", "positive and finite"},
      {"fp8.scale", 40, 1e-40, "is 9.9999461e-41:", "with a finite inverse"},
      {"fp8.amax_history", 1 * T + 3, kNaN, "nan", "an amax entry is finite and >= 0"},
      {"fp8.amax_history", 2 * T + 40, kInf, "inf", "row 2"},
      {"fp8.amax_history", 4 * T, -0.5, "-0.5", "finite and >= 0"},
      {"fp8.amax_history", 0 * T + 6, 3.0, "is 3,", "only rows 1..4 hold amaxes"},
      {"fp8.amax_history", 7 * T + 1, 1e-3, "0.00100000005", "only rows 1..4 hold amaxes"},
      {"fp8.counters", 0, 8.0, "is 8,", "the history has 8 rows"},
      {"fp8.counters", 0, 3.0, "is 3 after 4 steps", "leave it at 4"},
      {"fp8.counters", 0, 1.5, "1.5", "a whole number in [0, 2^53]"},
      {"fp8.counters", 0, kDNaN, "nan", "(the amax history position)"},
      {"fp8.counters", 1, -1.0, "-1", "(the steps taken)"},
      {"fp8.counters", 1, 1e300, "1.0000000000000001e+300", "[0, 2^53]"},
      {"fp8.counters", 1, 9007199254740994.0, "9007199254740994", "[0, 2^53]"},
      {"fp8.counters", 2, 4.0 * T + 1, "is 169,", "more than 4 steps x 42"},
      {"fp8.counters", 2, kDNaN, "nan", "(the skipped scale updates)"},
      {"fp8.counters", 3, 4.0, "is 4,", "more than the 3 skipped", {{2, 3.0}}},
      {"fp8.options", 0, 2.0, "is 2:", "version 1"},
      {"fp8.options", 1, 7.0, "is 7:", "0 (hybrid) or 1 (e4m3)"},
      {"fp8.options", 2, 127.0, "is 127:", "[0, 126]"},
      {"fp8.options", 2, 0.5, "is 0.5:", "[0, 126]"},
      {"fp8.options", 3, 16.0, "is 16,", "has 8 rows"},
      {"fp8.options", 4, kDNaN, "is nan:", "0 (max) or 1 (most_recent)"},
  };
  expect_every_edit_refused("delayed", "plugin = \"fp8_delayed\"\namax_history_len = 8\nmargin = 1", edits);
}

// fp8_current (per-rank scales, no history) and fp8_block (per-rank counters).
TEST(ReliabilityHostile, EveryFieldOfFp8CurrentAndFp8BlockStateIsCheckedAtResume) {
  expect_every_edit_refused("current", "plugin = \"fp8_current\"",
                            {{"fp8.scale", 3, kNaN, "nan", "a scale is positive and finite"},
                             {"fp8.scale", 4, -2.0, "is -2:", "(the scale of linear"},
                             {"fp8.scale", 5, 0.0, "is 0:", "positive"},
                             {"fp8.counters", 0, 1.0, "is 1:", "current scaling keeps no history"},
                             {"fp8.counters", 1, -3.0, "-3", "(the steps taken)"},
                             {"fp8.counters", 3, 1e18, "1e+18", "(the non-finite amaxes)"},
                             {"fp8.options", 3, 4.0, "is 4,", "current scaling: 0"},
                             {"fp8.options", 4, 1.0, "is 1:", "0 under current scaling"}});
  expect_every_edit_refused("block", "plugin = \"fp8_block\"",
                            {{"fp8_block.counters", 0, kDNaN, "nan", "(the steps taken)"},
                             {"fp8_block.counters", 0, -1.0, "-1", "a whole number in [0, 2^53]"},
                             {"fp8_block.counters", 1, 0.25, "0.25", "(the tiles with a non-finite amax)"},
                             {"fp8_block.counters", 1, 1e300, "1.0000000000000001e+300", "[0, 2^53]"}},
                            // Dims and rows (4 x 32 tokens) in multiples of 128, as 1x128 tiles need.
                            {"model.hidden=128", "model.num_kv_heads=4", "model.ffn_hidden=256", "train.seq_len=32"});
}

// Through the command line: exit 1, one message with the way back, no step run.
TEST(ReliabilityHostile, RefusedRecipeStateStopsTrainWithTheWayBack) {
  const fs::path dir = fresh_dir("state_cli");
  const std::string prec = "plugin = \"fp8_delayed\"\namax_history_len = 4";
  const fs::path step = trained(dir, prec);
  apply(step, {"fp8.scale", 9, -4.0, "", ""});
  std::ofstream(dir / "c.toml") << config_with(dir / "run", 6, prec);
  const ProcResult r = run_shell(cli("train '" + (dir / "c.toml").string() + "' --set checkpoint.every=2"));
  EXPECT_EQ(r.code, 1) << r.out;
  for (const std::string& part : {step.string(), std::string("rank_00000.bin"), std::string("'fp8.scale' element 9"),
                                  std::string("is -4"), std::string("(it resumes from step 2)")})
    EXPECT_CONTAINS(r.out, part);
  EXPECT_FALSE(has(r.out, "check failed")) << r.out;
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoints" / "step_00000006"));
}

namespace {

// The window amax a delayed recipe takes from a history [len][T] (algo max).
float window_max(const std::vector<float>& hist, int64_t T, int64_t t) {
  float m = 0.0f;
  for (size_t row = 0; row * T < hist.size(); ++row) m = std::max(m, hist[row * T + t]);
  return m;
}

}  // namespace

// Resuming with another format, margin or amax_compute_algo: the scales the
// change made stale start afresh — under delayed scaling derived from the
// kept amax history for the new options (as the next update would), under
// current scaling 1 — the others and the history keep every bit, and the log
// names the option (old -> new) and never says the state resumes whole. An
// unchanged resume keeps every bit of every tensor.
TEST(ReliabilityHostile, StateAnOptionMadeStaleStartsAfreshAndTheRestResumesBitwise) {
  const fs::path dir = fresh_dir("state_options");
  const std::string base = "plugin = \"fp8_delayed\"\namax_history_len = 8\nmargin = 1";
  const fs::path step = trained(dir, base);
  const auto saved_scale = tensor_values<float>(step, "precision.fp8.scale");
  const auto saved_hist = tensor_values<float>(step, "precision.fp8.amax_history");
  const auto saved_counters = tensor_values<double>(step, "precision.fp8.counters");
  const int64_t T = static_cast<int64_t>(saved_scale.size());
  ASSERT_EQ(T, 42);
  auto resumed = [&](const std::string& precision) {
    auto s = std::make_unique<Session>(parse(config_with(dir / "run", 6, precision), {"checkpoint.every=0"}));
    s->initialise();
    EXPECT_EQ(s->step(), 4);
    return s;
  };
  {
    SCOPED_TRACE("unchanged");
    auto s = resumed(base);
    EXPECT_EQ(state_values<float>(*s, "fp8.scale"), saved_scale);
    EXPECT_EQ(state_values<float>(*s, "fp8.amax_history"), saved_hist);
    EXPECT_EQ(state_values<double>(*s, "fp8.counters"), saved_counters);
  }
  // (precision table, roles whose scale starts afresh, fp8 max of dy, margin)
  struct Case {
    std::string precision;
    std::vector<bool> fresh;  // x, w, dy
    float dy_max;
    int margin;
  };
  const std::vector<Case> cases = {
      {base + "\nformat = \"e4m3\"", {false, false, true}, 448.0f, 1},
      {"plugin = \"fp8_delayed\"\namax_history_len = 8\nmargin = 3", {true, true, true}, 57344.0f, 3},
      {base + "\namax_compute_algo = \"most_recent\"", {true, true, true}, 57344.0f, 1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.precision);
    auto s = resumed(c.precision);
    const auto scale = state_values<float>(*s, "fp8.scale");
    EXPECT_EQ(state_values<float>(*s, "fp8.amax_history"), saved_hist) << "the history is kept";
    EXPECT_EQ(state_values<double>(*s, "fp8.counters"), saved_counters) << "the counters are kept";
    const bool most_recent = c.precision.find("most_recent") != std::string::npos;
    int changed = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int role = static_cast<int>(t % 3);
      if (!c.fresh[static_cast<size_t>(role)]) {
        EXPECT_EQ(scale[t], saved_scale[t]) << "kept scale " << t;
        continue;
      }
      // head = 4 (4 steps of 8): the newest row.
      const float amax = most_recent ? saved_hist[4 * T + t] : window_max(saved_hist, T, t);
      const float fmax = role == 2 ? c.dy_max : 448.0f;
      const float want = loom::fp8::compute_scale(amax, fmax, c.margin, 1.0f).scale;
      EXPECT_EQ(scale[t], want) << "fresh scale " << t << " (amax " << amax << ")";
      changed += scale[t] != saved_scale[t];
    }
    EXPECT_GT(changed, 0) << "the stale scales were not reused";
  }
  // hybrid -> e4m3 specifically: every dy scale was E5M2-sized (57344 / amax
  // / 2) and is now E4M3-sized (448 / amax / 2), 128 times smaller.
  {
    auto s = resumed(base + "\nformat = \"e4m3\"");
    const auto scale = state_values<float>(*s, "fp8.scale");
    for (int64_t t = 2; t < T; t += 3)
      if (window_max(saved_hist, T, t) > 0) EXPECT_EQ(scale[t] * 128.0f, saved_scale[t]) << t;
  }
  // fp8_current: a format change sets the dy scales to 1, keeps x and w.
  {
    const fs::path cdir = fresh_dir("state_options_current");
    const fs::path cstep = trained(cdir, "plugin = \"fp8_current\"");
    const auto csaved = tensor_values<float>(cstep, "precision.fp8.scale");
    Session s(parse(config_with(cdir / "run", 6, "plugin = \"fp8_current\"\nformat = \"e4m3\""), {"checkpoint.every=0"}));
    s.initialise();
    const auto scale = state_values<float>(s, "fp8.scale");
    ASSERT_EQ(scale.size(), csaved.size());
    for (size_t t = 0; t < scale.size(); ++t) EXPECT_EQ(scale[t], t % 3 == 2 ? 1.0f : csaved[t]) << t;
  }
  // The log: the option, old -> new, and what starts afresh; never "resumes"
  // for the whole state when part of it was reset.
  std::ofstream(dir / "c.toml") << config_with(dir / "run", 5, base);
  const std::string train = cli("train '" + (dir / "c.toml").string() + "' --set run.log_level=info");
  const ProcResult changed = run_shell(train + " --set precision.format=e4m3");
  EXPECT_EQ(changed.code, 0) << changed.out;
  EXPECT_CONTAINS(changed.out, "precision.format \"hybrid\" -> \"e4m3\"");
  EXPECT_CONTAINS(changed.out, "dy scales were made for E5M2");
  EXPECT_CONTAINS(changed.out, "the rest of its FP8 state resumes");
  EXPECT_FALSE(has(changed.out, ": its FP8 state resumes")) << changed.out;
  // And unchanged: said to resume whole, no warning.
  const ProcResult same = run_shell(train + " --set train.steps=6");
  EXPECT_EQ(same.code, 0) << same.out;
  EXPECT_CONTAINS(same.out, ": its FP8 state resumes (");
  EXPECT_FALSE(has(same.out, "start afresh")) << same.out;
}

// Native and fused layers register other linears: their recipe state starts
// fresh (every scale 1, no step counted), warned, and the weights resume.
TEST(ReliabilityHostile, RecipeStateOfOtherLinearsStartsFresh) {
  const fs::path dir = fresh_dir("state_layers");
  const std::string prec = "plugin = \"fp8_delayed\"\namax_history_len = 4";
  trained(dir, prec);
  Session s(parse(config_with(dir / "run", 6, prec), {"model.layers=fused"}));
  s.initialise();
  EXPECT_EQ(s.step(), 4);
  for (float v : state_values<float>(s, "fp8.scale")) ASSERT_EQ(v, 1.0f);
  EXPECT_EQ(state_values<double>(s, "fp8.counters")[1], 0.0);
  const loom::RunSummary r = s.train();
  for (const auto& st : r.steps) EXPECT_TRUE(std::isfinite(st.loss));
}

// A change of the state's layout (the history length; fp8_head, which
// linears run in FP8) is refused naming the [precision] key, old -> new.
TEST(ReliabilityHostile, StateOfAnotherLayoutNamesTheKeyThatChanged) {
  const fs::path dir = fresh_dir("state_layout");
  trained(dir, "plugin = \"fp8_delayed\"\namax_history_len = 4");
  for (const auto& [precision, says] : std::vector<std::pair<std::string, std::string>>{
           {"plugin = \"fp8_delayed\"\namax_history_len = 16", "precision.amax_history_len 4 -> 16"},
           {"plugin = \"fp8_delayed\"\namax_history_len = 4\nfp8_head = true", "precision.fp8_head (not set) -> true"}}) {
    SCOPED_TRACE(precision);
    expect_error(
        [&] {
          Session s(parse(config_with(dir / "run", 6, precision)));
          s.initialise();
        },
        {"step_00000004", "another layout", says, "set those keys back", "checkpoint.resume = \"none\""});
  }
}

// `loom convert` refuses what resuming refuses — NaN or inf in any weight —
// naming the tensor and the checkpoint, with the checkpoint to convert
// instead; and a bf16 export that would round a finite weight to inf. Exit 1,
// nothing written; the same checkpoint converts with --dtype fp32 when only
// the bf16 range was the problem, and Loom loads that export.
TEST(ReliabilityHostile, ConvertRefusesWhatLoomWouldRefuse) {
  const fs::path dir = fresh_dir("state_convert");
  trained(dir, "plugin = \"fp32\"");
  const fs::path good = dir / "good";
  fs::rename(dir / "run", good);
  const std::string hf = (dir / "hf").string();
  auto convert = [&](const fs::path& step, const std::string& extra = "") {
    return run_shell(cli("convert '" + step.string() + "' --to-hf '" + hf + "'" + extra));
  };
  struct Case {
    std::string tensor;  // of rank 0's file
    int64_t index;
    float value;
    std::string param, says;
  };
  for (const Case& c : std::vector<Case>{
           {"params.layer.1", 5, kNaN, "model.layers.1.", "1 NaN"},
           {"params.embedding", 100, kInf, "model.embed_tokens.weight", "1 inf"},
           {"params.head", 7, -kInf, "", "1 inf"}}) {
    SCOPED_TRACE(c.tensor);
    restore_run(good, dir);
    const fs::path step = dir / "run" / "checkpoints" / "step_00000004";
    rewrite_tensor(step, c.tensor, [&](void* d, int64_t) { static_cast<float*>(d)[c.index] = c.value; });
    fs::remove_all(hf);
    const ProcResult r = convert(step);
    EXPECT_EQ(r.code, 1) << r.out;
    for (const std::string& part : {step.string(), c.param, c.says, std::string("weights (params)"),
                                    std::string("cannot be resumed or converted"),
                                    (dir / "run" / "checkpoints" / "step_00000002").string()})
      EXPECT_CONTAINS(r.out, part);
    EXPECT_FALSE(fs::exists(hf)) << "nothing is written";
  }
  // Finite, but beyond bf16: refused for bf16 (the default), converted in fp32.
  restore_run(good, dir);
  const fs::path step = dir / "run" / "checkpoints" / "step_00000004";
  rewrite_tensor(step, "params.layer.0", [](void* d, int64_t) { static_cast<float*>(d)[3] = 3.4e38f; });
  fs::remove_all(hf);
  const ProcResult bf = convert(step);
  EXPECT_EQ(bf.code, 1) << bf.out;
  for (const std::string& part : {std::string("beyond bf16's range"), std::string("--dtype fp32"),
                                  std::string("3.39999995e+38 at element 3"), std::string("nothing was written")})
    EXPECT_CONTAINS(bf.out, part);
  EXPECT_FALSE(fs::exists(hf));
  const ProcResult f32 = convert(step, " --dtype fp32");
  EXPECT_EQ(f32.code, 0) << f32.out;
  // The export loads: Loom's own hf: init takes it.
  Session s(parse(config_with(dir / "again", 1, "plugin = \"fp32\""), {"model.init=\"hf:" + hf + "\""}));
  EXPECT_NO_THROW(s.initialise());
}

// `loom compare`: a --strategies item sets only its strategy's own [sharding]
// keys (and the core's row-wide expert_parallel). `plugin` and `path` would
// run other code under the row's label, and a key the strategy does not read
// would be ignored or refused deep in the run: each is refused before any run
// (exit 1, no output folder), naming the item, the key and the keys the
// strategy accepts. A --configs item is a config file, not name:key=value.
TEST(ReliabilityHostile, CompareItemsSetOnlyTheirStrategysOwnKeys) {
  const fs::path dir = fresh_dir("compare_items");
  std::ofstream(dir / "c.toml") << tiny_config(dir / "run", 2);
  const std::string base = "compare '" + (dir / "c.toml").string() + "' --steps=1 --warmup=0 --out='" +
                           (dir / "cmp").string() + "' ";
  struct Case {
    std::string item;
    std::vector<std::string> says;
  };
  for (const Case& c : std::vector<Case>{
           {"zero3:plugin=none",
            {"--strategies item 'zero3:plugin=none'", "'plugin' is not one of strategy zero3's own [sharding] keys",
             "the item's name picks the strategy", "The keys zero3 accepts: expert_parallel, reduce_dtype, "
             "reshard_after_forward, prefetch, gather_dtype"}},
           {"ddp:plugin=\"zero3\"", {"'plugin' is not one of strategy ddp's own",
                                    "The keys ddp accepts: expert_parallel, reduce_dtype"}},
           {"none:path=/tmp/libloom-sharding-zero3.so",
            {"'path' is not one of strategy none's own", "would run under this row's name",
             "The keys none accepts: expert_parallel"}},
           {"hybrid_shard:shard_group_size=1:plugin=zero1", {"'plugin'", "shard_group_size"}},
           {"none:prefetch=2", {"'prefetch' is not one of strategy none's own", "The keys none accepts: expert_parallel"}},
           {"zero3:prefetchh=2", {"'zero3:prefetchh=2' cannot start", "unknown key 'sharding.prefetchh'",
                                  "did you mean 'prefetch'", "by plugin 'zero3'"}},
           {"ddp:prefetch=1", {"unknown key 'sharding.prefetch'", "by plugin 'ddp'"}},
           {"none:expert_parallel=1:expert_parallel=1", {"sets 'expert_parallel' twice"}}}) {
    SCOPED_TRACE(c.item);
    fs::remove_all(dir / "cmp");
    const ProcResult r = run_shell(cli(base + "--strategies='" + c.item + "'"));
    EXPECT_EQ(r.code, 1) << r.out;
    for (const std::string& part : c.says) EXPECT_CONTAINS(r.out, part);
    EXPECT_FALSE(has(r.out, " warm-up)")) << "no row ran:\n" << r.out;
  }
  // A core row-wide key is taken (a dense model: expert_parallel = 1).
  const ProcResult ok = run_shell(cli(base + "--strategies=none:expert_parallel=1"));
  EXPECT_EQ(ok.code, 0) << ok.out;
  // --configs items are files.
  const ProcResult cfgs = run_shell(cli(base + "--configs='" + (dir / "c.toml").string() + ":prefetch=2'"));
  EXPECT_EQ(cfgs.code, 1) << cfgs.out;
  EXPECT_CONTAINS(cfgs.out, "--configs item");
  EXPECT_CONTAINS(cfgs.out, "is not a config file");
}

// The same on CUDA (the GPU recipe checks the restored state on the host with
// the CPU's rules and uploads the scales a changed option started afresh):
// an unchanged resume keeps every bit, hybrid -> e4m3 derives the dy scales
// from the kept history for E4M3, a bad scale or counter is refused with the
// way back. Skips without a device.
TEST(ReliabilityHostile, GpuRecipeStateIsCheckedAndStaleScalesStartAfresh) {
  LOOM_REQUIRE_GPU();
  const fs::path dir = fresh_dir("state_gpu");
  const std::string base = "plugin = \"fp8_delayed\"\namax_history_len = 8\nmargin = 1";
  // Rows (4 x 32) and dims in multiples of 16, as the FP8 GEMMs need.
  const std::vector<std::string> gpu = {"run.device=cuda", "train.seq_len=32"};
  const fs::path step = trained(dir, base, gpu);
  const auto saved_scale = tensor_values<float>(step, "precision.fp8.scale");
  const auto saved_hist = tensor_values<float>(step, "precision.fp8.amax_history");
  const int64_t T = static_cast<int64_t>(saved_scale.size());
  auto resume = [&](const std::string& precision) {
    std::vector<std::string> ov = gpu;
    ov.push_back("checkpoint.every=0");
    auto s = std::make_unique<Session>(parse(config_with(dir / "run", 6, precision), ov));
    s->initialise();
    return s;
  };
  {
    auto s = resume(base);
    EXPECT_EQ(state_values<float>(*s, "fp8.scale"), saved_scale);
    EXPECT_EQ(state_values<float>(*s, "fp8.amax_history"), saved_hist);
  }
  {
    auto s = resume(base + "\nformat = \"e4m3\"");
    const auto scale = state_values<float>(*s, "fp8.scale");
    for (int64_t t = 0; t < T; ++t)
      EXPECT_EQ(scale[t], t % 3 == 2 ? loom::fp8::compute_scale(window_max(saved_hist, T, t), 448.0f, 1, 1.0f).scale
                                     : saved_scale[t])
          << t;
    EXPECT_TRUE(std::isfinite(s->train().steps.back().loss));
  }
  for (const Edit& e : std::vector<Edit>{{"fp8.scale", 4, kNaN, "nan", "a scale is positive and finite"},
                                         {"fp8.counters", 2, 1e300, "1.0000000000000001e+300", "[0, 2^53]"}}) {
    SCOPED_TRACE(e.tensor);
    const fs::path copy = dir / "copy";
    fs::remove_all(copy);
    fs::copy(dir / "run", copy, fs::copy_options::recursive);
    const fs::path cstep = copy / "checkpoints" / "step_00000004";
    apply(cstep, e);
    expect_error(
        [&] {
          std::vector<std::string> ov = gpu;
          ov.push_back("checkpoint.every=2");
          Session s(parse(config_with(copy, 6, base), ov));
          s.initialise();
        },
        {cstep.string(), "rank_00000.bin", "'" + e.tensor + "'", e.shown, e.says, "(it resumes from step 2)"});
  }
}
