// The well-formed test plugin: a small deterministic data source built with
// the LOOM_PLUGIN macro, exactly as a real plugin is. Also built under the name
// 'echo' into two directories (versions differ) for the search-order tests.
#include <cstdio>
#include <string>

#include "loom/data.hpp"
#include "loom/error.hpp"
#include "loom/plugin.hpp"

#ifndef LOOM_TEST_PLUGIN_NAME
#error "LOOM_TEST_PLUGIN_NAME must name the plugin (set by tests/plugins_broken/CMakeLists.txt)"
#endif
#ifndef LOOM_TEST_PLUGIN_VERSION
#error "LOOM_TEST_PLUGIN_VERSION must be set by tests/plugins_broken/CMakeLists.txt"
#endif

namespace {

// Row r of batch k on rank q holds start, start+stride, ... (mod vocab) with
// start = (k * world + q) * batch + r: every rank sees different rows, and a
// restored position continues the exact same sequence.
class CountingData final : public loom::DataSource {
 public:
  explicit CountingData(const loom::PluginInit& init) : rank_(init.rank), world_(init.world) {
    stride_ = init.config.get_int("stride", 1, 1, 1 << 20);
    init.config.finish();
    if (init.world < 1 || init.rank < 0 || init.rank >= init.world)
      throw loom::Error(loom::cat("rank ", init.rank, " is outside the world of ", init.world,
                                  " ranks: the launcher must give 0 <= rank < world"));
  }

  void open(const loom::DataSpec& spec) override {
    if (spec.batch < 1 || spec.seq_len < 1 || spec.vocab_size < 2)
      throw loom::Error(loom::cat("needs batch >= 1, seq_len >= 1 and vocab_size >= 2 (got ", spec.batch, ", ",
                                  spec.seq_len, ", ", spec.vocab_size, ")"));
    spec_ = spec;
    opened_ = true;
  }
  bool has_split(loom::Split) const override { return true; }

  void next(loom::Split split, int32_t* tokens) override {
    if (!opened_) throw loom::Error("next() called before open()");
    int64_t& pos = split == loom::Split::train ? train_pos_ : val_pos_;
    // The validation rows start half a vocabulary away so the two splits differ.
    const int64_t offset = split == loom::Split::train ? 0 : spec_.vocab_size / 2;
    const int64_t len = spec_.seq_len + 1;
    for (int64_t r = 0; r < spec_.batch; ++r) {
      const int64_t start = (pos * world_ + rank_) * spec_.batch + r + offset;
      for (int64_t t = 0; t < len; ++t)
        tokens[r * len + t] = static_cast<int32_t>((start + t * stride_) % spec_.vocab_size);
    }
    ++pos;
  }
  void reset(loom::Split split) override { (split == loom::Split::train ? train_pos_ : val_pos_) = 0; }

  std::string state() const override {
    return loom::cat("{\"train\":", train_pos_, ",\"validation\":", val_pos_, "}");
  }
  void restore(const std::string& state) override {
    long long t = 0, v = 0;
    if (std::sscanf(state.c_str(), "{\"train\":%lld,\"validation\":%lld}", &t, &v) != 2 || t < 0 || v < 0)
      throw loom::Error(loom::cat("cannot restore from state '", state, "': expected {\"train\":N,\"validation\":M}"));
    train_pos_ = t;
    val_pos_ = v;
  }

 private:
  int rank_, world_;
  int64_t stride_ = 1;
  loom::DataSpec spec_;
  bool opened_ = false;
  int64_t train_pos_ = 0, val_pos_ = 0;
};

}  // namespace

LOOM_PLUGIN(data, CountingData, LOOM_TEST_PLUGIN_NAME, LOOM_TEST_PLUGIN_VERSION,
            "test source: rows count up from a per-rank start, modulo the vocabulary")
