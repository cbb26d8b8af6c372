// Initial weights: random by parameter role, or imported from an HF folder.
// Both are pure functions of their inputs (the seed, the folder), never of
// the layout or the sharding, so every replica starts from the same weights.
#pragma once
#include <cstdint>
#include <string>

#include "train/train_state.hpp"

namespace loom {

// Random initialisation read off each parameter's role (loom/model.hpp):
// matrices ~ N(0, init_std); the token embedding ~ N(0, embedding_std)
// (model.embedding_init_std, init_std unless set); output projections (o_proj,
// down_proj: they write into the residual stream) ~ N(0, init_std / sqrt(2 L))
// as in GPT-2, so the residual stream's variance does not grow with depth;
// norm gains = 1. Parameter i draws from stream i + 1 of `seed`.
void init_random(TrainState& state, const ModelSpec& spec, uint64_t seed, double init_std, double embedding_std);

// Every parameter from an HF Llama folder (config.json + safetensors).
void init_from_hf(TrainState& state, const ModelSpec& spec, const std::string& dir);

}  // namespace loom
