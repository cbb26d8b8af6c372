// The fused attention block (TransformerEngine's TransformerLayer, attention
// half). Same parameters, names and layout as the native block; fewer kernels
// and passes over memory:
//
//   h = rmsnorm(x)                       the norm writes the GEMM's input dtype
//   qkv = h [Wq; Wk; Wv]^T               one GEMM over the contiguous [q; k; v] weight
//   rope(qkv[:, q and k heads])          one launch over a strided view, in place
//   a = attention(q, k, v views of qkv)  no copies: the kernel reads strides
//   out = x + a Wo^T                     the residual is the GEMM's C input (beta = 1)
//
// When the recipe takes the qkv GEMM's input in FP8 (Precision::fp8_operand:
// fp8_delayed on CUDA), the norm writes its FP8 codes directly: the cast to
// the GEMM's input type is the norm's own store. When the recipe measures
// its input first (Fp8OperandAmax: fp8_current), the norm measures it as it
// writes it. Under selective recompute the backward's norm writes the qkv
// wgrad's xᵀ in FP8 where the recipe offers it (Fp8RecastOperand).
//
// Backward mirrors it: attention writes dq/dk/dv as views of one packed
// gradient buffer, RoPE's inverse runs once over dq and dk, one dgrad GEMM
// (K = (H + 2 Hkv) D) gives the norm's input gradient and one wgrad GEMM the
// whole [q; k; v] weight gradient.
//
// model.recompute = "selective" keeps qkv (after RoPE, which attention's
// backward reads) and the attention output, and computes h = rmsnorm(x)
// again just before the qkv wgrad instead of keeping it (x and rstd are kept).
// RoPE is not recomputed: it rotates qkv in place, so the rotated q and k are
// what is kept, and an unrotated copy would cost as much as it saves.
#include "loom/block.hpp"
#include "loom/error.hpp"

namespace loom {
namespace {

class FusedAttention final : public AttentionBlock {
 public:
  FusedAttention(const ModelSpec& spec, int64_t layer) : AttentionBlock(spec, layer) {}
  const char* kind() const override { return "attention.fused"; }

  void plan(const BlockEnv& env, ActivationPlan& a) override {
    env_ = env;
    const int64_t h = spec_.hidden, qd = spec_.q_dim(), l = layer_;
    const size_t n = static_cast<size_t>(env.N), e = dtype_size(env.act);
    const size_t stats = static_cast<size_t>(env.B * spec_.num_heads * env.S) * 4;
    const bool full = env.recompute == Recompute::full;
    const std::string s = "layer." + std::to_string(l) + ".";
    wqkv_ = register_weight_linear(env, env.layer_linear(s + "qkv_proj", h, width()), kWq, 3);
    wo_ = register_weight_linear(env, env.layer_linear(s + "o_proj", qd, h), kWo);
    // The norm output is read by the qkv GEMM and its wgrad only: a transient
    // when the recipe keeps its own copy for the wgrad, or when it is
    // recomputed for the wgrad (selective).
    ln1_plan_ = env.input_plan({wqkv_});
    ln1_ = ln1_plan_.transient() ? a.transient_input(n * h * e) : a.kept("ln1", l, n * h * e, full);
    rstd1_ = a.kept("rstd1", l, n * 4, full);
    qkv_ = a.kept("qkv", l, n * width() * e, full);
    if (env.recompute == Recompute::attention) {
      att_ = a.shared("att.shared", n * qd * e);
      stats_ = a.shared("att_stats.shared", stats);
    } else {
      att_ = a.kept("att", l, n * qd * e, full);
      stats_ = a.kept("att_stats", l, stats, full);
    }
    d_ln_ = a.shared("grad.ln", n * h * e);
    d_qkv_ = a.shared("grad.qkv", n * width() * e);
    d_att_ = a.shared("grad.att", n * qd * e);
    ws_ = a.shared("attention.workspace",
                   env.attention->workspace_bytes(env.attention_shape(), env.act, env.backend->device()));
  }

  void forward(const UnitState& u, const Tensor& x, Tensor& out) override {
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, qd = spec_.q_dim();
    Tensor ln1, rstd1 = f32(rstd1_, {N});
    {
      Range r(be, "rmsnorm");
      ln1 = rmsnorm_for(wqkv_, ln1_plan_.kept_by_recipe, act(ln1_, {N, h}), rstd1, x, param(u, kLn1),
                        static_cast<float>(spec_.norm_eps));
    }
    {
      Range r(be, "qkv");
      Tensor qkv = act(qkv_, {N, width()});
      env_.precision->linear_forward(ctx, wqkv_, ln1, param_rows(u, kWq, 3), qkv, nullptr);
    }
    {
      Range r(be, "rope");
      Tensor qk = heads_view(qkv_, 0, spec_.num_heads + spec_.num_kv_heads);
      env_.rope(qk, spec_.rope_theta, false);
    }
    {
      Range r(be, "attention");
      attention_forward();
    }
    {
      Range r(be, "o_proj+residual");
      env_.precision->linear_forward(ctx, wo_, act(att_, {N, qd}), param(u, kWo), out, &x);
    }
  }

