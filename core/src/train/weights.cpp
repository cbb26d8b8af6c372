#include "train/weights.hpp"

#include <cmath>
#include <unordered_map>
#include <vector>

#include "hf/hf_llama.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "train/finite_checks.hpp"

namespace loom {
namespace {

// A normal sample from SplitMix64 + Box-Muller: the same numbers on every
// platform and standard library, and a pure function of (seed, stream, index)
// so initialisation does not depend on how parameters are laid out or sharded.
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
double uniform01(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
void fill_normal(float* out, int64_t n, uint64_t seed, uint64_t stream, double stddev) {
  const uint64_t base = splitmix64(seed ^ splitmix64(stream));
  // Each pair of outputs depends only on its index: parallel and still the same numbers.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i += 2) {
    double u1 = uniform01(splitmix64(base + 2 * static_cast<uint64_t>(i)));
    double u2 = uniform01(splitmix64(base + 2 * static_cast<uint64_t>(i) + 1));
    double r = std::sqrt(-2.0 * std::log(u1)), t = 2.0 * M_PI * u2;
    out[i] = static_cast<float>(stddev * r * std::cos(t));
    if (i + 1 < n) out[i + 1] = static_cast<float>(stddev * r * std::sin(t));
  }
}

}  // namespace

void init_random(TrainState& state, const ModelSpec& spec, uint64_t seed, double init_std, double embedding_std) {
  const double std_out = init_std / std::sqrt(2.0 * static_cast<double>(spec.num_layers));
  // Each parameter draws from its own stream, numbered in the canonical
  // (HF) order, so a layout that groups parameters otherwise (the experts
  // units of expert parallelism) starts from the same weights.
  std::unordered_map<std::string, uint64_t> stream_of;
  for (const UnitInfo& u : model_units(spec))
    for (const ParamInfo& p : u.params) stream_of.emplace(p.name, stream_of.size() + 1);
  std::vector<float> buf;
  for (const UnitInfo& u : state.infos())
    for (const ParamInfo& p : u.params) {
      buf.assign(static_cast<size_t>(p.numel), 0.f);
      const auto it = stream_of.find(p.name);
      LOOM_CHECK(it != stream_of.end(), "init_random: parameter ", p.name, " is not in the model's layout");
      const uint64_t stream = it->second;
      switch (p.role) {
        case ParamRole::norm_gain: std::fill(buf.begin(), buf.end(), 1.0f); break;
        case ParamRole::output_projection: fill_normal(buf.data(), p.numel, seed, stream, std_out); break;
        case ParamRole::matrix: fill_normal(buf.data(), p.numel, seed, stream, init_std); break;
        case ParamRole::embedding: fill_normal(buf.data(), p.numel, seed, stream, embedding_std); break;
      }
      state.write_param(p.name, buf.data());
    }
}

void init_from_hf(TrainState& state, const ModelSpec& spec, const std::string& dir) {
  // One tensor at a time: host memory stays at the largest tensor.
  std::vector<float> buf;
  std::string pending;
  int64_t count = 0;
  // NaN or inf weights would make every step non-finite: refuse them here,
  // naming the tensor, before anything trains on them.
  auto put = [&] {
    if (const NonFiniteCount bad = count_nonfinite(buf.data(), DType::f32, static_cast<int64_t>(buf.size())))
      throw Error(cat("model.init = \"hf:", dir, "\": tensor '", pending, "' holds ",
                      describe_nonfinite(bad, static_cast<int64_t>(buf.size())),
                      ": the weights are damaged (or were saved from a diverged run) and cannot be trained. Use "
                      "another copy of the model"));
    state.write_param(pending, buf.data());
  };
  hf::load_hf_llama_weights(dir, spec, [&](const std::string& name, int64_t numel) -> float* {
    if (!pending.empty()) put();
    pending = name;
    buf.assign(static_cast<size_t>(numel), 0.f);
    ++count;
    return buf.data();
  });
  if (!pending.empty()) put();
  log_info(cat("initialised ", count, " tensors from HF checkpoint ", dir));
}

}  // namespace loom
