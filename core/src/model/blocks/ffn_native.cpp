// The native feed-forward block (HF's LlamaMLP, one kernel per op):
//
//   h = rmsnorm(x) ; g, u = h Wg^T, h Wu^T  (two GEMMs)
//   m = silu(g) * u ; out = x + m Wd^T      (GEMM, then an add)
//
// model.recompute = "selective": h and m are computed again (from x and rstd,
// from g and u, which are kept) just before the wgrads that read them.
#include "loom/error.hpp"
#include "model/blocks/blocks.hpp"

namespace loom {
namespace {

class NativeFfn final : public FfnBlock {
 public:
  NativeFfn(const ModelSpec& spec, int64_t layer) : FfnBlock(spec, layer) {}
  const char* kind() const override { return "ffn.native"; }

  void plan(const BlockEnv& env, ActivationPlan& a) override {
    env_ = env;
    const int64_t h = spec_.hidden, f = spec_.ffn_hidden, l = layer_;
    const size_t n = static_cast<size_t>(env.N), e = dtype_size(env.act);
    const bool full = env.recompute == Recompute::full;
    const std::string s = "layer." + std::to_string(l) + ".";
    wg_ = register_weight_linear(env, env.layer_linear(s + "gate_proj", h, f), kWgate);
    wu_ = register_weight_linear(env, env.layer_linear(s + "up_proj", h, f), kWup);
    wd_ = register_weight_linear(env, env.layer_linear(s + "down_proj", f, h), kWdown);
    // The norm output is read by gate and up (forward and wgrad), the SwiGLU
    // output by down (the same): transients when the recipe keeps its own
    // copies for the wgrad (SwiGLU's backward reads gate and up, the norm's
    // its input and rstd).
    // (Or recomputed for the wgrad: selective.)
    ln2_plan_ = env.input_plan({wg_, wu_});
    swi_plan_ = env.input_plan({wd_});
    ln2_ = ln2_plan_.transient() ? a.transient_input(n * h * e) : a.kept("ln2", l, n * h * e, full);
    rstd2_ = a.kept("rstd2", l, n * 4, full);
    gate_ = a.kept("gate", l, n * f * e, full);
    up_ = a.kept("up", l, n * f * e, full);
    swi_ = swi_plan_.transient() ? a.transient_input(n * f * e) : a.kept("swi", l, n * f * e, full);
    tmp_ = a.shared("scratch.h", n * h * e);  // down_proj's output before the add; a gradient scratch in backward
    d_ln_ = a.shared("grad.ln", n * h * e);
    d_gate_ = a.shared("grad.gate", n * f * e);
    d_up_ = a.shared("grad.up", n * f * e);
    d_swi_ = a.shared("grad.swi", n * f * e);
  }

  void forward(const UnitState& u, const Tensor& x, Tensor& out) override {
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, f = spec_.ffn_hidden;
    Tensor ln2 = act(ln2_, {N, h}), rstd2 = f32(rstd2_, {N});
    {
      Range r(be, "rmsnorm");
      be.rmsnorm_forward(ln2, rstd2, x, param(u, kLn2), static_cast<float>(spec_.norm_eps));
    }
    Tensor gate = act(gate_, {N, f}), up = act(up_, {N, f}), swi = act(swi_, {N, f});
    {
      Range r(be, "gate_up");
      env_.precision->linear_forward(ctx, wg_, ln2, param(u, kWgate), gate, nullptr);
      env_.precision->linear_forward(ctx, wu_, ln2, param(u, kWup), up, nullptr);
    }
    {
      Range r(be, "swiglu");
      be.swiglu_forward(swi, gate, up);
    }
    Tensor tmp = act(tmp_, {N, h});
    {
      Range r(be, "down+residual");
      env_.precision->linear_forward(ctx, wd_, swi, param(u, kWdown), tmp, nullptr);
      be.add(out, x, tmp);
    }
  }

  void backward(UnitState& u, const Tensor& x, Tensor& d) override {
    const bool acc = !env_.writes_grads();  // false: this micro-batch writes the weight gradients
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, f = spec_.ffn_hidden;
    Tensor d_swi = act(d_swi_, {N, f}), d_gate = act(d_gate_, {N, f}), d_up = act(d_up_, {N, f});
    {
      Range r(be, "down.grad");
      Tensor dWd = param(u, kWdown, true);
      Tensor swi = swi_plan_.kept_by_recipe ? Tensor() : act(swi_, {N, f});
      if (swi_plan_.recomputed) {
        Range rr(be, "swiglu.recompute");
        be.swiglu_forward(swi, act(gate_, {N, f}), act(up_, {N, f}));
      }
      env_.precision->linear_backward(ctx, wd_, swi, param(u, kWdown), d, &d_swi, dWd, acc);
    }
    {
      Range r(be, "swiglu.grad");
      be.swiglu_backward(d_gate, d_up, d_swi, act(gate_, {N, f}), act(up_, {N, f}));
    }
    Tensor ln2 = ln2_plan_.kept_by_recipe ? Tensor() : act(ln2_, {N, h});
    if (ln2_plan_.recomputed) {
      Range r(be, "rmsnorm.recompute");
      Tensor rstd2 = f32(rstd2_, {N});  // rewritten with the values it holds
      be.rmsnorm_forward(ln2, rstd2, x, param(u, kLn2), static_cast<float>(spec_.norm_eps));
    }
    Tensor d_ln = act(d_ln_, {N, h}), d_tmp = act(tmp_, {N, h});
    {
      Range r(be, "gate_up.grad");
      Tensor dWg = param(u, kWgate, true), dWu = param(u, kWup, true);
      env_.precision->linear_backward(ctx, wg_, ln2, param(u, kWgate), d_gate, &d_ln, dWg, acc);
      env_.precision->linear_backward(ctx, wu_, ln2, param(u, kWup), d_up, &d_tmp, dWu, acc);
      be.accumulate(d_ln, d_tmp);
    }
    {
      Range r(be, "rmsnorm.grad");
      Tensor dln2 = param(u, kLn2, true);
      if (!acc) be.zero(dln2);  // the first micro-batch writes (BlockEnv::first_micro)
      be.rmsnorm_backward(d, dln2, d_ln, x, param(u, kLn2), f32(rstd2_, {N}));
    }
  }

 private:

  int ln2_ = -1, rstd2_ = -1, gate_ = -1, up_ = -1, swi_ = -1, tmp_ = -1;
  int d_ln_ = -1, d_gate_ = -1, d_up_ = -1, d_swi_ = -1;
  int wg_ = -1, wu_ = -1, wd_ = -1;
  BlockEnv::InputPlan ln2_plan_, swi_plan_;
};

}  // namespace

extern const FfnVariant ffn_native;  // block_factory.cpp's table lists it
const FfnVariant ffn_native{
    "native",
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<FfnBlock> {
      return std::make_unique<NativeFfn>(spec, layer);
    },
    FfnBlock::hf_floor,
};

}  // namespace loom
