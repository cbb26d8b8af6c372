// The native attention block (HF's LlamaAttention, one kernel per op):
//
//   h = rmsnorm(x) ; q, k, v = h Wq^T, h Wk^T, h Wv^T  (three GEMMs)
//   rope(q), rope(k) ; a = attention(q, k, v) ; out = x + a Wo^T  (GEMM, then an add)
//
// model.recompute = "selective": h = rmsnorm(x) is computed again just before
// the q, k and v wgrads instead of being kept (attention_fused.cpp says why
// RoPE is not).
#include "loom/block.hpp"
#include "loom/error.hpp"

namespace loom {
namespace {

class NativeAttention final : public AttentionBlock {
 public:
  NativeAttention(const ModelSpec& spec, int64_t layer) : AttentionBlock(spec, layer) {}
  const char* kind() const override { return "attention.native"; }

  void plan(const BlockEnv& env, ActivationPlan& a) override {
    env_ = env;
    const int64_t h = spec_.hidden, qd = spec_.q_dim(), kvd = spec_.kv_dim(), l = layer_;
    const size_t n = static_cast<size_t>(env.N), e = dtype_size(env.act);
    const size_t stats = static_cast<size_t>(env.B * spec_.num_heads * env.S) * 4;
    const bool full = env.recompute == Recompute::full;
    const std::string s = "layer." + std::to_string(l) + ".";
    wq_ = register_weight_linear(env, env.layer_linear(s + "q_proj", h, qd), kWq);
    wk_ = register_weight_linear(env, env.layer_linear(s + "k_proj", h, kvd), kWk);
    wv_ = register_weight_linear(env, env.layer_linear(s + "v_proj", h, kvd), kWv);
    wo_ = register_weight_linear(env, env.layer_linear(s + "o_proj", qd, h), kWo);
    // The norm output is read by q, k and v (forward) and their wgrad only:
    // a transient when the recipe keeps its own copy for the wgrad, or when
    // it is recomputed for it (selective).
    ln1_plan_ = env.input_plan({wq_, wk_, wv_});
    ln1_ = ln1_plan_.transient() ? a.transient_input(n * h * e) : a.kept("ln1", l, n * h * e, full);
    rstd1_ = a.kept("rstd1", l, n * 4, full);
    q_ = a.kept("q", l, n * qd * e, full);
    k_ = a.kept("k", l, n * kvd * e, full);
    v_ = a.kept("v", l, n * kvd * e, full);
    if (env.recompute == Recompute::attention) {  // one attention output, rebuilt in backward
      att_ = a.shared("att.shared", n * qd * e);
      stats_ = a.shared("att_stats.shared", stats);
    } else {
      att_ = a.kept("att", l, n * qd * e, full);
      stats_ = a.kept("att_stats", l, stats, full);
    }
    // o_proj's output before the residual add; the same buffer serves as a
    // gradient scratch in backward (never both at once).
    tmp_ = a.shared("scratch.h", n * h * e);
    d_ln_ = a.shared("grad.ln", n * h * e);
    d_tmp_ = tmp_;
    d_q_ = a.shared("grad.q", n * qd * e);
    d_k_ = a.shared("grad.k", n * kvd * e);
    d_v_ = a.shared("grad.v", n * kvd * e);
    d_att_ = a.shared("grad.att", n * qd * e);
    ws_ = a.shared("attention.workspace",
                   env.attention->workspace_bytes(env.attention_shape(), env.act, env.backend->device()));
  }

  void forward(const UnitState& u, const Tensor& x, Tensor& out) override {
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, qd = spec_.q_dim(), kvd = spec_.kv_dim();
    Tensor ln1 = act(ln1_, {N, h}), rstd1 = f32(rstd1_, {N});
    {
      Range r(be, "rmsnorm");
      be.rmsnorm_forward(ln1, rstd1, x, param(u, kLn1), static_cast<float>(spec_.norm_eps));
    }
    Tensor q = act(q_, {N, qd}), k = act(k_, {N, kvd}), v = act(v_, {N, kvd});
    {
      Range r(be, "qkv");
      env_.precision->linear_forward(ctx, wq_, ln1, param(u, kWq), q, nullptr);
      env_.precision->linear_forward(ctx, wk_, ln1, param(u, kWk), k, nullptr);
      env_.precision->linear_forward(ctx, wv_, ln1, param(u, kWv), v, nullptr);
    }
    {
      Range r(be, "rope");
      Tensor q4 = heads(q_, spec_.num_heads), k4 = heads(k_, spec_.num_kv_heads);
      env_.rope(q4, spec_.rope_theta, false);
      env_.rope(k4, spec_.rope_theta, false);
    }
    {
      Range r(be, "attention");
      attention_forward();
    }
    Tensor tmp = act(tmp_, {N, h});
    {
      Range r(be, "o_proj+residual");
      env_.precision->linear_forward(ctx, wo_, act(att_, {N, qd}), param(u, kWo), tmp, nullptr);
      be.add(out, x, tmp);
    }
  }

