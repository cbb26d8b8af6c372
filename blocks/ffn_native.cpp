// The native feed-forward block (HF's LlamaMLP): the gated block
// (gated_ffn.hpp) with SwiGLU, m = silu(g) * u, on the backend's kernels.
#include "gated_ffn.hpp"

namespace loom {
namespace {

class NativeFfn final : public GatedFfn {
 public:
  using GatedFfn::GatedFfn;
  const char* kind() const override { return "ffn.native"; }

 protected:
  Names names() const override { return {"swi", "swiglu", "swiglu.recompute", "swiglu.grad"}; }
  void activation_forward(Backend& be, Tensor& m, const Tensor& g, const Tensor& u) override {
    be.swiglu_forward(m, g, u);
  }
  void activation_backward(Backend& be, Tensor& dg, Tensor& du, const Tensor& dm, const Tensor& g,
                           const Tensor& u) override {
    be.swiglu_backward(dg, du, dm, g, u);
  }
};

}  // namespace

extern const FfnVariant ffn_native;  // blocks/block_table.cpp's table lists it
const FfnVariant ffn_native{
    "native",
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<FfnBlock> {
      return std::make_unique<NativeFfn>(spec, layer);
    },
    FfnBlock::hf_floor,
};

}  // namespace loom
