// "arith": a data source of arithmetic progressions modulo the vocabulary.
// Each row starts at a random token and adds a random step, so the next token
// follows from the previous two: a tiny model learns it within a few hundred
// steps, which makes this source useful to smoke-test a training setup
// without any data files.
//
// [data]
// plugin = "arith"
// max_step = 7            # steps are drawn from 1..max_step
// validation_rows = 256   # size of the fixed validation split
#include <cstdint>
#include <cstdio>
#include <string>

#include <loom/data.hpp>
#include <loom/error.hpp>
#include <loom/plugin.hpp>

namespace {

// splitmix64: a counter-based generator, so a row's content depends only on
// (seed, split, row index). That makes resume exact and independent of how
// many ranks produced the earlier rows.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class ArithData final : public loom::DataSource {
 public:
  explicit ArithData(const loom::PluginInit& init) : seed_(init.seed) {
    // Every key of [data] is read here; finish() rejects any other key, with
    // a did-you-mean, before the run starts.
    max_step_ = init.config.get_int("max_step", 7, 1, 1 << 20);
    validation_rows_ = init.config.get_int("validation_rows", 256, 1, int64_t(1) << 32);
    init.config.finish();
  }

  void open(const loom::DataSpec& spec) override {
    if (spec.batch < 1 || spec.seq_len < 1 || spec.vocab_size < 2)
      throw loom::Error(loom::cat("arith: needs batch >= 1, seq_len >= 1 and vocab_size >= 2, got batch ", spec.batch,
                                  ", seq_len ", spec.seq_len, ", vocab_size ", spec.vocab_size));
    if (spec.world < 1 || spec.rank < 0 || spec.rank >= spec.world)
      throw loom::Error(loom::cat("arith: rank ", spec.rank, " is outside the world of ", spec.world, " ranks"));
    if (max_step_ >= spec.vocab_size)
      throw loom::Error(loom::cat("arith: max_step = ", max_step_, " must be below the vocabulary size ",
                                  spec.vocab_size, "; lower data.max_step"));
    spec_ = spec;
    opened_ = true;
  }

  bool has_split(loom::Split) const override { return true; }

  void next(loom::Split split, int32_t* tokens) override {
    if (!opened_) throw loom::Error("arith: next() was called before open()");
    const bool train = split == loom::Split::train;
    // Global row numbers: all ranks together consume batch * world rows per step.
    int64_t& consumed = train ? train_rows_ : val_rows_;
    const int64_t len = spec_.seq_len + 1;
    for (int64_t r = 0; r < spec_.batch; ++r) {
      int64_t row = consumed + spec_.rank * spec_.batch + r;
      if (!train) row %= validation_rows_;
      fill_row(train ? 0 : 1, row, tokens + r * len, len);
    }
    consumed += spec_.batch * spec_.world;
  }

  void reset(loom::Split split) override { (split == loom::Split::train ? train_rows_ : val_rows_) = 0; }

  // Row counters are global (not per rank), so a run resumed under another
  // world size continues with the next unseen rows.
  std::string state() const override {
    return loom::cat("{\"train_rows\":", train_rows_, ",\"validation_rows\":", val_rows_, "}");
  }
  void restore(const std::string& state) override {
    long long t = -1, v = -1;
    if (std::sscanf(state.c_str(), "{\"train_rows\":%lld,\"validation_rows\":%lld}", &t, &v) != 2 || t < 0 || v < 0)
      throw loom::Error(loom::cat("arith: cannot resume from state '", state,
                                  "': expected {\"train_rows\":N,\"validation_rows\":M} as written by state()"));
    train_rows_ = t;
    val_rows_ = v;
  }

 private:
  void fill_row(uint64_t split, int64_t row, int32_t* out, int64_t len) const {
    const uint64_t h = mix(mix(seed_ ^ (split << 63)) ^ static_cast<uint64_t>(row));
    const int64_t vocab = spec_.vocab_size;
    const int64_t start = static_cast<int64_t>(h % static_cast<uint64_t>(vocab));
    const int64_t step = 1 + static_cast<int64_t>((h >> 32) % static_cast<uint64_t>(max_step_));
    for (int64_t t = 0; t < len; ++t) out[t] = static_cast<int32_t>((start + t * step) % vocab);
  }

  uint64_t seed_;
  int64_t max_step_ = 7, validation_rows_ = 256;
  loom::DataSpec spec_;
  bool opened_ = false;
  int64_t train_rows_ = 0, val_rows_ = 0;
};

}  // namespace

LOOM_PLUGIN(data, ArithData, "arith", "1.0.0",
            "arithmetic progressions modulo the vocabulary: a learnable toy task that needs no files")
