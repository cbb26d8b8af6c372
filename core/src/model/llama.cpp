#include "model/llama.hpp"

#include <cmath>

#include "loom/error.hpp"

namespace loom {

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::none;
  if (s == "attention") return Recompute::attention;
  if (s == "full") return Recompute::full;
  throw Error(cat("model.recompute = \"", s, "\" is not one of: none, attention, full"));
}

// A profiler range (NVTX on CUDA) for the scope of one op or layer.
namespace {
class Range {
 public:
  Range(Backend& b, const char* name) : b_(b) { b_.range_push(name); }
  ~Range() { b_.range_pop(); }
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  Backend& b_;
};
}  // namespace

// Parameter indices inside a unit (see model_units.cpp for the order).
namespace {
enum LayerParam { kLn1 = 0, kWq, kWk, kWv, kWo, kLn2, kWgate, kWup, kWdown };
enum HeadParam { kNormF = 0, kLmHead };
}  // namespace

LlamaModel::LlamaModel(const ModelSpec& spec, int64_t batch, int64_t seq, Recompute recompute, DType act_dtype,
                       Precision& precision, Attention& attention, Backend& backend)
    : spec_(spec), B_(batch), S_(seq), N_(batch * seq), recompute_(recompute), act_dtype_(act_dtype),
      precision_(precision), attention_(attention), backend_(backend) {}

AttentionShape LlamaModel::attention_shape() const {
  AttentionShape a;
  a.batch = B_;
  a.seq = S_;
  a.heads = spec_.num_heads;
  a.kv_heads = spec_.num_kv_heads;
  a.head_dim = spec_.head_dim();
  a.causal = true;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.head_dim)));
  return a;
}

void LlamaModel::plan(ArenaPlan& p) {
  const int64_t h = spec_.hidden, qd = spec_.q_dim(), kvd = spec_.kv_dim(), f = spec_.ffn_hidden;
  const int64_t V = spec_.vocab_size, L = spec_.num_layers, H = spec_.num_heads;
  const size_t a = dtype_size(act_dtype_), f4 = 4;
  const size_t n = static_cast<size_t>(N_);
  auto A = MemCategory::activations;

  res_.clear();
  for (int64_t l = 0; l <= L; ++l) res_.push_back(p.add("res." + std::to_string(l), A, n * h * a));

  // Under recompute = full only the residual stream is kept per layer; one
  // set of layer buffers is rebuilt for each layer in backward.
  const int64_t kept = recompute_ == Recompute::full ? 1 : L;
  layer_acts_.clear();
  if (recompute_ == Recompute::attention) {
    att_shared_ = p.add("att.shared", A, n * qd * a);
    stats_shared_ = p.add("att_stats.shared", A, static_cast<size_t>(B_ * H * S_) * f4);
  }
  for (int64_t l = 0; l < kept; ++l) {
    std::string s = recompute_ == Recompute::full ? "shared" : std::to_string(l);
    LayerActs x{};
    x.ln1 = p.add("ln1." + s, A, n * h * a);
    x.rstd1 = p.add("rstd1." + s, A, n * f4);
    x.q = p.add("q." + s, A, n * qd * a);
    x.k = p.add("k." + s, A, n * kvd * a);
    x.v = p.add("v." + s, A, n * kvd * a);
    if (recompute_ == Recompute::attention) {
      x.att = att_shared_;
      x.stats = stats_shared_;
    } else {
      x.att = p.add("att." + s, A, n * qd * a);
      x.stats = p.add("att_stats." + s, A, static_cast<size_t>(B_ * H * S_) * f4);
    }
    x.res_mid = p.add("res_mid." + s, A, n * h * a);
    x.ln2 = p.add("ln2." + s, A, n * h * a);
    x.rstd2 = p.add("rstd2." + s, A, n * f4);
    x.gate = p.add("gate." + s, A, n * f * a);
    x.up = p.add("up." + s, A, n * f * a);
    x.swi = p.add("swi." + s, A, n * f * a);
    layer_acts_.push_back(x);
  }
  lnf_ = p.add("ln_f", A, n * h * a);
  rstdf_ = p.add("rstd_f", A, n * f4);
  logits_ = p.add("logits", A, n * V * a);
  losses_blk_ = p.add("losses", A, n * f4);
  inputs_blk_ = p.add("inputs", A, n * 4);
  targets_blk_ = p.add("targets", A, n * 4);

  // Gradient scratch, shared by all layers.
  d_res_ = p.add("d_res", A, n * h * a);
  d_ln_ = p.add("d_ln", A, n * h * a);
  d_ln_tmp_ = p.add("d_ln_tmp", A, n * h * a);
  d_q_ = p.add("d_q", A, n * qd * a);
  d_k_ = p.add("d_k", A, n * kvd * a);
  d_v_ = p.add("d_v", A, n * kvd * a);
  d_att_ = p.add("d_att", A, n * qd * a);
  d_gate_ = p.add("d_gate", A, n * f * a);
  d_up_ = p.add("d_up", A, n * f * a);
  d_swi_ = p.add("d_swi", A, n * f * a);

  attn_ws_bytes_ = attention_.workspace_bytes(attention_shape(), act_dtype_, backend_.device());
  attn_ws_ = p.add("attention.workspace", MemCategory::workspace, attn_ws_bytes_);

  // Every GEMM of the model, registered once so the recipe can cache per-shape state.
  linears_.clear();
  auto reg = [&](const std::string& name, int64_t in, int64_t out) {
    return precision_.register_linear(LinearDesc{name, in, out, N_});
  };
  for (int64_t l = 0; l < L; ++l) {
    std::string s = "layer." + std::to_string(l) + ".";
    linears_.push_back(LayerLinears{reg(s + "q_proj", h, qd), reg(s + "k_proj", h, kvd), reg(s + "v_proj", h, kvd),
                                    reg(s + "o_proj", qd, h), reg(s + "gate_proj", h, f), reg(s + "up_proj", h, f),
                                    reg(s + "down_proj", f, h)});
  }
  lm_head_linear_ = reg("lm_head", h, V);
}

