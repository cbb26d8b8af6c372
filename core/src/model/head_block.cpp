// The final norm, the LM head and the fused cross-entropy, chunk by chunk
// (see model_blocks.hpp for why):
//
//   h = rmsnorm(x)
//   for each chunk c of tokens:
//     logits_c = h_c W^T                       [rows, V], the only logits that exist
//     loss_c, dlogits_c = cross_entropy(logits_c)   dlogits written over logits_c
//     dh_c = dlogits_c W ;  dW += dlogits_c^T h_c
//   dx = rmsnorm_backward(dh)
#include <algorithm>

#include "loom/error.hpp"
#include "model/model_blocks.hpp"

namespace loom {

namespace {
enum Param { kNorm = 0, kLmHead };
}

void HeadBlock::declare(UnitInfo& u) {
  add_param(u, "model.norm.weight", {spec_.hidden}, ParamRole::norm_gain);
  if (spec_.tied_embeddings) u.uses_params_of = 0;  // the head reads the embedding matrix
  else add_param(u, "lm_head.weight", {spec_.vocab_size, spec_.hidden}, ParamRole::matrix);
}

void HeadBlock::plan(const BlockEnv& env, ActivationPlan& a) {
  env_ = env;
  LOOM_CHECK(env.head_chunk >= 1 && env.head_chunk <= env.N, "head: chunk of ", env.head_chunk,
             " tokens for a micro-batch of ", env.N);
  const int64_t h = spec_.hidden, V = spec_.vocab_size;
  const size_t n = static_cast<size_t>(env.N), e = dtype_size(env.act);
  lnf_ = a.own("ln_f", n * h * e);
  rstd_ = a.own("rstd_f", n * 4);
  logits_ = a.own("logits", static_cast<size_t>(env.head_chunk * V) * e);
  losses_ = a.own("losses", n * 4);
  d_ln_ = a.shared("grad.ln", n * h * e);
  LinearDesc head{"lm_head", h, V, env.head_chunk, LinearRole::lm_head};
  // The final norm's output is kept whole and handed to each chunk's backward.
  head.input_in_backward = env.recompute == Recompute::selective;
  lm_head_ = env.register_linear(head);
}

Tensor HeadBlock::weight(std::vector<UnitState>& units, int self, bool grad) const {
  if (!spec_.tied_embeddings) return param(units[static_cast<size_t>(self)], kLmHead, grad);
  // Tied: the embedding matrix, unit 0's first (and only) parameter.
  const UnitState& e = units[0];
  const ParamInfo& p = e.info->params[0];
  return view(grad ? e.grads : e.params, p.offset, {p.shape[0], p.shape[1]});
}

Tensor HeadBlock::losses() const { return Tensor(buf(losses_), DType::f32, env_.backend->device(), {env_.N}); }

Tensor HeadBlock::chunk_logits(std::vector<UnitState>& units, int self, int64_t first, int64_t rows) {
  const Device dev = env_.backend->device();
  const int64_t h = spec_.hidden, V = spec_.vocab_size;
  Tensor lnf = view(Tensor(buf(lnf_), env_.act, dev, {env_.N * h}), first * h, {rows, h});
  Tensor logits(buf(logits_), env_.act, dev, {rows, V});
  env_.precision->linear_forward(env_.backend->ctx(), lm_head_, lnf, weight(units, self, false), logits, nullptr);
  return logits;
}

void HeadBlock::forward(std::vector<UnitState>& units, int self, const Tensor& x, const Tensor& targets,
                        bool training) {
  Backend& be = *env_.backend;
  const Device dev = be.device();
  const int64_t N = env_.N, h = spec_.hidden, C = env_.head_chunk;
  Tensor lnf(buf(lnf_), env_.act, dev, {N, h});
  Tensor rstd(buf(rstd_), DType::f32, dev, {N});
  be.rmsnorm_forward(lnf, rstd, x, param(units[static_cast<size_t>(self)], kNorm),
                     static_cast<float>(spec_.norm_eps));
  if (training) return;  // the loss and its gradient come chunk by chunk in backward
  Tensor all_losses = losses();
  for (int64_t first = 0; first < N; first += C) {
    const int64_t rows = std::min(C, N - first);
    Tensor logits = chunk_logits(units, self, first, rows);
    Tensor tg = view(targets, first, {rows});
    Tensor ls = view(all_losses, first, {rows});
    be.cross_entropy(logits, tg, ls, 0.f);
  }
}

void HeadBlock::backward(std::vector<UnitState>& units, int self, const Tensor& x, const Tensor& targets,
                         float dloss_scale, Tensor& d) {
  Backend& be = *env_.backend;
  const ExecContext& ctx = be.ctx();
  const Device dev = be.device();
  const int64_t N = env_.N, h = spec_.hidden, C = env_.head_chunk;
  Tensor all_losses = losses();
  Tensor lnf_all(buf(lnf_), env_.act, dev, {N * h});
  Tensor d_ln_all(buf(d_ln_), env_.act, dev, {N * h});
  Tensor w = weight(units, self, false), dw = weight(units, self, true);
  // The first chunk of a writing micro-batch (BlockEnv::first_micro) writes
  // dW (tied: the embedding's gradient, whose scatter then adds to it).
  bool acc = !env_.writes_grads();
  for (int64_t first = 0; first < N; first += C) {
    const int64_t rows = std::min(C, N - first);
    Range r(be, "head.chunk");
    Tensor logits = [&] {
      Range g(be, "lm_head");
      return chunk_logits(units, self, first, rows);
    }();
    {
      Range ce(be, "cross_entropy");
      Tensor tg = view(targets, first, {rows});
      Tensor ls = view(all_losses, first, {rows});
      be.cross_entropy(logits, tg, ls, dloss_scale);  // logits now hold their gradient
    }
    Range g(be, "lm_head.grad");
    Tensor lnf = view(lnf_all, first * h, {rows, h});
    Tensor d_ln = view(d_ln_all, first * h, {rows, h});
    env_.precision->linear_backward(ctx, lm_head_, lnf, w, logits, &d_ln, dw, acc);
    acc = true;
  }
  Range r(be, "rmsnorm.grad");
  be.zero(d);
  UnitState& u = units[static_cast<size_t>(self)];
  Tensor dnorm = param(u, kNorm, true);
  if (env_.writes_grads()) be.zero(dnorm);  // the first micro-batch writes
  be.rmsnorm_backward(d, dnorm, Tensor(buf(d_ln_), env_.act, dev, {N, h}), x, param(u, kNorm),
                      Tensor(buf(rstd_), DType::f32, dev, {N}));
}

Tensor HeadBlock::logits_of_chunk(std::vector<UnitState>& units, int self, int64_t c) {
  const int64_t first = c * env_.head_chunk;
  LOOM_CHECK(first >= 0 && first < env_.N, "head: chunk ", c, " outside the micro-batch");
  return chunk_logits(units, self, first, std::min(env_.head_chunk, env_.N - first));
}

}  // namespace loom
