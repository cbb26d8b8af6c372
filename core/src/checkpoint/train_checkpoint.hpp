// Training checkpoints on top of the shard files of checkpoint.hpp: what each
// rank writes, what meta.json records, and how any checkpoint is read back —
// by parameter name, whatever world size, strategy, precision or layer
// variant wrote it.
//
// meta.json (format version 5; versions 2 to 4 are still read: 2 lacks
// "layers" and the parameter roles, 2 and 3 lack "shard_header_crc32", and 2
// to 4 recorded the precision recipe's state as an opaque hex string,
// "precision_state", which no recipe filled: an empty one reads as no state,
// any other is refused):
//   step, world_size, strategy, precision (the plugin's name, for people),
//   dtypes {params, grads, optim_state, activation, master},
//   layers ("native" | "fused": what computed; the layout is the same),
//   model {hidden, num_layers, ...},
//   units [{name, numel, params [{name, shape, offset, role}], shards [[rank, lo, hi], ...]}],
//   data_plugin, data_state, samples_seen, seed, config,
//   precision_tensors [{name, dtype, shape, replicated}] (the recipe's state,
//     loom/precision.hpp StateTensor: tensors "precision.<name>" in rank 0's
//     file when replicated, in every rank's file when not),
//   shard_header_crc32 [the header CRC32 of rank 0's file, rank 1's, ...].
// COMPLETE certifies meta.json (checkpoint.hpp); meta.json in turn certifies
// every rank file, so the whole checkpoint is one consistent set.
// Rank r's file holds, per unit, params.<unit>, master.<unit> (when the
// recipe has a master copy), adam_m.<unit> and adam_v.<unit> for its shard
// [lo, hi) of the unit's flat vector: every element is written exactly once.
// The recipe's state tensors are beside them (precision.<name>).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "loom/dtype.hpp"
#include "loom/model.hpp"

namespace loom::ckpt {

struct SavedParam {
  std::string name;
  std::vector<int64_t> shape;
  size_t unit = 0;      // index into TrainMeta::units
  int64_t offset = 0;   // in the saved unit's flat vector
  int64_t numel = 0;
};

struct SavedUnit {
  std::string name;
  int64_t numel = 0;
  struct Shard { int rank; int64_t lo, hi; };
  std::vector<Shard> shards;
};

struct SavedState {
  std::string name;  // the recipe's name for it; the tensor is "precision.<name>"
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  bool replicated = true;
};

struct TrainMeta {
  int version = 0;
  int64_t step = 0;
  int world_size = 0;
  std::string strategy, precision, layers = "native";
  DType params_dtype = DType::f32, optim_dtype = DType::f32;
  bool has_master = false;
  ModelSpec spec;
  std::string model_json;  // the "model" object as written, for comparisons
  std::vector<SavedUnit> units;
  std::vector<SavedParam> params;
  std::map<std::string, size_t> by_name;  // parameter name -> index into params
  std::string data_plugin, data_state;
  std::vector<SavedState> precision_tensors;  // version 5; empty before
  int64_t samples_seen = 0;
  std::vector<uint32_t> shard_header_crc;  // per rank (version 4); empty before
};

// The "model" object of meta.json for a spec (the architecture, not how it computes).
std::string model_json(const ModelSpec& spec);

// One complete checkpoint directory, read back by parameter name.
class CheckpointSet {
 public:
  // Opens `dir` (a step_* folder with COMPLETE), parses and checks meta.json:
  // every field's type and range (naming the key), the marker's certificate
  // (required from format version 5 on, whatever form the marker has), the
  // layout (parameters tiling each unit in order; from version 4 on, the
  // units and same-shaped parameters where the recorded model puts them) and
  // the shards (each element of a unit held once), and rank 0's header.
  // Damage throws CheckpointDamaged.
  explicit CheckpointSet(std::string dir);
  ~CheckpointSet();
  const std::string& dir() const { return dir_; }
  const TrainMeta& meta() const { return meta_; }
  const SavedParam& param(const std::string& name) const;  // throws naming the checkpoint
  // Elements [begin, end) of a parameter's saved `kind` ("params", "master",
  // "adam_m", "adam_v"), converted to `dtype` (f32 or bf16) into dst, from
  // whichever rank files hold them. CRCs are checked (each piece once), and
  // the values: NaN or inf (after the conversion) throws CheckpointDamaged
  // naming the parameter and the state, for resuming and `loom convert` alike.
  void read(const std::string& kind, const SavedParam& p, int64_t begin, int64_t end, DType dtype, void* dst);
  // The parameter's weights in fp32: the master copy when there is one (the
  // exact values), else the stored params.
  std::vector<float> weights_f32(const SavedParam& p);
  // Everything short of the tensor data: every rank file's header (and the
  // header CRC meta.json records for it), and every tensor meta.json's shards
  // and precision state name, with the dtype and size recorded. Damage throws
  // CheckpointDamaged; what is left for read() to find is a flipped data byte.
  void check_files();
  // A recipe state tensor (precision.<name>) from `rank`'s file into dst, a
  // contiguous host tensor of the saved dtype and shape (checked, naming both).
  void read_precision_state(int rank, const SavedState& s, Tensor& dst);

 private:
  const std::vector<std::byte>& piece(int rank, const std::string& tensor);
  CheckpointReader& reader(int rank);  // opened once, its header checked against meta.json
  // Throws unless `rank`'s file has the header meta.json records for it.
  void check_rank_file(int rank, uint32_t header_crc) const;
  std::string dir_;
  TrainMeta meta_;
  std::map<int, std::unique_ptr<CheckpointReader>> readers_;
  std::map<std::pair<int, std::string>, std::vector<std::byte>> cache_;  // pieces of the current unit
  std::string cached_unit_;
};

// Why the complete checkpoint `c` cannot be resumed ("" when it can), short
// of the model it would be resumed into: what resuming checks before it reads
// any tensor data — CheckpointSet (the marker, meta.json, its layout, rank
// 0's header) and check_files() (every rank file meta.json lists, each
// header against the CRC32 meta.json records for it, every tensor meta.json
// names). Pruning counts only the checkpoints this finds nothing in.
std::string training_checkpoint_damage(const CheckpointInfo& c);

// Every complete checkpoint under root, newest last, as a message fragment
// ("step_00000010, step_00000020" or "none").
std::string complete_list(const std::string& root);

}  // namespace loom::ckpt
