// The layout the per-tensor FP8 ops share with the recipes that use them
// (loom/ops/fp8_cast.hpp's scale updates): every linear casts three tensors
// (x, w, dy), one float per tensor in each of a recipe's scale, inverse scale
// and amax arrays, slot = 3 * linear + role, and each role's format follows
// the recipe's Formats. The recipes' own scaling state (delayed and current
// scaling, the amax history, checkpointing) is theirs:
// plugins/precision/common/fp8_scaling.hpp. C++17, no exceptions (nvcc reads it).
#pragma once
#include <cstdint>

#include "loom/fp8.hpp"

namespace loom::fp8 {

// Which format each tensor is cast to: "hybrid" is E4M3 forward (activations
// and weights) and E5M2 for gradients, whose range matters more than their
// precision; "e4m3" is E4M3 everywhere.
enum class Formats : uint8_t { hybrid, e4m3 };
// Delayed scaling's amax from its history: the max over the window or the newest.
enum class AmaxAlgo : uint8_t { max, most_recent };
// The three tensors a linear casts: its input x and weight w (forward) and the
// output gradient dy (backward).
enum class Role : uint8_t { x = 0, w = 1, dy = 2 };
constexpr int kRolesPerLinear = 3;

LOOM_FP8_HD constexpr Format role_format(Formats formats, Role r) {
  return formats == Formats::hybrid && r == Role::dy ? Format::e5m2 : Format::e4m3;
}

}  // namespace loom::fp8
