// The GeGLU feed-forward block (model.ffn = "geglu"; Shazeer 2020, "GLU
// Variants Improve Transformer"; Gemma's MLP with hidden_activation
// "gelu_pytorch_tanh"):
//
//   h = rmsnorm(x) ; g, u = h Wg^T, h Wu^T  (two GEMMs)
//   m = gelu_tanh(g) * u ; out = x + m Wd^T
//   gelu_tanh(z) = z/2 (1 + tanh(c (z + 0.044715 z^3))), c = sqrt(2/pi)
//
// The same parameters as Llama's MLP (post_attention_layernorm, gate_proj,
// up_proj, down_proj: FfnBlock::declare), so its units, checkpoints and HF
// names are the dense layout's; only the activation differs. That activation
// is computed here, on the host: the block runs on the CPU backend with fp32
// activations (precision.plugin = "fp32") and refuses any other run when it
// is planned. It is the example of a block variant that is its own file and
// one row of block_factory.cpp's table.
#include <cmath>

#include "loom/error.hpp"
#include "model/blocks/blocks.hpp"

namespace loom {
namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

// m = gelu_tanh(g) * u over n elements.
void geglu_forward(float* m, const float* g, const float* u, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float z = g[i];
    const float t = std::tanh(kGeluC * (z + kGeluA * z * z * z));
    m[i] = 0.5f * z * (1.0f + t) * u[i];
  }
}

// dg = dm * u * gelu_tanh'(g), du = dm * gelu_tanh(g).
void geglu_backward(float* dg, float* du, const float* dm, const float* g, const float* u, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float z = g[i];
    const float t = std::tanh(kGeluC * (z + kGeluA * z * z * z));
    const float gelu = 0.5f * z * (1.0f + t);
    const float dgelu = 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluA * z * z);
    dg[i] = dm[i] * u[i] * dgelu;
    du[i] = dm[i] * gelu;
  }
}

class GegluFfn final : public FfnBlock {
 public:
  GegluFfn(const ModelSpec& spec, int64_t layer) : FfnBlock(spec, layer) {}
  const char* kind() const override { return "ffn.geglu"; }

  void plan(const BlockEnv& env, ActivationPlan& a) override {
    env_ = env;
    if (env.backend->device() != Device::cpu || env.act != DType::f32)
      throw Error(cat("model.ffn = \"geglu\" computes its activation on the host: it runs on the CPU backend ",
                      "(run.device = \"cpu\") with fp32 activations (precision.plugin = \"fp32\"), but this run has ",
                      env.backend->device() == Device::cpu ? "the CPU" : "a CUDA device", " and ", dtype_name(env.act),
                      " activations. Use model.ffn = \"dense\" (SwiGLU) there"));
    const int64_t h = spec_.hidden, f = spec_.ffn_hidden, l = layer_;
    const size_t n = static_cast<size_t>(env.N), e = dtype_size(env.act);
    const bool full = env.recompute == Recompute::full;
    const std::string s = "layer." + std::to_string(l) + ".";
    wg_ = register_weight_linear(env, env.layer_linear(s + "gate_proj", h, f), kWgate);
    wu_ = register_weight_linear(env, env.layer_linear(s + "up_proj", h, f), kWup);
    wd_ = register_weight_linear(env, env.layer_linear(s + "down_proj", f, h), kWdown);
    // As the native block: the norm's output and m are read by the linears
    // only (the activation's backward reads g and u), so they are transients
    // when the recipe keeps its own copies, or recomputed under selective.
    ln2_plan_ = env.input_plan({wg_, wu_});
    m_plan_ = env.input_plan({wd_});
    ln2_ = ln2_plan_.transient() ? a.transient_input(n * h * e) : a.kept("ln2", l, n * h * e, full);
    rstd2_ = a.kept("rstd2", l, n * 4, full);
    gate_ = a.kept("gate", l, n * f * e, full);
    up_ = a.kept("up", l, n * f * e, full);
    m_ = m_plan_.transient() ? a.transient_input(n * f * e) : a.kept("geglu", l, n * f * e, full);
    tmp_ = a.shared("scratch.h", n * h * e);  // down_proj's output before the add; a gradient scratch in backward
    d_ln_ = a.shared("grad.ln", n * h * e);
    d_gate_ = a.shared("grad.gate", n * f * e);
    d_up_ = a.shared("grad.up", n * f * e);
    d_m_ = a.shared("grad.swi", n * f * e);
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
    Tensor gate = act(gate_, {N, f}), up = act(up_, {N, f}), m = act(m_, {N, f});
    {
      Range r(be, "gate_up");
      env_.precision->linear_forward(ctx, wg_, ln2, param(u, kWgate), gate, nullptr);
      env_.precision->linear_forward(ctx, wu_, ln2, param(u, kWup), up, nullptr);
    }
    {
      Range r(be, "geglu");
      geglu_forward(m.ptr<float>(), gate.ptr<float>(), up.ptr<float>(), N * f);
    }
    Tensor tmp = act(tmp_, {N, h});
    {
      Range r(be, "down+residual");
      env_.precision->linear_forward(ctx, wd_, m, param(u, kWdown), tmp, nullptr);
      be.add(out, x, tmp);
    }
  }

  void backward(UnitState& u, const Tensor& x, Tensor& d) override {
    const bool acc = !env_.writes_grads();  // false: this micro-batch writes the weight gradients
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, f = spec_.ffn_hidden;
    Tensor gate = act(gate_, {N, f}), up = act(up_, {N, f});
    Tensor d_m = act(d_m_, {N, f}), d_gate = act(d_gate_, {N, f}), d_up = act(d_up_, {N, f});
    {
      Range r(be, "down.grad");
      Tensor dWd = param(u, kWdown, true);
      Tensor m = m_plan_.kept_by_recipe ? Tensor() : act(m_, {N, f});
      if (m_plan_.recomputed) {
        Range rr(be, "geglu.recompute");
        geglu_forward(m.ptr<float>(), gate.ptr<float>(), up.ptr<float>(), N * f);
      }
      env_.precision->linear_backward(ctx, wd_, m, param(u, kWdown), d, &d_m, dWd, acc);
    }
    {
      Range r(be, "geglu.grad");
      geglu_backward(d_gate.ptr<float>(), d_up.ptr<float>(), d_m.ptr<float>(), gate.ptr<float>(), up.ptr<float>(), N * f);
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
  int ln2_ = -1, rstd2_ = -1, gate_ = -1, up_ = -1, m_ = -1, tmp_ = -1;
  int d_ln_ = -1, d_gate_ = -1, d_up_ = -1, d_m_ = -1;
  int wg_ = -1, wu_ = -1, wd_ = -1;
  BlockEnv::InputPlan ln2_plan_, m_plan_;
};

}  // namespace

extern const FfnVariant ffn_geglu;  // block_factory.cpp's table lists it
const FfnVariant ffn_geglu{
    "geglu",
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<FfnBlock> {
      return std::make_unique<GegluFfn>(spec, layer);
    },
    FfnBlock::hf_floor,  // the dense layout, and a gate and up kept per layer
};

}  // namespace loom
