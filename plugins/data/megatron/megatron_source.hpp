// The `megatron` data source: Megatron-LM indexed datasets (indexed_dataset.hpp)
// sampled the way Megatron's GPTDataset does, blended the way its
// BlendedDataset does. Lives in libloom beside `tokens`; plugins/data/megatron
// registers it and reads its TOML table.
//
// Sampling of one dataset's split (the sequences of its document range; a
// sequence is a document, as in Megatron-core):
//   * epoch e orders the documents by a seeded permutation (a function of seed,
//     dataset and e; identity without shuffle) and concatenates them;
//   * sample j of the epoch is tokens [j*seq_len, j*seq_len + seq_len + 1) of
//     that stream: samples cross document boundaries and consecutive samples
//     share one token; W = (epoch tokens - 1) / seq_len samples an epoch;
//   * the epoch's sample order is another seeded permutation of [0, W).
// Several prefixes are blended with weights: global sample g goes to the
// dataset whose count lags its share the most (Megatron's
// build_blending_indices), and takes that dataset's next sample.
// Ranks: global batch b holds samples [b*batch*world, (b+1)*batch*world), rank
// r its `batch` consecutive ones (as `tokens`). state() holds the global cursor
// and each dataset's count, so resume is exact under any world size.
// Validation: the split's documents in file order, unshuffled, datasets one
// after another, wrapping around.
// Files changed under the run are refused: each dataset's .idx and .bin are
// compared with the opened files (IndexedDataset::verify_unchanged) at every
// train epoch of that dataset, every validation pass and every state()
// (checkpoint); a read that faults because one was truncated in place is an
// error naming the file. Tokens are checked against the model's vocabulary
// as they are read; scan_tokens() (TokenScan, for `loom check`) reads them all.
// Document starts (DocumentStarts): the first token of every sequence of the
// index in a sample (the .idx's sequences are the documents GPTDataset
// concatenates; with --split-sentences each sentence is one), from the same
// cumulative counts the sampler reads.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/megatron/indexed_dataset.hpp"
#include "loom/data.hpp"

namespace loom::data {

struct MegatronOptions {
  std::vector<std::string> prefixes;      // PREFIX of PREFIX.bin / PREFIX.idx, at least one
  std::vector<double> weights;            // one per prefix; empty = proportional to each one's train samples
  std::string split;                      // "969,30,1" (train, validation, test by document); empty = default
  std::vector<std::string> val_prefixes;  // validation from other datasets instead of a split
  bool shuffle = true;
};

// Megatron's get_split_indices: `split` ("969,30,1", "98,2", "1") normalised,
// boundaries round(fraction * documents) (ties to even, as Python's round),
// the last one moved to `documents`. Returns 4 boundaries.
std::vector<uint64_t> megatron_split_indices(const std::string& split, uint64_t documents, const std::string& key);

class MegatronSource : public DataSource, public TokenScan, public DocumentStarts {
 public:
  explicit MegatronSource(MegatronOptions opt);
  ~MegatronSource() override;

  void open(const DataSpec& spec) override;
  bool has_split(Split split) const override;
  void next(Split split, int32_t* tokens) override;
  void reset(Split split) override;
  std::string state() const override;
  void restore(const std::string& state) override;
  TokenScanReport scan_tokens() const override;
  void next_with_starts(Split split, int32_t* tokens, uint8_t* starts) override;

  uint64_t cursor() const { return cursor_; }
  const std::vector<uint64_t>& counts() const { return counts_; }
  uint64_t train_samples(std::size_t dataset) const;  // per epoch
  uint64_t val_samples() const { return val_total_; }

 private:
  struct Stream;  // one dataset's documents of one split
  void read(Split split, int32_t* tokens, uint8_t* starts);
  // Sample k of stream s into out (seq_len + 1 tokens) and, when not null, its document starts.
  void read_sample(Stream& s, uint64_t k, bool shuffle, int32_t* out, uint8_t* starts) const;
  std::size_t choose(uint64_t g) const;
  void require_open(const char* what) const;

  MegatronOptions opt_;
  DataSpec spec_;
  bool opened_ = false;
  std::vector<std::unique_ptr<IndexedDataset>> datasets_;
  std::vector<std::unique_ptr<Stream>> train_, val_;
  std::vector<double> weights_;  // normalised
  uint64_t seed_ = 0, cursor_ = 0, val_cursor_ = 0, val_total_ = 0;
  std::vector<uint64_t> counts_;  // samples taken from each train stream
};

}  // namespace loom::data