void LlamaModel::bind(const Arena& arena) {
  arena_ = &arena;
  backend_.prepare_rope(S_, spec_.head_dim(), spec_.rope_theta);
  inputs_ = arena.tensor(inputs_blk_, DType::i32, {B_, S_});
  targets_ = arena.tensor(targets_blk_, DType::i32, {B_, S_});
  losses_ = arena.tensor(losses_blk_, DType::f32, {N_});
}

const LlamaModel::LayerActs& LlamaModel::acts_for(int64_t layer) const {
  return layer_acts_[recompute_ == Recompute::full ? 0 : static_cast<size_t>(layer)];
}

Tensor LlamaModel::param(std::vector<UnitState>& units, int unit, int index, bool grad) const {
  const UnitState& u = units[static_cast<size_t>(unit)];
  const ParamInfo& p = u.info->params[static_cast<size_t>(index)];
  const Tensor& flat = grad ? u.grads : u.params;
  if (p.shape.size() == 1) return view(flat, p.offset, {p.shape[0]});
  return view(flat, p.offset, {p.shape[0], p.shape[1]});
}

void LlamaModel::forward_unit(int unit, std::vector<UnitState>& units, bool training, float dloss_scale) {
  const int64_t h = spec_.hidden, L = spec_.num_layers, V = spec_.vocab_size;
  Range unit_range(backend_, unit == 0 ? "forward.embedding" : unit <= L ? "forward.layer" : "forward.head");
  if (unit == 0) {
    Tensor x0 = act(res_[0], {N_, h});
    backend_.embedding_forward(x0, inputs_, param(units, 0, 0, false));
    return;
  }
  if (unit <= L) {
    layer_forward(unit - 1, units, training);
    return;
  }
  // Head: final norm, lm head (the embedding matrix when tied), fused cross-entropy.
  const int head = unit;
  Tensor xL = act(res_[static_cast<size_t>(L)], {N_, h});
  Tensor lnf = act(lnf_, {N_, h});
  Tensor rstd = f32(rstdf_, {N_});
  backend_.rmsnorm_forward(lnf, rstd, xL, param(units, head, kNormF, false), static_cast<float>(spec_.norm_eps));
  Tensor wlm = spec_.tied_embeddings ? param(units, 0, 0, false) : param(units, head, kLmHead, false);
  Tensor logits = act(logits_, {N_, V});
  precision_.linear_forward(backend_.ctx(), lm_head_linear_, lnf, wlm, logits);
  Tensor tg = targets_;
  tg.ndim = 1;
  tg.shape[0] = N_;
  tg.set_contiguous();
  backend_.cross_entropy(logits, tg, losses_, training ? dloss_scale : 0.f);
}

void LlamaModel::attention_forward(int64_t l) {
  const LayerActs& a = acts_for(l);
  const int64_t H = spec_.num_heads, Hkv = spec_.num_kv_heads, D = spec_.head_dim();
  Tensor q = act(a.q, {B_, S_, H, D}), k = act(a.k, {B_, S_, Hkv, D}), v = act(a.v, {B_, S_, Hkv, D});
  Tensor out = act(a.att, {B_, S_, H, D});
  Tensor stats = f32(a.stats, {B_, H, S_});
  attention_.forward(backend_.ctx(), attention_shape(), q, k, v, out, stats, arena_->ptr(attn_ws_));
}

