#include "train/token_stager.hpp"

#include <algorithm>

#include "loom/error.hpp"

namespace loom {

TokenStager::TokenStager(Backend& backend, int64_t batch, int64_t seq, int64_t slots)
    : be_(backend), B_(batch), S_(seq) {
  const int64_t slot_bytes = 2 * B_ * S_ * 4;
  slots_ = std::clamp<int64_t>(slots, 2, std::max<int64_t>(2, (int64_t{64} << 20) / slot_bytes));
  raw_.assign(static_cast<size_t>(B_ * (S_ + 1)), 0);
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
  int32_t* slot = pinned_ + next_ * 2 * B_ * S_;
  next_ = (next_ + 1) % slots_;
  ++in_flight_;
  return slot;
}

void TokenStager::stage(DataSource& data, Split split, Tensor& dst, int64_t vocab, const std::string& plugin) {
  data.next(split, raw_.data());
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
  be_.upload_async(dst, slot, static_cast<size_t>(2 * N) * 4);
}

void TokenStager::stage(const int32_t* inputs, const int32_t* targets, Tensor& dst) {
  int32_t* slot = next_slot();
  const int64_t N = B_ * S_;
  std::copy(inputs, inputs + N, slot);
  std::copy(targets, targets + N, slot + N);
  be_.upload_async(dst, slot, static_cast<size_t>(2 * N) * 4);
}

}  // namespace loom
