// The inside of a Session, for the tests and `loom bench` only: they drive
// forward and backward on batches of their own, time the step's parts, read
// and write parameters, and look at the memory plan and the recipe's state.
// A run (`loom train`, `check`, `compare`) needs none of it: Session's own
// interface is the run.
//
//   loom::SessionProbe p(session);      // or loom::probe(session)
//   p.load_batch(inputs, targets);
//   p.forward(true, scale); p.backward();
//   p.read_param("model.norm.weight", /*grad=*/true);
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "train/session.hpp"

namespace loom {

// What the tests' synchronous optimizer step reads back.
struct StepResult {
  double grad_norm = 0;  // global norm before clipping
  bool skipped = false;  // non-finite gradients: no update
};

class SessionProbe {
 public:
  explicit SessionProbe(Session& s) : s_(s) {}

  TrainState& state() { return *s_.state_; }
  Model& model() { return *s_.model_; }
  Backend& backend() { return *s_.rt_.backend; }
  Precision& precision() { return *s_.rt_.precision; }  // the recipe (its state tensors)
  std::vector<UnitState>& units() { return s_.units(); }
  const ArenaPlan& memory_plan() const { return s_.state_->plan(); }
  TrainState::MemoryFormula memory_formula() const { return s_.state_->memory_formula(); }
  // Times the backend made the host wait for the device (loom/ops/backend.hpp).
  int64_t host_syncs() const { return s_.rt_.backend->host_syncs(); }

  // A micro-batch of the caller's: host [B*S] inputs and targets; with the
  // [train] document switches also the document starts, [B * (S + 1)] as
  // loom::DocumentStarts writes them.
  void load_batch(const int32_t* inputs, const int32_t* targets, const uint8_t* starts = nullptr);
  // Every unit forward (backward), with the sharding hooks around each, as
  // the step runs them. Training keeps what backward needs; its loss comes in
  // the head's backward with gradient scale dloss_scale.
  void forward(bool training, float dloss_scale) { s_.forward(training, dloss_scale); }
  void forward_unit(int unit, bool training, float dloss_scale) { s_.forward_unit(unit, training, dloss_scale); }
  void backward() { s_.backward(); }
  void backward_unit(int unit) { s_.backward_unit(unit); }
  // Mean token loss of the last evaluation forward or training backward, over
  // the tokens that carry loss (synchronises).
  double batch_loss();
  // The blocks' extra losses (a mixture of experts' load-balancing loss,
  // unweighted) of the last training forward, summed (synchronises); 0 without.
  double batch_aux_loss();
  // Zeroes every gradient and the step's loss and norm accumulators (a new step).
  void zero_grads();
  // A whole optimizer step on the gradients in place (after zero_grads,
  // forward and backward), read back (synchronises).
  StepResult optimizer_step(int64_t step_index);
  // The logits [B*S, V] of the last evaluation forward, copied to host fp32
  // (computed chunk by chunk when the head is chunked).
  std::vector<float> logits();

  std::vector<float> read_tensor(const Tensor& t) const { return s_.state_->read_tensor(t); }
  // Parameters by HF name (TrainState::read_param: the whole tensor on this rank).
  std::vector<float> read_param(const std::string& hf_name, bool grad = false) const {
    return s_.state_->read_param(hf_name, grad);
  }
  void write_param(const std::string& hf_name, const float* src) { s_.state_->write_param(hf_name, src); }

 private:
  Session& s_;
};

inline SessionProbe probe(Session& s) { return SessionProbe(s); }

}  // namespace loom
