// The fused feed-forward block (TransformerEngine's LayerNormMLP). Same
// parameters, names and layout as the native block:
//
//   h = rmsnorm(x)                the norm writes the GEMM's input dtype
//   gu = h [Wg; Wu]^T             one GEMM over the contiguous [gate; up] weight: [N, 2f]
//   m = silu(gu[:, :f]) * gu[:, f:]   SwiGLU reads the two halves of the packed output
//   out = x + m Wd^T              the residual is the GEMM's C input (beta = 1)
//
// Backward: SwiGLU writes its gradient into one packed [N, 2f] buffer, so one
// dgrad GEMM (K = 2f) and one wgrad GEMM (into the [gate; up] gradient)
// replace two of each and the add between them.
//
// When the recipe takes them in FP8 (Precision::fp8_operand: fp8_delayed on
// CUDA), the norm writes h (the gate_up projection's x), SwiGLU m (the down
// projection's x) and its packed gradient (the gate_up projection's dy) as
// FP8 codes directly, and the bf16 copies that the recipe would read only to
// cast them are never written. When the recipe measures each tensor before
// casting it (Fp8OperandAmax: fp8_current), the same three kernels write bf16
// and measure its amax for the recipe, which then casts without reading the
// tensor a first time. Under selective recompute the backward's norm and
// SwiGLU, which compute h and m again for the wgrads, write those wgrads' xᵀ
// in FP8 where the recipe offers it (Fp8RecastOperand), with the forward's
// scale: no bf16 copy is written and read again to be cast.
//
// model.recompute = "selective" keeps the gate_up GEMM's output (SwiGLU's
// backward reads it) and computes h = rmsnorm(x) and m = SwiGLU(gu) again
// just before the gate_up and down wgrads instead of keeping them: two
// element-wise passes for 2h + f values a token, 11 GiB of an 8B model's 8k
// micro-batch.
#include "loom/block.hpp"
#include "loom/error.hpp"

namespace loom {
namespace {

class FusedFfn final : public FfnBlock {
 public:
  FusedFfn(const ModelSpec& spec, int64_t layer) : FfnBlock(spec, layer) {}
  const char* kind() const override { return "ffn.fused"; }

  void plan(const BlockEnv& env, ActivationPlan& a) override {
    env_ = env;
    const int64_t h = spec_.hidden, f = spec_.ffn_hidden, l = layer_;
    const size_t n = static_cast<size_t>(env.N), e = dtype_size(env.act);
    const bool full = env.recompute == Recompute::full;
    const std::string s = "layer." + std::to_string(l) + ".";
    wgu_ = register_weight_linear(env, env.layer_linear(s + "gate_up_proj", h, 2 * f), kWgate, 2);
    wd_ = register_weight_linear(env, env.layer_linear(s + "down_proj", f, h), kWdown);
    // The norm output (read by gate_up's GEMM and wgrad) and the SwiGLU
    // output (down's) are transients when the recipe keeps its own copies for
    // the wgrad, or when they are recomputed for it (selective); SwiGLU's
    // backward reads gate_up, the norm's its input and rstd.
    ln2_plan_ = env.input_plan({wgu_});
    swi_plan_ = env.input_plan({wd_});
    ln2_ = ln2_plan_.transient() ? a.transient_input(n * h * e) : a.kept("ln2", l, n * h * e, full);
    rstd2_ = a.kept("rstd2", l, n * 4, full);
    gu_ = a.kept("gate_up", l, n * 2 * f * e, full);
    swi_ = swi_plan_.transient() ? a.transient_input(n * f * e) : a.kept("swi", l, n * f * e, full);
    d_ln_ = a.shared("grad.ln", n * h * e);
    d_gu_ = a.shared("grad.gate_up", n * 2 * f * e);
    d_swi_ = a.shared("grad.swi", n * f * e);
  }

  void forward(const UnitState& u, const Tensor& x, Tensor& out) override {
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, f = spec_.ffn_hidden;
    Tensor ln2, rstd2 = f32(rstd2_, {N});
    {
      Range r(be, "rmsnorm");
      ln2 = rmsnorm_for(wgu_, ln2_plan_.kept_by_recipe, act(ln2_, {N, h}), rstd2, x, param(u, kLn2),
                        static_cast<float>(spec_.norm_eps));
    }
    {
      Range r(be, "gate_up");
      Tensor gu = act(gu_, {N, 2 * f});
      env_.precision->linear_forward(ctx, wgu_, ln2, param_rows(u, kWgate, 2), gu, nullptr);
    }
    Fp8Operand q;
    const bool fp8_swi = fp8_input(wd_, swi_plan_.kept_by_recipe, &q);
    Tensor swi = fp8_swi ? q.q : act(swi_, {N, f});
    {
      Range r(be, "swiglu");
      const Tensor gu = act(gu_, {N, 2 * f});
      if (fp8_swi) be.swiglu_forward_fp8(q, column_half(gu, 0), column_half(gu, 1));
      else if (float* amax = operand_amax(wd_, Fp8OperandRole::x))
        be.swiglu_forward_amax(swi, column_half(gu, 0), column_half(gu, 1), amax);
      else be.swiglu_forward(swi, column_half(gu, 0), column_half(gu, 1));
    }
    {
      Range r(be, "down+residual");
      env_.precision->linear_forward(ctx, wd_, swi, param(u, kWdown), out, &x);
    }
  }

