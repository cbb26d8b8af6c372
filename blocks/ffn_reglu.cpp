// The ReGLU feed-forward block (model.ffn = "reglu"; Shazeer 2020, "GLU
// Variants Improve Transformer", the ReLU-gated unit):
//
//   h = rmsnorm(x) ; g, u = h Wg^T, h Wu^T  (two GEMMs)
//   m = relu(g) * u ; out = x + m Wd^T
//
// The dense layout's parameters (FfnBlock::declare) and the gated block
// around the activation (gated_ffn.hpp), as GeGLU. The activation is computed
// here, on the host, so the block runs on the CPU backend with fp32
// activations and refuses any other run when it is planned. It is one file
// and one row of block_table.cpp: adding it changed no file under core/.
#include "gated_ffn.hpp"

namespace loom {
namespace {

// m = relu(g) * u over n elements.
void reglu_forward(float* m, const float* g, const float* u, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) m[i] = g[i] > 0.0f ? g[i] * u[i] : 0.0f;
}

// dg = dm * u * relu'(g), du = dm * relu(g); relu'(0) = 0, as PyTorch takes it.
void reglu_backward(float* dg, float* du, const float* dm, const float* g, const float* u, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const bool on = g[i] > 0.0f;
    dg[i] = on ? dm[i] * u[i] : 0.0f;
    du[i] = on ? dm[i] * g[i] : 0.0f;
  }
}

class RegluFfn final : public GatedFfn {
 public:
  using GatedFfn::GatedFfn;
  const char* kind() const override { return "ffn.reglu"; }

 protected:
  Names names() const override { return {"reglu", "reglu", "reglu.recompute", "reglu.grad"}; }
  void check(const BlockEnv& env) const override { require_host_fp32(env, "reglu"); }
  void activation_forward(Backend&, Tensor& m, const Tensor& g, const Tensor& u) override {
    reglu_forward(m.ptr<float>(), g.ptr<float>(), u.ptr<float>(), g.numel());
  }
  void activation_backward(Backend&, Tensor& dg, Tensor& du, const Tensor& dm, const Tensor& g,
                           const Tensor& u) override {
    reglu_backward(dg.ptr<float>(), du.ptr<float>(), dm.ptr<float>(), g.ptr<float>(), u.ptr<float>(), g.numel());
  }
};

}  // namespace

extern const FfnVariant ffn_reglu;  // blocks/block_table.cpp's table lists it
const FfnVariant ffn_reglu{
    "reglu",
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<FfnBlock> {
      return std::make_unique<RegluFfn>(spec, layer);
    },
    FfnBlock::hf_floor,  // the dense layout, and a gate and up kept per layer
};

}  // namespace loom
