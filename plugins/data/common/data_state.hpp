// Reading a data source's resume position: the JSON its state() wrote, kept
// in a checkpoint's meta.json as "data_state" and given back to restore().
// Every field is read strictly (ckpt::JsonFields): a value of another type,
// null, a fraction, a negative number, one beyond 2^64 or beyond its range
// is refused naming the field, the value and the range — never converted (a
// cursor of -1 read as 18446744073709551615, 1.5 read as 1). The core adds
// the file ("cannot resume from .../meta.json: its "data_state" ... is
// refused: ") and, for damage (ckpt::CheckpointDamaged), which checkpoint to
// resume instead (train/checkpointing.cpp).
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/json_fields.hpp"

namespace loom::data {

// Positions and counts of a data state (windows or samples consumed) are at
// most 2^53 = 9007199254740992: at a million samples a second a run reaches
// that in 285 years, and it is the largest integer a JSON reader holding
// numbers as doubles keeps exact. A larger one is damage.
inline constexpr int64_t kMaxDataPosition = int64_t{1} << 53;
// Ranks and micro-batch sizes are at most 2^20 (`loom check --world`,
// train.micro_batch and train.seq_len's limits).
inline constexpr int64_t kMaxDataRanks = int64_t{1} << 20;
inline constexpr int64_t kMaxDataDim = int64_t{1} << 20;

class DataStateReader {
 public:
  // Parses `text` as the state of data plugin `source` in format `version`.
  // Text that is not a JSON object, or without a "source" or "version" that
  // Loom writes, is damage (ckpt::CheckpointDamaged); the state of another
  // data plugin, or of a newer format, is a loom::Error saying what to do.
  DataStateReader(const std::string& text, const std::string& source, int64_t version);

  const nlohmann::json& json() const { return j_; }
  const ckpt::JsonFields& fields() const { return f_; }

  // Required top-level fields, refused as damage unless of the type and range.
  int64_t integer(const std::string& name, int64_t lo, int64_t hi = ckpt::JsonFields::kMaxInt) const {
    return f_.integer_at(j_, "", name, lo, hi);
  }
  bool boolean(const std::string& name) const;
  std::string string(const std::string& name) const { return f_.string_at(j_, "", name); }
  const nlohmann::json& array(const std::string& name) const { return f_.array_at(j_, "", name); }

  // The fields every data plugin's state holds, read as required fields: the
  // global position (samples or windows consumed), the order's seed (run.seed's
  // range), and the world and micro-batch the position was cut for.
  struct Position {
    uint64_t cursor = 0, seed = 0;
    int64_t world = 0, batch = 0;
  };
  Position position() const {
    return {static_cast<uint64_t>(integer("cursor", 0, kMaxDataPosition)), static_cast<uint64_t>(integer("seed", 0)),
            integer("world", 1, kMaxDataRanks), integer("batch", 1, kMaxDataDim)};
  }
  // Says (log_info) that the run resumes `p` under another world or
  // micro-batch than it was cut for: the position carries over as a global
  // count of `unit`s ("sample", "window").
  static void note_reshard(const std::string& source, const Position& p, int64_t world, int64_t batch,
                           const char* unit);

  // Refuses field `key` holding `found` as damage, `expected` saying what it must be.
  [[noreturn]] void fail(const std::string& key, const nlohmann::json& found, const std::string& expected) const {
    f_.fail(key, found, expected);
  }
  // Refuses the state as damage, `what` saying what is wrong with it.
  [[noreturn]] void damaged(const std::string& what) const;

 private:
  ckpt::JsonFields f_;
  nlohmann::json j_;
};

}  // namespace loom::data
