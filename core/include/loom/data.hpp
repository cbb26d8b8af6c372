// Data plugins: batches of token ids for (rank, world), exact resume, a
// validation split (DESIGN.md).
#pragma once
#include <cstdint>
#include <string>

#include "loom/plugin.hpp"

namespace loom {

enum class Split { train, validation };

struct DataSpec {
  int64_t batch = 1;      // sequences per micro-batch on this rank
  int64_t seq_len = 0;    // tokens per sequence fed to the model
  int64_t vocab_size = 0; // model vocabulary; every token must be < vocab_size
  int rank = 0;
  int world = 1;
  uint64_t seed = 0;
};

class DataSource : public Plugin {
 public:
  // Called once before the first batch. Validate files here (clear errors before any GPU work).
  virtual void open(const DataSpec& spec) = 0;
  virtual bool has_split(Split split) const = 0;
  // Fills tokens[batch * (seq_len + 1)] (row-major): inputs are [:, :seq_len],
  // targets [:, 1:]. Host memory.
  virtual void next(Split split, int32_t* tokens) = 0;
  // Restart the validation split from its beginning (the same batches every evaluation).
  virtual void reset(Split split) = 0;
  // Exact position for resume: an opaque string (JSON by convention) that
  // restore() accepts. Must include enough to continue after a world-size change.
  virtual std::string state() const = 0;
  virtual void restore(const std::string& state) = 0;
  // Largest token id + 1 this source can produce, or 0 if unknown (checked against the model).
  virtual int64_t vocab_hint() const { return 0; }
};

template <> struct PluginInterface<PluginKind::data> { using type = DataSource; };

}  // namespace loom
