#include "model/model.hpp"

#include <algorithm>

#include "loom/error.hpp"

namespace loom {

Model::Model(const ModelSpec& spec, std::string layers, std::string ffn, int64_t expert_parallel)
    : spec_(spec), layers_(std::move(layers)), ffn_name_(std::move(ffn)), embedding_(spec_) {
  LOOM_CHECK(spec_.hidden % spec_.num_heads == 0, "hidden ", spec_.hidden, " not divisible by num_heads ",
             spec_.num_heads);
  LOOM_CHECK(spec_.num_heads % spec_.num_kv_heads == 0, "num_heads ", spec_.num_heads,
             " not divisible by num_kv_heads ", spec_.num_kv_heads);
  units_.push_back(UnitInfo{"embedding", {}, 0});
  embedding_.declare(units_.back());
  layer_of_.push_back(-1);
  const AttentionVariant& attention = attention_variant(layers_);
  const FfnVariant& ffn_v = ffn_variant(ffn_name_, layers_, spec_);
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    attention_.push_back(attention.make(spec_, l));
    ffn_.push_back(ffn_v.make(spec_, l));
    experts_of_.push_back(-1);
    if (expert_parallel > 1) {
      // Before the layer: its backward (which fills the experts' gradients)
      // then runs before the experts unit's backward hooks.
      UnitInfo e{"layer." + std::to_string(l) + ".experts", {}, 0};
      e.expert_group = static_cast<int>(expert_parallel);
      if (ffn_.back()->declare_experts(e)) {
        experts_of_.back() = static_cast<int>(units_.size());
        units_.push_back(std::move(e));
        layer_of_.push_back(-1);
      }
    }
    units_.push_back(UnitInfo{"layer." + std::to_string(l), {}, 0});
    layer_of_.push_back(static_cast<int>(l));
    // Profiler range names with the layer's index, made once (a range takes a lasting const char*).
    range_names_.push_back("forward.layer." + std::to_string(l));
    range_names_.push_back("backward.layer." + std::to_string(l));
    attention_.back()->declare(units_.back());
    ffn_.back()->declare(units_.back());
  }
  head_ = std::make_unique<HeadBlock>(spec_);
  units_.push_back(UnitInfo{"head", {}, 0});
  head_->declare(units_.back());
  layer_of_.push_back(-1);
}

void Model::plan(const BlockEnv& env, ArenaPlan& plan) {
  env_ = env;
  env_.spec = &spec_;
  linear_ids_.clear();
  env_.linear_ids = &linear_ids_;
  linear_weights_.clear();
  env_.linear_weights = &linear_weights_;
  env_.first_micro = &first_micro_;
  env_.documents = documents_on() ? &documents_ : nullptr;
  const size_t n = static_cast<size_t>(env.N), e = dtype_size(env.act);
  const size_t stream_bytes = n * static_cast<size_t>(spec_.hidden) * e;
  const bool full = env.recompute == Recompute::full;
  res_.clear();
  mid_.clear();
  for (int64_t l = 0; l <= spec_.num_layers; ++l) res_.push_back(acts_.own("res." + std::to_string(l), stream_bytes));
  for (int64_t l = 0; l < spec_.num_layers; ++l) mid_.push_back(acts_.kept("res_mid", l, stream_bytes, full));
  d_res_ = acts_.shared("grad.res", stream_bytes);
  tokens_ = acts_.own("tokens", static_cast<size_t>(staged_words()) * 4);
  losses_.clear();
  env_.losses = &losses_;  // blocks add theirs as they plan
  env_.micro = &micro_;
  embedding_.plan(env_, acts_);
  for (size_t l = 0; l < attention_.size(); ++l) {
    attention_[l]->plan(env_, acts_);
    ffn_[l]->plan(env_, acts_);
  }
  head_->plan(env_, acts_);
  acts_.add_to(plan);
}

void Model::bind(const Arena& arena) {
  acts_.bind(arena);
  env_.backend->prepare_rope(env_.S, spec_.head_dim(), spec_.rope_theta);
  if (documents_on()) {
    const int64_t N = env_.N;
    const Tensor t = tokens();
    documents_.positions = view(t, 2 * N, {N});
    documents_.cu_seqlens = view(t, 3 * N, {N + 1});
    documents_.lengths = view(t, 4 * N + 1, {N});
  }
  embedding_.bind(acts_);
  for (size_t l = 0; l < attention_.size(); ++l) {
    attention_[l]->bind(acts_);
    ffn_[l]->bind(acts_);
  }
  head_->bind(acts_);
  for (size_t i = 0; i < losses_.size(); ++i) losses_.at(i).bind(acts_);
}

