// The `synthetic` data source: generated tokens for benchmarks and tests, no
// files. Lives in libloom; plugins/data/synthetic registers it and reads its
// TOML table.
#pragma once
#include <cstdint>
#include <string>

#include "loom/data.hpp"

namespace loom::data {

struct SyntheticOptions {
  std::string pattern = "random";  // "random" | "ramp"
  int64_t vocab = 0;               // ids are < vocab; 0 = the model's vocab_size
  double document_length = 0;      // mean tokens of a document (log-normal); 0 = no documents
  double document_sigma = 1.0;     // sigma of the log of a document's length
};

// Every token is a pure function of (seed, split, global sample index,
// position): "random" hashes all four; "ramp" is (start + position) % vocab
// with start hashed from (seed, split, sample), which a model can learn.
// Global batch g holds samples [g*batch*world, (g+1)*batch*world) and rank r
// takes its `batch` consecutive ones, so ranks never share a sample and a
// resume (under any world size) continues from the global sample cursor.
// Validation uses another hash domain, so it never repeats a train sample.
// Documents (DocumentStarts, with document_length > 0): each sample is cut
// into documents of log-normal lengths (mean document_length, sigma
// document_sigma of the log, at least one token), a pure function of (seed,
// split, sample): the first one is a random tail of a document, as a window
// of a long stream begins. The tokens do not change; the benchmarks run
// document masking on them with realistic lengths.
class SyntheticSource : public DataSource, public DocumentStarts {
 public:
  explicit SyntheticSource(SyntheticOptions opt);

  void open(const DataSpec& spec) override;
  bool has_split(Split) const override { return true; }
  void next(Split split, int32_t* tokens) override;
  void reset(Split split) override;
  std::string state() const override;
  void restore(const std::string& state) override;
  int64_t vocab_hint() const override { return vocab_; }
  std::string starts_unavailable() const override;
  void next_with_starts(Split split, int32_t* tokens, uint8_t* starts) override;

  // Token `pos` of global sample `sample` of `split` (what next() fills from).
  int32_t token(Split split, uint64_t sample, uint64_t pos) const;
  uint64_t cursor() const { return cursor_; }
  // Document starts of global sample `sample` of `split` (row positions 0..seq_len).
  void starts(Split split, uint64_t sample, uint8_t* out) const;

 private:
  SyntheticOptions opt_;
  DataSpec spec_;
  bool opened_ = false;
  bool ramp_ = false;
  int64_t vocab_ = 0;
  uint64_t seed_ = 0;
  uint64_t cursor_ = 0;      // global train samples consumed
  uint64_t val_cursor_ = 0;  // global validation samples since reset
};

}  // namespace loom::data
