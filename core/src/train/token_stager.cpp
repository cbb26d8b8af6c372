#include "train/token_stager.hpp"

#include <algorithm>

#include "loom/error.hpp"

namespace loom {

TokenStager::TokenStager(Backend& backend, int64_t batch, int64_t seq, int64_t slots, StagedDocuments docs)
    : be_(backend), B_(batch), S_(seq), docs_(docs) {
  const int64_t N = B_ * S_;
  words_ = docs_.spans ? 5 * N + 1 : 2 * N;
  const int64_t slot_bytes = words_ * 4;
  slots_ = std::clamp<int64_t>(slots, 2, std::max<int64_t>(2, (int64_t{64} << 20) / slot_bytes));
  raw_.assign(static_cast<size_t>(B_ * (S_ + 1)), 0);
  if (docs_.any()) flags_.assign(raw_.size(), 0);
  pinned_ = static_cast<int32_t*>(be_.host_alloc(static_cast<size_t>(slots_ * slot_bytes)));
}

TokenStager::~TokenStager() {
  // Copies from the ring may still be queued: let them land before the memory goes.
  try {
    be_.synchronize();
  } catch (...) {
  }
  be_.host_free(pinned_);
}

int32_t* TokenStager::next_slot() {
  if (in_flight_ >= slots_) {
    be_.synchronize();  // the ring wraps onto a slot the device may not have read yet
    in_flight_ = 0;
  }
  int32_t* slot = pinned_ + next_ * words_;
  next_ = (next_ + 1) % slots_;
  ++in_flight_;
  return slot;
}

StagedBatch TokenStager::derive(int32_t* slot) const {
  const int64_t N = B_ * S_, row = S_ + 1;
  StagedBatch r;
  r.loss_tokens = N;
  int32_t* targets = slot + N;
  if (docs_.mask_loss)
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t p = 0; p < S_; ++p)
        if (flags_[static_cast<size_t>(b * row + p + 1)]) {  // the target begins the next document
          targets[b * S_ + p] = -1;
          --r.loss_tokens;
        }
  if (!docs_.spans) return r;
  int32_t* positions = slot + 2 * N;
  int32_t* cu = slot + 3 * N;
  int32_t* lengths = slot + 4 * N + 1;
  int64_t k = 0;  // spans so far
  auto close_span = [&](int64_t begin, int64_t end) {  // row-relative [begin, end) of row b
    lengths[k] = static_cast<int32_t>(end - begin);
    r.longest = std::max(r.longest, end - begin);
    ++k;
  };
  for (int64_t b = 0; b < B_; ++b) {
    int64_t start = 0;  // a row's first token begins a span whatever its flag
    cu[k] = static_cast<int32_t>(b * S_);
    for (int64_t p = 0; p < S_; ++p) {
      if (p > 0 && flags_[static_cast<size_t>(b * row + p)]) {
        close_span(start, p);
        cu[k] = static_cast<int32_t>(b * S_ + p);
        start = p;
      }
      positions[b * S_ + p] = static_cast<int32_t>(p - start);
    }
    close_span(start, S_);
  }
  r.spans = k;
  // The unused spans are empty ones at the end, so that any prefix covering
  // the used ones describes the micro-batch (loom/attention.hpp).
  std::fill(cu + k, cu + N + 1, static_cast<int32_t>(N));
  std::fill(lengths + k, lengths + N, 0);
  return r;
}

StagedBatch TokenStager::stage(DataSource& data, Split split, Tensor& dst, int64_t vocab, const std::string& plugin) {
  if (docs_.any()) {
    auto* starts = dynamic_cast<DocumentStarts*>(&data);
    LOOM_CHECK(starts != nullptr, "data.plugin = \"", plugin, "\" tells no document starts (loom::DocumentStarts), ",
               "which the run's document switches need");
    starts->next_with_starts(split, raw_.data(), flags_.data());
  } else {
    data.next(split, raw_.data());
  }
  for (int32_t t : raw_)
    if (t < 0 || t >= vocab)
      throw Error(cat("data.plugin = \"", plugin, "\" produced token id ", t, " outside [0, ", vocab,
                      ") (model.vocab_size)"));
  int32_t* slot = next_slot();
  const int64_t N = B_ * S_;
  for (int64_t b = 0; b < B_; ++b) {
    const int32_t* row = raw_.data() + b * (S_ + 1);
    std::copy(row, row + S_, slot + b * S_);
    std::copy(row + 1, row + S_ + 1, slot + N + b * S_);
  }
  const StagedBatch r = docs_.any() ? derive(slot) : StagedBatch{0, 0, N};
  be_.upload_async(dst, slot, static_cast<size_t>(words_) * 4);
  return r;
}

StagedBatch TokenStager::stage(const int32_t* inputs, const int32_t* targets, Tensor& dst, const uint8_t* starts) {
  LOOM_CHECK(docs_.any() == (starts != nullptr), "token staging: document starts ",
             starts ? "given to a run without document switches" : "missing for a run with document switches");
  int32_t* slot = next_slot();
  const int64_t N = B_ * S_;
  std::copy(inputs, inputs + N, slot);
  std::copy(targets, targets + N, slot + N);
  StagedBatch r{0, 0, N};
  if (starts) {
    std::copy(starts, starts + B_ * (S_ + 1), flags_.begin());
    r = derive(slot);
  }
  be_.upload_async(dst, slot, static_cast<size_t>(words_) * 4);
  return r;
}

}  // namespace loom