Tensor Model::stream(int id) const {
  return Tensor(acts_.ptr(id), env_.act, env_.backend->device(), {env_.N, spec_.hidden});
}
Tensor Model::tokens() const {
  return Tensor(acts_.ptr(tokens_), DType::i32, env_.backend->device(), {staged_words()});
}
void Model::set_documents(int64_t count, int64_t longest) {
  LOOM_CHECK(documents_on(), "set_documents: the model was planned without document spans");
  LOOM_CHECK(count >= 1 && count <= env_.N && longest >= 1 && longest <= env_.S, "set_documents: ", count,
             " spans, the longest ", longest, " tokens, for ", env_.B, " rows of ", env_.S);
  documents_.count = count;
  documents_.longest = longest;
  ++documents_.serial;
}
Tensor Model::inputs() const {
  return Tensor(acts_.ptr(tokens_), DType::i32, env_.backend->device(), {env_.B, env_.S});
}
Tensor Model::targets() const { return view(tokens(), env_.N, {env_.N}); }
void Model::add_extra_losses(Tensor& acc) const {
  for (size_t i = 0; i < losses_.size(); ++i) env_.backend->sum_into(acc, losses_.at(i).value(), 0, 1, false);
}

void Model::forward_unit(int unit, std::vector<UnitState>& units, bool training, float dloss_scale) {
  Backend& be = *env_.backend;
  const int64_t L = spec_.num_layers;
  UnitState& u = units[static_cast<size_t>(unit)];
  micro_.training = training;
  micro_.replay = false;
  if (unit == 0) {
    if (training)  // a new micro-batch: the extra losses' statistics start from zero
      for (size_t i = 0; i < losses_.size(); ++i) losses_.at(i).begin(be);
    Range r(be, "forward.embedding");
    Tensor x0 = stream(res_[0]);
    embedding_.forward(u, inputs(), x0);
    return;
  }
  if (unit + 1 < num_units()) {
    if (layer_of_[static_cast<size_t>(unit)] < 0) return;  // an experts unit: its layer reads it
    const size_t l = static_cast<size_t>(layer_of_[static_cast<size_t>(unit)]);
    Range r(be, range_names_[2 * l].c_str());
    Tensor x = stream(res_[l]), mid = stream(mid_[l]), out = stream(res_[l + 1]);
    ffn_[l]->set_experts(experts_of_[l] >= 0 ? &units[static_cast<size_t>(experts_of_[l])] : nullptr);
    attention_[l]->forward(u, x, mid);
    ffn_[l]->forward(u, mid, out);
    return;
  }
  if (training)  // every layer has run: each extra loss and the gradient its blocks' backward reads
    for (size_t i = 0; i < losses_.size(); ++i) {
      ExtraLoss& loss = losses_.at(i);
      Range r(be, loss.range());
      loss.finish(be, dloss_scale);
    }
  Range r(be, "forward.head");
  dloss_scale_ = dloss_scale * loss_weight_;
  head_->forward(units, unit, stream(res_[static_cast<size_t>(L)]), targets(), training);
}

Model::FreshGrads Model::fresh_grads(int unit) const {
  // The tied embedding holds the head's part already; the tied head adds into the embedding's.
  if (unit == 0) return spec_.tied_embeddings ? FreshGrads::refused : FreshGrads::written;
  if (unit + 1 == num_units()) return spec_.tied_embeddings ? FreshGrads::cleared : FreshGrads::written;
  const int l = layer_of_[static_cast<size_t>(unit)];
  if (l < 0) return FreshGrads::refused;  // an experts unit: its layer's backward filled it
  // A MoE layer under expert parallelism also adds into its experts unit's gradients.
  return experts_of_[static_cast<size_t>(l)] >= 0 ? FreshGrads::cleared : FreshGrads::written;
}

