// The gated feed-forward block of the dense layout (HF's LlamaMLP and its
// kin), one kernel per op:
//
//   h = rmsnorm(x) ; g, u = h Wg^T, h Wu^T  (two GEMMs)
//   m = act(g) * u ; out = x + m Wd^T       (GEMM, then an add)
//
// The parameters (post_attention_layernorm, gate_proj, up_proj, down_proj)
// and the memory plan are the same for every activation: a variant (the
// native SwiGLU block, GeGLU) says only how m and its gradient are computed.
// model.recompute = "selective": h and m are computed again (from x and rstd,
// from g and u, which are kept) just before the wgrads that read them.
#pragma once
#include "loom/block.hpp"

namespace loom {

class GatedFfn : public FfnBlock {
 public:
  using FfnBlock::FfnBlock;

  void plan(const BlockEnv& env, ActivationPlan& a) override;
  void forward(const UnitState& u, const Tensor& x, Tensor& out) override;
  void backward(UnitState& u, const Tensor& x, Tensor& d) override;

 protected:
  // The activation's names: its kept tensor and its trace ranges (literals:
  // the step formats nothing).
  struct Names {
    const char* kept;       // the kept m, e.g. "swi"
    const char* range;      // e.g. "swiglu"
    const char* recompute;  // e.g. "swiglu.recompute"
    const char* grad;       // e.g. "swiglu.grad"
  };
  virtual Names names() const = 0;
  // Refuses a run the activation cannot do, at planning (before any GPU work).
  virtual void check(const BlockEnv&) const {}
  // m = act(g) * u.
  virtual void activation_forward(Backend& be, Tensor& m, const Tensor& g, const Tensor& u) = 0;
  // dg = dm * u * act'(g), du = dm * act(g).
  virtual void activation_backward(Backend& be, Tensor& dg, Tensor& du, const Tensor& dm, const Tensor& g,
                                   const Tensor& u) = 0;

 private:
  int ln2_ = -1, rstd2_ = -1, gate_ = -1, up_ = -1, m_ = -1, tmp_ = -1;
  int d_ln_ = -1, d_gate_ = -1, d_up_ = -1, d_m_ = -1;
  int wg_ = -1, wu_ = -1, wd_ = -1;
  BlockEnv::InputPlan ln2_plan_, m_plan_;
};

// An activation computed on the host, one element at a time (GeGLU, ReGLU):
// what a variant of HostGatedFfn says of itself. The names are literals.
struct HostActivation {
  const char* ffn;        // model.ffn = ffn; also the kept m's name and the trace range
  const char* kind;       // "ffn.geglu"
  const char* recompute;  // "geglu.recompute"
  const char* grad;       // "geglu.grad"
  // a = act(z), da = act'(z).
  void (*act)(float z, float& a, float& da);
};

// The gated block around a HostActivation: m = act(g) * u, dg = dm * u *
// act'(g), du = dm * act(g), in host loops. It runs on the CPU backend with
// fp32 activations and refuses any other run when it is planned, naming
// model.ffn. A variant is its activation and a descriptor (ffn_geglu.cpp).
class HostGatedFfn final : public GatedFfn {
 public:
  HostGatedFfn(const ModelSpec& spec, int64_t layer, const HostActivation& a)
      : GatedFfn(spec, layer), a_(a) {}
  const char* kind() const override { return a_.kind; }

 protected:
  Names names() const override { return {a_.ffn, a_.ffn, a_.recompute, a_.grad}; }
  void check(const BlockEnv& env) const override;
  void activation_forward(Backend& be, Tensor& m, const Tensor& g, const Tensor& u) override;
  void activation_backward(Backend& be, Tensor& dg, Tensor& du, const Tensor& dm, const Tensor& g,
                           const Tensor& u) override;

 private:
  const HostActivation& a_;
};

}  // namespace loom