  void backward(UnitState& u, const Tensor& x, Tensor& d) override {
    const bool acc = !env_.writes_grads();  // false: this micro-batch writes the weight gradients
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, qd = spec_.q_dim(), kvd = spec_.kv_dim();
    const int64_t H = spec_.num_heads, Hkv = spec_.num_kv_heads;
    if (env_.recompute == Recompute::attention) {
      Range r(be, "attention.recompute");
      attention_forward();
    }
    Tensor d_att = act(d_att_, {N, qd});
    {
      Range r(be, "o_proj.grad");
      Tensor dWo = param(u, kWo, true);
      env_.precision->linear_backward(ctx, wo_, act(att_, {N, qd}), param(u, kWo), d, &d_att, dWo, acc);
    }
    Tensor dq = heads(d_q_, H), dk = heads(d_k_, Hkv), dv = heads(d_v_, Hkv);
    {
      Range r(be, "attention.grad");
      env_.attention->backward(ctx, env_.attention_shape(), heads(q_, H), heads(k_, Hkv), heads(v_, Hkv),
                               heads(att_, H), heads(d_att_, H), f32(stats_, {env_.B, H, env_.S}), dq, dk, dv, buf(ws_));
    }
    {
      Range r(be, "rope.grad");
      env_.rope(dq, spec_.rope_theta, true);
      env_.rope(dk, spec_.rope_theta, true);
    }
    // Not kept when the recipe keeps its own copy for the wgrad: then empty.
    Tensor ln1 = ln1_plan_.kept_by_recipe ? Tensor() : act(ln1_, {N, h});
    if (ln1_plan_.recomputed) {
      Range r(be, "rmsnorm.recompute");
      Tensor rstd1 = f32(rstd1_, {N});  // rewritten with the values it holds
      be.rmsnorm_forward(ln1, rstd1, x, param(u, kLn1), static_cast<float>(spec_.norm_eps));
    }
    Tensor d_ln = act(d_ln_, {N, h}), d_tmp = act(d_tmp_, {N, h});
    {
      Range r(be, "qkv.grad");
      Tensor dWq = param(u, kWq, true), dWk = param(u, kWk, true), dWv = param(u, kWv, true);
      env_.precision->linear_backward(ctx, wq_, ln1, param(u, kWq), act(d_q_, {N, qd}), &d_ln, dWq, acc);
      env_.precision->linear_backward(ctx, wk_, ln1, param(u, kWk), act(d_k_, {N, kvd}), &d_tmp, dWk, acc);
      be.accumulate(d_ln, d_tmp);
      env_.precision->linear_backward(ctx, wv_, ln1, param(u, kWv), act(d_v_, {N, kvd}), &d_tmp, dWv, acc);
      be.accumulate(d_ln, d_tmp);
    }
    {
      Range r(be, "rmsnorm.grad");
      Tensor dln1 = param(u, kLn1, true);
      if (!acc) be.zero(dln1);  // the first micro-batch writes (BlockEnv::first_micro)
      be.rmsnorm_backward(d, dln1, d_ln, x, param(u, kLn1), f32(rstd1_, {N}));
    }
  }

 private:
  Tensor heads(int id, int64_t nh) const { return act(id, {env_.B, env_.S, nh, spec_.head_dim()}); }

  void attention_forward() {
    const int64_t H = spec_.num_heads, Hkv = spec_.num_kv_heads;
    Tensor out = heads(att_, H), stats = f32(stats_, {env_.B, H, env_.S});
    env_.attention->forward(env_.backend->ctx(), env_.attention_shape(), heads(q_, H), heads(k_, Hkv),
                            heads(v_, Hkv), out, stats, buf(ws_));
  }

  int ln1_ = -1, rstd1_ = -1, q_ = -1, k_ = -1, v_ = -1, att_ = -1, stats_ = -1, tmp_ = -1;
  int d_ln_ = -1, d_tmp_ = -1, d_q_ = -1, d_k_ = -1, d_v_ = -1, d_att_ = -1, ws_ = -1;
  int wq_ = -1, wk_ = -1, wv_ = -1, wo_ = -1;
  BlockEnv::InputPlan ln1_plan_;
};

}  // namespace

extern const AttentionVariant attention_native;  // blocks/block_table.cpp's table lists it
const AttentionVariant attention_native{
    "native",
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<AttentionBlock> {
      return std::make_unique<NativeAttention>(spec, layer);
    },
    AttentionBlock::hf_floor,
    /*chunked_head=*/false,  // HF's materialised logits: the whole micro-batch's at once
};

}  // namespace loom
