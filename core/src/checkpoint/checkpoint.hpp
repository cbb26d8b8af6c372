// Training checkpoints (docs/RELIABILITY.md "Checkpoints"):
//
//   <root>/step_00000120/rank_00000.bin   one shard file per rank
//                        rank_00001.bin
//                        meta.json        caller's JSON (config, world size, strategy, data position, RNG, ...)
//                        COMPLETE         written last, by rank 0, after every shard is on disk
//
// A shard file is: 8 bytes magic "LOOMCKP1", u64 header length H, u32 CRC32 of
// the header, u32 zero, H bytes of JSON header
//   {"format": 1, "rank": r, "step": s, "tensors": [{"name", "dtype", "shape", "offset", "bytes", "crc32"}]}
// then zero padding to a 64-byte boundary and the data section (offsets are
// relative to it, each tensor 64-byte aligned). All integers little-endian.
//
// Every file is written tmp + fsync + rename + fsync(dir), so a crash leaves
// either no file or a whole one; a directory without COMPLETE is never read.
//
// COMPLETE is {"step": s, "meta_bytes": n, "meta_crc32": c}: it certifies
// meta.json, so a changed digit there is refused. A reader checks that the
// folder's name, COMPLETE's step and the rank file's "rank" and "step" agree.
// Checkpoints of older looms (COMPLETE with the step only, rank files without
// a step) are "legacy" and read without the two newer checks; whether one may
// be legacy is decided by its meta.json's format version (train_checkpoint.hpp),
// not by the marker, which anyone can rewrite in the old form.
//
// Only the name step_dir_name(step) is a checkpoint: a second folder for the
// same step under another spelling ("step_4" beside "step_00000004", as
// `cp -r` makes) is an alias, left alone — never resumed from, counted toward
// keep_last or pruned — and reported once as a warning naming it.
// Saving, as the trainer drives it:
//   every rank:  CheckpointWriter w(root, step, rank); w.add(...)...; w.write_shard();
//   rank 0:      CheckpointWriter::write_meta(root, step, json);
//   barrier (all shards on disk)
//   rank 0:      CheckpointWriter::mark_complete(root, step); prune(root, keep_last, damage);
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "loom/error.hpp"
#include "loom/tensor.hpp"

namespace loom::ckpt {

// CheckpointDamaged (a checkpoint that cannot be used as it is on disk) is
// the SDK's, loom/error.hpp: a data plugin's restore() throws it too.

// Logs a warning the first time this process meets `msg`: checkpoints are
// listed many times during a start and at every save, a warning about one of
// them is said once.
void warn_once(const std::string& msg);

std::string step_dir_name(int64_t step);  // "step_00000120"
std::string rank_file_name(int rank);     // "rank_00000.bin"

class CheckpointWriter {
 public:
  CheckpointWriter(std::string root, int64_t step, int rank);
  // Records a host tensor (contiguous); its memory must stay valid until
  // write_shard(). Names are unique within a shard.
  void add(const std::string& name, const Tensor& t);
  // Writes <root>/step_X/rank_R.bin (creating the directories). Refuses to
  // write into a checkpoint already marked complete. Returns the CRC32 of the
  // shard's header (CheckpointReader::header_crc), which identifies the file.
  uint32_t write_shard();
  // Writes meta.json (must be valid JSON). Rank 0, before mark_complete.
  static void write_meta(const std::string& root, int64_t step, const std::string& json);
  // Writes COMPLETE (with meta.json's size and CRC32) after checking meta.json
  // and rank_00000.bin exist and, if
  // meta.json has an integer "world_size", that every rank's shard exists
  // (stale shards of higher ranks from an interrupted earlier attempt with a
  // larger world size are removed first). Call after a barrier on all ranks.
  static void mark_complete(const std::string& root, int64_t step);

 private:
  struct Item {
    std::string name;
    Tensor t;
  };
  std::string root_;
  int64_t step_;
  int rank_;
  std::vector<Item> items_;
};

struct CheckpointInfo {
  int64_t step = 0;
  std::string dir;
  bool complete = false;
};

// Every checkpoint folder under root (step_dir_name(step): an alias such as
// step_4 is warned about and left out), ascending by step (empty if root is
// missing). A checkpoint's name that is not a folder is refused.
std::vector<CheckpointInfo> list_checkpoints(const std::string& root);
std::optional<CheckpointInfo> latest_complete(const std::string& root);
// The checkpoint of `step`; throws if it is missing or incomplete, listing the complete ones.
CheckpointInfo find_step(const std::string& root, int64_t step);

// Why a complete checkpoint cannot be counted on at the level of this file's
// format ("" when it can): its marker must parse and certify meta.json, and
// rank 0's file must have a sound header whose tensors lie within the file.
// (Headers only: no tensor data is read.) It knows nothing of what meta.json
// lists: a training checkpoint is judged by training_checkpoint_damage
// (train_checkpoint.hpp), which checks every rank file.
std::string checkpoint_damage(const CheckpointInfo& c);

// Why a complete checkpoint cannot be counted on ("" when it can).
using DamageCheck = std::function<std::string(const CheckpointInfo&)>;

// Keeps the newest keep_last good checkpoints (complete, and `damage` finds
// nothing: the trainer passes training_checkpoint_damage, the validation
// resuming does). Removes older good ones and incomplete ones older than the
// newest good one; never touches the newest good one or anything newer (a
// save may be in progress). A damaged checkpoint is not counted, so it never
// takes a good one's place, and is not removed either: it is reported once
// as a warning, for its owner to look at. keep_last == 0 keeps everything.
// Returns the removed directories.
std::vector<std::string> prune(const std::string& root, int keep_last, const DamageCheck& damage);

struct TensorRecord {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // bytes from the start of the data section
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
  std::string shape_str() const;
};

class CheckpointReader {
 public:
  // `dir` is a step directory (CheckpointInfo::dir). Refuses a directory
  // without COMPLETE and validates the marker, meta.json's certificate and
  // the shard's header (every field type-checked); a damaged one throws
  // CheckpointDamaged.
  CheckpointReader(std::string dir, int rank);
  const std::string& dir() const { return dir_; }
  const std::string& file() const { return file_; }
  // meta.json's text.
  const std::string& meta() const { return meta_; }
  // Number of rank_*.bin shards in the directory (the world size that wrote it).
  int num_ranks() const { return num_ranks_; }
  // The step COMPLETE records (checked against the folder's name and the rank file).
  int64_t step() const { return step_; }
  // COMPLETE records the step only (the form of looms that did not yet
  // certify meta.json and record steps in rank files). Whether that is
  // acceptable is meta.json's format version's to say (CheckpointSet).
  bool legacy() const { return legacy_; }
  // The CRC32 of the rank file's header (CheckpointWriter::write_shard's result).
  uint32_t header_crc() const { return header_crc_; }
  std::vector<std::string> names() const;
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  const TensorRecord& info(const std::string& name) const;
  // Reads into a contiguous host tensor of the recorded dtype and shape; checks the CRC.
  void read(const std::string& name, Tensor& dst) const;

 private:
  std::string dir_;
  std::string file_;
  std::string meta_;
  int num_ranks_ = 0;
  int64_t step_ = 0;
  bool legacy_ = true;
  uint32_t header_crc_ = 0;
  uint64_t data_start_ = 0;
  uint64_t file_size_ = 0;
  std::vector<TensorRecord> tensors_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace loom::ckpt