void Model::backward_unit(int unit, std::vector<UnitState>& units) {
  Backend& be = *env_.backend;
  UnitState& u = units[static_cast<size_t>(unit)];
  // A gradient buffer lent for this backward alone (UnitState::grads_fresh)
  // is written like a step's first micro-batch, without a clearing pass: the
  // unit's blocks write every gradient they own. A unit whose backward also
  // adds into another unit's gradients (those accumulate over the step) keeps
  // accumulating, so its own buffer is cleared first.
  const bool step_first = first_micro_;
  if (u.grads_fresh) {
    const FreshGrads f = fresh_grads(unit);
    LOOM_CHECK(f != FreshGrads::refused, "the sharding strategy marked unit '", u.info->name,
               "' gradients fresh (UnitState::grads_fresh), but another unit's backward has already written into ",
               "them (", unit == 0 ? "the LM head, tied to the embedding" : "its MoE layer",
               "): a strategy may lend a fresh buffer only to a unit that fills its own gradients");
    if (f == FreshGrads::written) first_micro_ = true;
    else if (!step_first) be.zero(u.grads);
  }
  struct Restore {
    bool& flag;
    bool value;
    ~Restore() { flag = value; }
  } restore{first_micro_, step_first};
  backward_blocks(unit, units);
}

void Model::backward_blocks(int unit, std::vector<UnitState>& units) {
  Backend& be = *env_.backend;
  const int64_t L = spec_.num_layers;
  UnitState& u = units[static_cast<size_t>(unit)];
  Tensor d = stream(d_res_);
  if (unit == 0) {
    Range r(be, "backward.embedding");
    embedding_.backward(u, inputs(), d);
    return;
  }
  if (unit + 1 < num_units()) {
    if (layer_of_[static_cast<size_t>(unit)] < 0) return;  // an experts unit: its layer's backward filled it
    const size_t l = static_cast<size_t>(layer_of_[static_cast<size_t>(unit)]);
    Range r(be, range_names_[2 * l + 1].c_str());
    Tensor x = stream(res_[l]), mid = stream(mid_[l]);
    ffn_[l]->set_experts(experts_of_[l] >= 0 ? &units[static_cast<size_t>(experts_of_[l])] : nullptr);
    if (env_.recompute == Recompute::full) {
      // Only the residual stream was kept: rebuild this layer's activations
      // (its output, rewritten into res[l + 1], comes out the same).
      Tensor out = stream(res_[l + 1]);
      micro_.training = true;
      micro_.replay = true;  // the same draws; the statistics were taken in the first forward
      attention_[l]->forward(u, x, mid);
      ffn_[l]->forward(u, mid, out);
    }
    ffn_[l]->backward(u, mid, d);
    attention_[l]->backward(u, x, d);
    return;
  }
  Range r(be, "backward.head");
  head_->backward(units, unit, stream(res_[static_cast<size_t>(L)]), targets(), dloss_scale_, d);
}

int64_t head_chunk_tokens(const std::string& layers, int64_t configured, int64_t tokens, int64_t vocab, DType act) {
  if (!attention_variant(layers).chunked_head) return tokens;
  if (configured > 0) return std::min(configured, tokens);
  const int64_t budget = (int64_t{1} << 30) / (vocab * static_cast<int64_t>(dtype_size(act)));
  int64_t c = budget >= 128 ? budget / 128 * 128 : std::max<int64_t>(budget, 1);
  return std::clamp<int64_t>(c, 1, tokens);
}

BlockFloor model_floor(const ModelSpec& spec, const std::string& layers, const std::string& ffn, const FloorEnv& env,
                       int64_t head_chunk) {
  using LD = long double;
  const AttentionVariant& attention = attention_variant(layers);
  const BlockFloor a = attention.floor(env), f = ffn_variant(ffn, layers, spec).floor(env);
  const LD h = static_cast<LD>(spec.hidden), V = static_cast<LD>(spec.vocab_size), L = static_cast<LD>(spec.num_layers);
  BlockFloor m;
  // The embedding [V, h], the final norm, and an untied head's [V, h].
  m.params = V * h * (spec.tied_embeddings ? 1 : 2) + h + L * (a.params + f.params);
  m.tensors = (spec.tied_embeddings ? 2 : 3) + spec.num_layers * (a.tensors + f.tensors);
  const LD head_rows = !attention.chunked_head ? env.tokens
                       : head_chunk > 0        ? std::min(static_cast<LD>(head_chunk), env.tokens)
                                               : 1;
  m.activations = (L + 1) * env.tokens * h + head_rows * V + a.activations + f.activations;
  return m;
}

}  // namespace loom
