// The tokens of each micro-batch on their way to the device, without making
// the host wait: the data source fills host memory, the host splits it into
// inputs and targets in a pinned slot, and the copy to the device is queued on
// the stream. A slot is written again only once the device has certainly read
// it — after the host's last synchronisation with the device (a log step reads
// the step log, which waits for all queued work). With at least as many slots
// as micro-batches between two synchronisations, staging never waits; when the
// ring would wrap onto a slot still in flight it synchronises (counted).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/data.hpp"
#include "kernels/backend.hpp"

namespace loom {

class TokenStager {
 public:
  // slots: the ring's length (capped so that it stays within 64 MiB).
  TokenStager(Backend& backend, int64_t batch, int64_t seq, int64_t slots);
  ~TokenStager();
  TokenStager(const TokenStager&) = delete;
  TokenStager& operator=(const TokenStager&) = delete;

  // The next micro-batch of `split` from `data`, checked against the vocabulary
  // (plugin names the data plugin in the message), queued into dst ([2 * B * S]
  // int32 on the device: inputs, then targets).
  void stage(DataSource& data, Split split, Tensor& dst, int64_t vocab, const std::string& plugin);
  // Host-side split of ready-made inputs and targets ([B * S] each), for tests.
  void stage(const int32_t* inputs, const int32_t* targets, Tensor& dst);
  // The host has just synchronised with the device: every slot is free.
  void device_caught_up() { in_flight_ = 0; }
  int64_t slots() const { return slots_; }

 private:
  int32_t* next_slot();
  Backend& be_;
  int64_t B_, S_, slots_, next_ = 0, in_flight_ = 0;
  std::vector<int32_t> raw_;  // [B, S + 1] as the data source writes it
  int32_t* pinned_ = nullptr; // slots x [2 * B * S]
};

}  // namespace loom