void LlamaModel::layer_forward(int64_t l, std::vector<UnitState>& units, bool /*training*/) {
  const int64_t h = spec_.hidden, qd = spec_.q_dim(), kvd = spec_.kv_dim(), f = spec_.ffn_hidden;
  const int64_t H = spec_.num_heads, Hkv = spec_.num_kv_heads, D = spec_.head_dim();
  const int u = static_cast<int>(l) + 1;
  const LayerActs& a = acts_for(l);
  const LayerLinears& lin = linears_[static_cast<size_t>(l)];
  const ExecContext& ctx = backend_.ctx();
  const float eps = static_cast<float>(spec_.norm_eps);

  Tensor x = act(res_[static_cast<size_t>(l)], {N_, h});
  Tensor ln1 = act(a.ln1, {N_, h});
  Tensor rstd1 = f32(a.rstd1, {N_});
  {
    Range r(backend_, "rmsnorm");
    backend_.rmsnorm_forward(ln1, rstd1, x, param(units, u, kLn1, false), eps);
  }
  Tensor q = act(a.q, {N_, qd}), k = act(a.k, {N_, kvd}), v = act(a.v, {N_, kvd});
  {
    Range r(backend_, "qkv");
    precision_.linear_forward(ctx, lin.q, ln1, param(units, u, kWq, false), q);
    precision_.linear_forward(ctx, lin.k, ln1, param(units, u, kWk, false), k);
    precision_.linear_forward(ctx, lin.v, ln1, param(units, u, kWv, false), v);
  }
  Tensor q4 = act(a.q, {B_, S_, H, D}), k4 = act(a.k, {B_, S_, Hkv, D});
  {
    Range r(backend_, "rope");
    backend_.rope_forward(q4, spec_.rope_theta);
    backend_.rope_forward(k4, spec_.rope_theta);
  }
  {
    Range r(backend_, "attention");
    attention_forward(l);
  }

  Tensor att = act(a.att, {N_, qd});
  Tensor tmp = act(d_ln_tmp_, {N_, h});  // scratch: no backward is running during forward
  Tensor mid = act(a.res_mid, {N_, h});
  {
    Range r(backend_, "o_proj+residual");
    precision_.linear_forward(ctx, lin.o, att, param(units, u, kWo, false), tmp);
    backend_.add(mid, x, tmp);
  }
  Tensor ln2 = act(a.ln2, {N_, h});
  Tensor rstd2 = f32(a.rstd2, {N_});
  Tensor gate = act(a.gate, {N_, f}), up = act(a.up, {N_, f}), swi = act(a.swi, {N_, f});
  {
    Range r(backend_, "rmsnorm");
    backend_.rmsnorm_forward(ln2, rstd2, mid, param(units, u, kLn2, false), eps);
  }
  {
    Range r(backend_, "gate_up");
    precision_.linear_forward(ctx, lin.gate, ln2, param(units, u, kWgate, false), gate);
    precision_.linear_forward(ctx, lin.up, ln2, param(units, u, kWup, false), up);
  }
  {
    Range r(backend_, "swiglu");
    backend_.swiglu_forward(swi, gate, up);
  }
  Tensor out = act(res_[static_cast<size_t>(l + 1)], {N_, h});
  {
    Range r(backend_, "down+residual");
    precision_.linear_forward(ctx, lin.down, swi, param(units, u, kWdown, false), tmp);
    backend_.add(out, mid, tmp);
  }
}

void LlamaModel::backward_unit(int unit, std::vector<UnitState>& units) {
  const int64_t h = spec_.hidden, L = spec_.num_layers, V = spec_.vocab_size;
  Range unit_range(backend_, unit == 0 ? "backward.embedding" : unit <= L ? "backward.layer" : "backward.head");
  const ExecContext& ctx = backend_.ctx();
  Tensor d_res = act(d_res_, {N_, h});
  if (unit == 0) {
    Tensor dwte = param(units, 0, 0, true);
    backend_.embedding_backward(dwte, d_res, inputs_);
    return;
  }
  if (unit <= L) {
    layer_backward(unit - 1, units);
    return;
  }
  const int head = unit;
  Tensor lnf = act(lnf_, {N_, h});
  Tensor dlogits = act(logits_, {N_, V});  // cross_entropy wrote the gradient over the logits
  Tensor wlm = spec_.tied_embeddings ? param(units, 0, 0, false) : param(units, head, kLmHead, false);
  Tensor dwlm = spec_.tied_embeddings ? param(units, 0, 0, true) : param(units, head, kLmHead, true);
  Tensor d_ln = act(d_ln_, {N_, h});
  precision_.linear_backward(ctx, lm_head_linear_, lnf, wlm, dlogits, &d_ln, dwlm, true);
  backend_.zero(d_res);
  Tensor dnorm = param(units, head, kNormF, true);
  backend_.rmsnorm_backward(d_res, dnorm, d_ln, act(res_[static_cast<size_t>(L)], {N_, h}),
                            param(units, head, kNormF, false), f32(rstdf_, {N_}));
}

