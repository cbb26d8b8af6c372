// The ReGLU feed-forward block (model.ffn = "reglu"; Shazeer 2020, "GLU
// Variants Improve Transformer", the ReLU-gated unit):
//
//   h = rmsnorm(x) ; g, u = h Wg^T, h Wu^T  (two GEMMs)
//   m = relu(g) * u ; out = x + m Wd^T
//
// The dense layout's parameters (FfnBlock::declare) and the gated block
// around the activation (gated_ffn.hpp), as GeGLU. The activation is computed
// on the host (HostGatedFfn), so the block runs on the CPU backend with fp32
// activations and refuses any other run when it is planned. It is one file
// and one row of block_table.cpp: adding it changed no file under core/.
#include "gated_ffn.hpp"

namespace loom {
namespace {

// relu'(0) = 0, as PyTorch takes it.
void relu(float z, float& a, float& da) {
  const bool on = z > 0.0f;
  a = on ? z : 0.0f;
  da = on ? 1.0f : 0.0f;
}

const HostActivation kReglu{"reglu", "ffn.reglu", "reglu.recompute", "reglu.grad", relu};

}  // namespace

extern const FfnVariant ffn_reglu;  // blocks/block_table.cpp's table lists it
const FfnVariant ffn_reglu{
    "reglu",
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<FfnBlock> {
      return std::make_unique<HostGatedFfn>(spec, layer, kReglu);
    },
    FfnBlock::hf_floor,  // the dense layout, and a gate and up kept per layer
};

}  // namespace loom
