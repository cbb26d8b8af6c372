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
// names are the dense layout's, and the block around the activation is the
// gated one (gated_ffn.hpp); only the activation differs. It is computed on
// the host (HostGatedFfn): the block runs on the CPU backend with fp32
// activations (precision.plugin = "fp32") and refuses any other run when it
// is planned. It is the example of a block variant that is its own file and
// one row of blocks/block_table.cpp's table.
#include <cmath>

#include "gated_ffn.hpp"

namespace loom {
namespace {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

void gelu_tanh(float z, float& a, float& da) {
  const float t = std::tanh(kGeluC * (z + kGeluA * z * z * z));
  a = 0.5f * z * (1.0f + t);
  da = 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluA * z * z);
}

const HostActivation kGeglu{"geglu", "ffn.geglu", "geglu.recompute", "geglu.grad", gelu_tanh};

}  // namespace

extern const FfnVariant ffn_geglu;  // blocks/block_table.cpp's table lists it
const FfnVariant ffn_geglu{
    "geglu",
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<FfnBlock> {
      return std::make_unique<HostGatedFfn>(spec, layer, kGeglu);
    },
    FfnBlock::hf_floor,  // the dense layout, and a gate and up kept per layer
};

}  // namespace loom
