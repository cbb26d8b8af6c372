// Data plugins: batches of token ids for (rank, world), exact resume, a
// validation split (docs/PLUGINS.md).
#pragma once
#include <cstdint>
#include <string>

#include "loom/plugin.hpp"

namespace loom {

// The largest model.vocab_size: token ids are int32. A token, a shard's
// vocabulary or a data plugin's vocab_hint() beyond it is no vocabulary Loom
// can train.
inline constexpr int64_t kMaxVocabSize = 2147483647;

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
  // Continues from a state() kept in a checkpoint's meta.json ("data_state").
  // Throws loom::Error for a state it cannot continue from, naming the field
  // and the value (the core puts the file and field in front: "cannot resume
  // from .../meta.json: its "data_state" ... is refused: "); read every field
  // strictly (a negative number is no cursor) and check them all before
  // taking any. `loom check` calls it too, after open().
  virtual void restore(const std::string& state) = 0;
  // Largest token id + 1 this source can produce, or 0 if unknown (checked against the model).
  virtual int64_t vocab_hint() const { return 0; }
};

// What a token scan read.
struct TokenScanReport {
  uint64_t tokens = 0;  // tokens read
  uint64_t files = 0;   // files they were read from
  std::string what;     // those files in a few words ("3 train shard(s), 1 validation shard(s)")
};

// Optional second interface of a data source (ABI 8.1) whose tokens lie in
// files: read every token the run could ever be given, ahead of the run, and
// check each against the vocabulary. Training checks tokens only as it reads
// them (a scan of a large corpus at every start would be slow), so damage in
// the data is otherwise found only when a window reaches it; `loom check`
// scans through this interface, found with dynamic_cast on the DataSource. A
// separate class, so that DataSource and the vtable of every data plugin
// built without it stay as they were.
class TokenScan {
 public:
  virtual ~TokenScan();
  // Called after open(). Reads every token of every split (the files of each
  // split, or the part of them the split uses) and throws loom::Error at the
  // first one outside [0, spec.vocab_size) or outside the vocabulary the file
  // itself declares, naming the file, the token's position and its value.
  virtual TokenScanReport scan_tokens() const = 0;
};

// Optional interface of a data source whose rows pack documents (since ABI 8.3):
// where each document begins, for the document switches of [train]
// (reset_attention_mask, reset_position_ids, eod_mask_loss; docs/CONFIG.md).
// Found with dynamic_cast on the DataSource, like TokenScan; the core calls
// next_with_starts() instead of next() when one of the switches is on, and
// nothing of it otherwise.
class DocumentStarts {
 public:
  virtual ~DocumentStarts();
  // Called after open(): "" when the source can tell where its documents
  // begin; otherwise why it cannot, for the user (the core refuses the
  // switches with it at start-up, before any GPU work).
  virtual std::string starts_unavailable() const { return {}; }
  // next() — the same rows, the same position afterwards — that also writes
  // starts[batch * (seq_len + 1)], row-major like the tokens: 1 where a token
  // begins a document, 0 where it continues one. The flag of the last token
  // of a row (a target only) says whether the last input's target is the next
  // document's first token. Starts are a function of the data position (a
  // resumed or resharded run sees the same ones), never stored; a row's
  // first token begins a span of the row whatever its flag (a document
  // longer than a row continues in the next row as a span of its own).
  virtual void next_with_starts(Split split, int32_t* tokens, uint8_t* starts) = 0;
};

template <> struct PluginInterface<PluginKind::data> { using type = DataSource; };

}  // namespace loom
