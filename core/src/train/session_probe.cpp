#include "train/session_probe.hpp"

#include "loom/error.hpp"

namespace loom {

void SessionProbe::load_batch(const int32_t* inputs, const int32_t* targets, const uint8_t* starts) {
  LOOM_CHECK(s_.initialised_, "load_batch() before initialise()");
  s_.load_batch(inputs, targets, starts);
}

double SessionProbe::batch_loss() {
  const double sum = s_.rt_.backend->sum(s_.model_->losses());
  s_.stager_->device_caught_up();
  // Over the tokens that carry loss (all of them unless train.eod_mask_loss).
  return s_.loss_tokens_ > 0 ? sum / static_cast<double>(s_.loss_tokens_) : 0.0;
}

double SessionProbe::batch_aux_loss() {
  const ExtraLosses& losses = s_.model_->extra_losses();
  double aux = 0;
  for (size_t i = 0; i < losses.size(); ++i) {
    float v = 0.f;
    s_.rt_.backend->download(&v, losses.at(i).value(), sizeof v);
    aux += v;
  }
  s_.stager_->device_caught_up();
  return aux;
}

void SessionProbe::zero_grads() {
  Backend& be = *s_.rt_.backend;
  be.wait(be.ctx(), be.mark(be.side_ctx()));  // nothing on the optimizer queue still reads them
  s_.state_->zero_grads();
  be.zero(s_.state_->scalars());  // a new step's loss and norm accumulators
}

StepResult SessionProbe::optimizer_step(int64_t step_index) {
  Backend& be = *s_.rt_.backend;
  s_.queue_optimizer_step(step_index);
  be.wait(be.ctx(), be.mark(be.side_ctx()));
  double sc[kStepScalars];
  be.download(sc, s_.state_->scalars(), sizeof sc);
  s_.stager_->device_caught_up();
  return {sc[kGradNorm], sc[kSkip] != 0.0};
}

std::vector<float> SessionProbe::logits() {
  LOOM_CHECK(s_.initialised_, "logits() before initialise()");
  HeadBlock& head = s_.model_->head();
  const int64_t N = s_.model_->env().N, V = s_.model_->spec().vocab_size, C = head.chunk();
  std::vector<float> out;
  out.reserve(static_cast<size_t>(N * V));
  const int head_unit = s_.model_->num_units() - 1;
  for (int64_t c = 0; c * C < N; ++c) {
    std::vector<float> part = read_tensor(head.logits_of_chunk(s_.units(), head_unit, c));
    out.insert(out.end(), part.begin(), part.end());
  }
  s_.stager_->device_caught_up();
  return out;
}

}  // namespace loom
