// The tokens of each micro-batch on their way to the device, without making
// the host wait: the data source fills host memory, the host splits it into
// inputs and targets in a pinned slot, and the copy to the device is queued on
// the stream. A slot is written again only once the device has certainly read
// it — after the host's last synchronisation with the device (a log step reads
// the step log, which waits for all queued work). With at least as many slots
// as micro-batches between two synchronisations, staging never waits; when the
// ring would wrap onto a slot still in flight it synchronises (counted).
//
// Packed documents (the [train] switches): the source also says where its
// documents begin (loom::DocumentStarts), and the host derives from that, in
// the same slot and the same copy, what the step needs of them — the
// document spans of every row (positions, cu_seqlens, lengths: loom/attention.hpp's
// DocumentSpans) and, under eod_mask_loss, the targets that carry no loss
// (set to -1, which the cross-entropy skips). Nothing of it is stored: it
// follows from the data position.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/data.hpp"
#include "loom/ops/backend.hpp"

namespace loom {

// What the host learnt of a staged micro-batch.
struct StagedBatch {
  int64_t spans = 0, longest = 0;  // document spans and the longest one's tokens (staged with spans)
  int64_t loss_tokens = 0;         // targets that carry loss (all N unless eod_mask_loss masked some)
};

// What staging derives from the documents' starts.
struct StagedDocuments {
  bool spans = false;      // stage the document spans after the targets (Model::staged_words)
  bool mask_loss = false;  // no loss on a document's last token (its target begins the next document)
  bool any() const { return spans || mask_loss; }
};

class TokenStager {
 public:
  // slots: the ring's length (capped so that it stays within 64 MiB).
  TokenStager(Backend& backend, int64_t batch, int64_t seq, int64_t slots, StagedDocuments docs = {});
  ~TokenStager();
  TokenStager(const TokenStager&) = delete;
  TokenStager& operator=(const TokenStager&) = delete;

  // The next micro-batch of `split` from `data`, checked against the vocabulary
  // (plugin names the data plugin in the message), queued into dst (int32 on
  // the device: inputs, targets and, with spans, the spans; Model::tokens()).
  // With documents, `data` must implement loom::DocumentStarts.
  StagedBatch stage(DataSource& data, Split split, Tensor& dst, int64_t vocab, const std::string& plugin);
  // Host-side split of ready-made inputs and targets ([B * S] each), for
  // tests; with documents, starts [B * (S + 1)] as DocumentStarts writes them.
  StagedBatch stage(const int32_t* inputs, const int32_t* targets, Tensor& dst, const uint8_t* starts = nullptr);
  // The host has just synchronised with the device: every slot is free.
  void device_caught_up() { in_flight_ = 0; }
  int64_t slots() const { return slots_; }
  const StagedDocuments& documents() const { return docs_; }

 private:
  int32_t* next_slot();
  // The spans and the loss mask of the micro-batch in `slot` (inputs and
  // targets already there) from the starts in flags_.
  StagedBatch derive(int32_t* slot) const;
  Backend& be_;
  int64_t B_, S_, words_, slots_, next_ = 0, in_flight_ = 0;
  StagedDocuments docs_;
  std::vector<int32_t> raw_;    // [B, S + 1] as the data source writes it
  std::vector<uint8_t> flags_;  // [B, S + 1] document starts, with documents
  int32_t* pinned_ = nullptr;   // slots x [words_]
};

}  // namespace loom