void LlamaModel::layer_backward(int64_t l, std::vector<UnitState>& units) {
  const int64_t h = spec_.hidden, qd = spec_.q_dim(), kvd = spec_.kv_dim(), f = spec_.ffn_hidden;
  const int64_t H = spec_.num_heads, Hkv = spec_.num_kv_heads, D = spec_.head_dim();
  const int u = static_cast<int>(l) + 1;
  const LayerActs& a = acts_for(l);
  const LayerLinears& lin = linears_[static_cast<size_t>(l)];
  const ExecContext& ctx = backend_.ctx();

  // Rebuild what was not kept: the whole layer, or only its attention output.
  if (recompute_ == Recompute::full) layer_forward(l, units, true);
  else if (recompute_ == Recompute::attention) attention_forward(l);

  Tensor d_res = act(d_res_, {N_, h});
  Tensor d_ln = act(d_ln_, {N_, h}), d_tmp = act(d_ln_tmp_, {N_, h});

  // MLP: x'' = x' + down(silu(gate(h2)) * up(h2))
  Tensor d_swi = act(d_swi_, {N_, f}), d_gate = act(d_gate_, {N_, f}), d_up = act(d_up_, {N_, f});
  Tensor dWd = param(units, u, kWdown, true);
  precision_.linear_backward(ctx, lin.down, act(a.swi, {N_, f}), param(units, u, kWdown, false), d_res, &d_swi, dWd,
                             true);
  backend_.swiglu_backward(d_gate, d_up, d_swi, act(a.gate, {N_, f}), act(a.up, {N_, f}));
  Tensor ln2 = act(a.ln2, {N_, h});
  Tensor dWg = param(units, u, kWgate, true), dWu = param(units, u, kWup, true);
  precision_.linear_backward(ctx, lin.gate, ln2, param(units, u, kWgate, false), d_gate, &d_ln, dWg, true);
  precision_.linear_backward(ctx, lin.up, ln2, param(units, u, kWup, false), d_up, &d_tmp, dWu, true);
  backend_.accumulate(d_ln, d_tmp);
  Tensor dln2 = param(units, u, kLn2, true);
  backend_.rmsnorm_backward(d_res, dln2, d_ln, act(a.res_mid, {N_, h}), param(units, u, kLn2, false),
                            f32(a.rstd2, {N_}));
  // d_res now holds dL/dx' (residual path + norm path).

  // Attention: x' = x + o(attn(rope(q(h1)), rope(k(h1)), v(h1)))
  Tensor d_att = act(d_att_, {N_, qd});
  Tensor dWo = param(units, u, kWo, true);
  precision_.linear_backward(ctx, lin.o, act(a.att, {N_, qd}), param(units, u, kWo, false), d_res, &d_att, dWo, true);
  Tensor q = act(a.q, {B_, S_, H, D}), k = act(a.k, {B_, S_, Hkv, D}), v = act(a.v, {B_, S_, Hkv, D});
  Tensor out = act(a.att, {B_, S_, H, D}), dout = act(d_att_, {B_, S_, H, D});
  Tensor dq = act(d_q_, {B_, S_, H, D}), dk = act(d_k_, {B_, S_, Hkv, D}), dv = act(d_v_, {B_, S_, Hkv, D});
  attention_.backward(ctx, attention_shape(), q, k, v, out, dout, f32(a.stats, {B_, H, S_}), dq, dk, dv,
                      arena_->ptr(attn_ws_));
  backend_.rope_backward(dq, spec_.rope_theta);
  backend_.rope_backward(dk, spec_.rope_theta);
  Tensor ln1 = act(a.ln1, {N_, h});
  Tensor dWq = param(units, u, kWq, true), dWk = param(units, u, kWk, true), dWv = param(units, u, kWv, true);
  precision_.linear_backward(ctx, lin.q, ln1, param(units, u, kWq, false), act(d_q_, {N_, qd}), &d_ln, dWq, true);
  precision_.linear_backward(ctx, lin.k, ln1, param(units, u, kWk, false), act(d_k_, {N_, kvd}), &d_tmp, dWk, true);
  backend_.accumulate(d_ln, d_tmp);
  precision_.linear_backward(ctx, lin.v, ln1, param(units, u, kWv, false), act(d_v_, {N_, kvd}), &d_tmp, dWv, true);
  backend_.accumulate(d_ln, d_tmp);
  Tensor dln1 = param(units, u, kLn1, true);
  backend_.rmsnorm_backward(d_res, dln1, d_ln, act(res_[static_cast<size_t>(l)], {N_, h}),
                            param(units, u, kLn1, false), f32(a.rstd1, {N_}));
  // d_res now holds dL/dx for the layer below.
}

}  // namespace loom