  void backward(UnitState& u, const Tensor& x, Tensor& d) override {
    const bool acc = !env_.writes_grads();  // false: this micro-batch writes the weight gradients
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, qd = spec_.q_dim();
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
    {
      Range r(be, "attention.grad");
      Tensor dq = heads_view(d_qkv_, 0, H), dk = heads_view(d_qkv_, H, Hkv), dv = heads_view(d_qkv_, H + Hkv, Hkv);
      env_.attention->backward(ctx, env_.attention_shape(), heads_view(qkv_, 0, H), heads_view(qkv_, H, Hkv),
                               heads_view(qkv_, H + Hkv, Hkv), packed_heads(att_, H), packed_heads(d_att_, H),
                               f32(stats_, {env_.B, H, env_.S}), dq, dk, dv, buf(ws_));
    }
    {
      Range r(be, "rope.grad");
      Tensor dqk = heads_view(d_qkv_, 0, H + Hkv);
      env_.rope(dqk, spec_.rope_theta, true);
    }
    Tensor d_ln = act(d_ln_, {N, h});
    {
      Range r(be, "qkv.grad");
      Tensor dWqkv = param_rows(u, kWq, 3, true);
      Tensor ln1 = ln1_plan_.kept_by_recipe ? Tensor() : act(ln1_, {N, h});
      if (ln1_plan_.recomputed) {
        Range rr(be, "rmsnorm.recompute");
        Tensor rstd1 = f32(rstd1_, {N});
        ln1 = recompute_rmsnorm_for(wqkv_, ln1, rstd1, x, param(u, kLn1), static_cast<float>(spec_.norm_eps));
      }
      env_.precision->linear_backward(ctx, wqkv_, ln1, param_rows(u, kWq, 3),
                                      act(d_qkv_, {N, width()}), &d_ln, dWqkv, acc);
    }
    {
      Range r(be, "rmsnorm.grad");
      Tensor dln1 = param(u, kLn1, true);
      if (!acc) be.zero(dln1);  // the first micro-batch writes (BlockEnv::first_micro)
      be.rmsnorm_backward(d, dln1, d_ln, x, param(u, kLn1), f32(rstd1_, {N}));
    }
  }

 private:
  // Row width of the packed qkv buffer: H + 2 Hkv heads.
  int64_t width() const { return spec_.q_dim() + 2 * spec_.kv_dim(); }
  Tensor packed_heads(int id, int64_t nh) const { return act(id, {env_.B, env_.S, nh, spec_.head_dim()}); }
  // Heads [first, first + count) of a packed [B, S, H + 2 Hkv, D] buffer, as a strided [B, S, count, D] view.
  Tensor heads_view(int id, int64_t first, int64_t count) const {
    const int64_t D = spec_.head_dim();
    Tensor t(static_cast<char*>(buf(id)) + first * D * static_cast<int64_t>(dtype_size(env_.act)), env_.act, dev(),
             {env_.B, env_.S, count, D});
    t.stride[3] = 1;
    t.stride[2] = D;
    t.stride[1] = width();
    t.stride[0] = env_.S * width();
    return t;
  }

  void attention_forward() {
    const int64_t H = spec_.num_heads, Hkv = spec_.num_kv_heads;
    Tensor out = packed_heads(att_, H), stats = f32(stats_, {env_.B, H, env_.S});
    env_.attention->forward(env_.backend->ctx(), env_.attention_shape(), heads_view(qkv_, 0, H),
                            heads_view(qkv_, H, Hkv), heads_view(qkv_, H + Hkv, Hkv), out, stats, buf(ws_));
  }

  int ln1_ = -1, rstd1_ = -1, qkv_ = -1, att_ = -1, stats_ = -1;
  int d_ln_ = -1, d_qkv_ = -1, d_att_ = -1, ws_ = -1;
  int wqkv_ = -1, wo_ = -1;
  BlockEnv::InputPlan ln1_plan_;
};

}  // namespace

extern const AttentionVariant attention_fused;  // blocks/block_table.cpp's table lists it
const AttentionVariant attention_fused{
    "fused",
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<AttentionBlock> {
      return std::make_unique<FusedAttention>(spec, layer);
    },
    AttentionBlock::hf_floor,
    /*chunked_head=*/true,  // the [N, V] logits never exist at once (model.head_chunk)
};

}  // namespace loom
