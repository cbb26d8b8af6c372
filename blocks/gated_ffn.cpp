// The gated feed-forward block (gated_ffn.hpp): the norm, the three linears,
// the residual and their backward, around a variant's activation.
#include "gated_ffn.hpp"

#include "loom/error.hpp"

namespace loom {

void GatedFfn::plan(const BlockEnv& env, ActivationPlan& a) {
  env_ = env;
  check(env);
  const int64_t h = spec_.hidden, f = spec_.ffn_hidden, l = layer_;
  const size_t n = static_cast<size_t>(env.N), e = dtype_size(env.act);
  const bool full = env.recompute == Recompute::full;
  const std::string s = "layer." + std::to_string(l) + ".";
  wg_ = register_weight_linear(env, env.layer_linear(s + "gate_proj", h, f), kWgate);
  wu_ = register_weight_linear(env, env.layer_linear(s + "up_proj", h, f), kWup);
  wd_ = register_weight_linear(env, env.layer_linear(s + "down_proj", f, h), kWdown);
  // The norm output is read by gate and up (forward and wgrad), m by down
  // (the same): transients when the recipe keeps its own copies for the
  // wgrad (the activation's backward reads gate and up, the norm's its
  // input and rstd), or recomputed for the wgrad (selective).
  ln2_plan_ = env.input_plan({wg_, wu_});
  m_plan_ = env.input_plan({wd_});
  ln2_ = ln2_plan_.transient() ? a.transient_input(n * h * e) : a.kept("ln2", l, n * h * e, full);
  rstd2_ = a.kept("rstd2", l, n * 4, full);
  gate_ = a.kept("gate", l, n * f * e, full);
  up_ = a.kept("up", l, n * f * e, full);
  m_ = m_plan_.transient() ? a.transient_input(n * f * e) : a.kept(names().kept, l, n * f * e, full);
  tmp_ = a.shared("scratch.h", n * h * e);  // down_proj's output before the add; a gradient scratch in backward
  d_ln_ = a.shared("grad.ln", n * h * e);
  d_gate_ = a.shared("grad.gate", n * f * e);
  d_up_ = a.shared("grad.up", n * f * e);
  d_m_ = a.shared("grad.swi", n * f * e);
}

void GatedFfn::forward(const UnitState& u, const Tensor& x, Tensor& out) {
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
    Range r(be, names().range);
    activation_forward(be, m, gate, up);
  }
  Tensor tmp = act(tmp_, {N, h});
  {
    Range r(be, "down+residual");
    env_.precision->linear_forward(ctx, wd_, m, param(u, kWdown), tmp, nullptr);
    be.add(out, x, tmp);
  }
}

void GatedFfn::backward(UnitState& u, const Tensor& x, Tensor& d) {
  const bool acc = !env_.writes_grads();  // false: this micro-batch writes the weight gradients
  Backend& be = *env_.backend;
  const ExecContext& ctx = be.ctx();
  const int64_t N = env_.N, h = spec_.hidden, f = spec_.ffn_hidden;
  Tensor d_m = act(d_m_, {N, f}), d_gate = act(d_gate_, {N, f}), d_up = act(d_up_, {N, f});
  {
    Range r(be, "down.grad");
    Tensor dWd = param(u, kWdown, true);
    Tensor m = m_plan_.kept_by_recipe ? Tensor() : act(m_, {N, f});
    if (m_plan_.recomputed) {
      Range rr(be, names().recompute);
      activation_forward(be, m, act(gate_, {N, f}), act(up_, {N, f}));
    }
    env_.precision->linear_backward(ctx, wd_, m, param(u, kWdown), d, &d_m, dWd, acc);
  }
  {
    Range r(be, names().grad);
    activation_backward(be, d_gate, d_up, d_m, act(gate_, {N, f}), act(up_, {N, f}));
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

void HostGatedFfn::check(const BlockEnv& env) const {
  if (env.backend->device() != Device::cpu || env.act != DType::f32)
    throw Error(cat("model.ffn = \"", a_.ffn, "\" computes its activation on the host: it runs on the CPU backend ",
                    "(run.device = \"cpu\") with fp32 activations (precision.plugin = \"fp32\"), but this run has ",
                    env.backend->device() == Device::cpu ? "the CPU" : "a CUDA device", " and ", dtype_name(env.act),
                    " activations. Use model.ffn = \"dense\" (SwiGLU) there"));
}

void HostGatedFfn::activation_forward(Backend&, Tensor& m, const Tensor& g, const Tensor& u) {
  float* mp = m.ptr<float>();
  const float *gp = g.ptr<float>(), *up = u.ptr<float>();
  const int64_t n = g.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float a, da;
    a_.act(gp[i], a, da);
    mp[i] = a * up[i];
  }
}

void HostGatedFfn::activation_backward(Backend&, Tensor& dg, Tensor& du, const Tensor& dm, const Tensor& g,
                                       const Tensor& u) {
  float *dgp = dg.ptr<float>(), *dup = du.ptr<float>();
  const float *dmp = dm.ptr<float>(), *gp = g.ptr<float>(), *up = u.ptr<float>();
  const int64_t n = g.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float a, da;
    a_.act(gp[i], a, da);
    dgp[i] = dmp[i] * up[i] * da;
    dup[i] = dmp[i] * a;
  }
}

}  // namespace loom