  void backward(UnitState& u, const Tensor& x, Tensor& d) override {
    const bool acc = !env_.writes_grads();  // false: this micro-batch writes the weight gradients
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, f = spec_.ffn_hidden;
    Tensor d_swi = act(d_swi_, {N, f});
    {
      Range r(be, "down.grad");
      Tensor dWd = param(u, kWdown, true);
      Tensor swi = swi_plan_.kept_by_recipe ? Tensor() : act(swi_, {N, f});
      if (swi_plan_.recomputed) {
        Range rr(be, "swiglu.recompute");
        const Tensor gu = act(gu_, {N, 2 * f});
        Fp8Operand q;
        if (recast_input(wd_, &q)) {  // the down wgrad's xᵀ in FP8, no bf16 SwiGLU output
          be.swiglu_forward_fp8(q, column_half(gu, 0), column_half(gu, 1));
          swi = q.q_t;
        } else {
          be.swiglu_forward(swi, column_half(gu, 0), column_half(gu, 1));
        }
      }
      env_.precision->linear_backward(ctx, wd_, swi, param(u, kWdown), d, &d_swi, dWd, acc);
    }
    Fp8Operand q;
    const bool fp8_dgu = env_.precision->fp8_operand(ctx, wgu_, Fp8OperandRole::dy, N, &q);
    const Tensor d_gu = fp8_dgu ? q.q : act(d_gu_, {N, 2 * f});
    {
      Range r(be, "swiglu.grad");
      const Tensor gu = act(gu_, {N, 2 * f});
      if (fp8_dgu) {
        be.swiglu_backward_fp8(q, d_swi, column_half(gu, 0), column_half(gu, 1));
      } else {
        Tensor dg = column_half(d_gu, 0), du = column_half(d_gu, 1);
        if (float* amax = operand_amax(wgu_, Fp8OperandRole::dy))
          be.swiglu_backward_amax(dg, du, d_swi, column_half(gu, 0), column_half(gu, 1), amax);
        else
          be.swiglu_backward(dg, du, d_swi, column_half(gu, 0), column_half(gu, 1));
      }
    }
    Tensor d_ln = act(d_ln_, {N, h});
    {
      Range r(be, "gate_up.grad");
      Tensor dWgu = param_rows(u, kWgate, 2, true);
      Tensor ln2 = ln2_plan_.kept_by_recipe ? Tensor() : act(ln2_, {N, h});
      if (ln2_plan_.recomputed) {
        Range rr(be, "rmsnorm.recompute");
        Tensor rstd2 = f32(rstd2_, {N});
        ln2 = recompute_rmsnorm_for(wgu_, ln2, rstd2, x, param(u, kLn2), static_cast<float>(spec_.norm_eps));
      }
      env_.precision->linear_backward(ctx, wgu_, ln2, param_rows(u, kWgate, 2), d_gu, &d_ln, dWgu, acc);
    }
    {
      Range r(be, "rmsnorm.grad");
      Tensor dln2 = param(u, kLn2, true);
      if (!acc) be.zero(dln2);  // the first micro-batch writes (BlockEnv::first_micro)
      be.rmsnorm_backward(d, dln2, d_ln, x, param(u, kLn2), f32(rstd2_, {N}));
    }
  }

 private:
  int ln2_ = -1, rstd2_ = -1, gu_ = -1, swi_ = -1;
  int d_ln_ = -1, d_gu_ = -1, d_swi_ = -1;
  int wgu_ = -1, wd_ = -1;
  BlockEnv::InputPlan ln2_plan_, swi_plan_;
};

}  // namespace

extern const FfnVariant ffn_fused;  // blocks/block_table.cpp's table lists it
const FfnVariant ffn_fused{
    "fused",
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<FfnBlock> {
      return std::make_unique<FusedFfn>(spec, layer);
    },
    FfnBlock::hf_floor,
};

}  // namespace loom
