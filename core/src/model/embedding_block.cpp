// The token embedding: x0 = wte[tokens]; backward scatters the gradient back
// by token in a fixed order (deterministic).
#include "model/model_blocks.hpp"

namespace loom {

void EmbeddingBlock::declare(UnitInfo& u) {
  add_param(u, "model.embed_tokens.weight", {spec_.vocab_size, spec_.hidden}, ParamRole::embedding);
}

void EmbeddingBlock::plan(const BlockEnv& env, ActivationPlan&) { env_ = env; }

void EmbeddingBlock::forward(const UnitState& u, const Tensor& tokens, Tensor& out) {
  env_.backend->embedding_forward(out, tokens, param(u, 0));
}

void EmbeddingBlock::backward(UnitState& u, const Tensor& tokens, const Tensor& d) {
  Tensor dwte = param(u, 0, true);
  // The scatter adds rows. In a writing micro-batch (BlockEnv::first_micro)
  // the gradient is zeroed first, unless the head's weight is this one
  // (tied): the head's backward, which runs before, has written it.
  if (env_.writes_grads() && !spec_.tied_embeddings) env_.backend->zero(dwte);
  env_.backend->embedding_backward(dwte, d, tokens);
}

}  // namespace loom
