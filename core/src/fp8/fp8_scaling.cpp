// FP8 scaling state (loom/fp8_scaling.hpp): TransformerEngine's delayed
// scaling and per-tensor current scaling on the host.
#include "loom/fp8_scaling.hpp"

#include <utility>

#include "loom/error.hpp"

namespace loom::fp8 {

Scaling parse_scaling(std::string_view s) {
  if (s == "delayed") return Scaling::delayed;
  if (s == "current") return Scaling::current;
  throw Error(cat("fp8 scaling '", s, "' is not known: choose \"delayed\" or \"current\""));
}
Formats parse_formats(std::string_view s) {
  if (s == "hybrid") return Formats::hybrid;
  if (s == "e4m3") return Formats::e4m3;
  throw Error(cat("fp8 format '", s,
                  "' is not known: choose \"hybrid\" (E4M3 forward, E5M2 gradients) or \"e4m3\" (E4M3 everywhere)"));
}
AmaxAlgo parse_amax_algo(std::string_view s) {
  if (s == "max") return AmaxAlgo::max;
  if (s == "most_recent") return AmaxAlgo::most_recent;
  throw Error(cat("fp8 amax_compute_algo '", s, "' is not known: choose \"max\" or \"most_recent\""));
}
const char* name(Scaling s) { return s == Scaling::delayed ? "delayed" : "current"; }
const char* name(Formats f) { return f == Formats::hybrid ? "hybrid" : "e4m3"; }
const char* name(AmaxAlgo a) { return a == AmaxAlgo::max ? "max" : "most_recent"; }

void validate(const ScalingConfig& cfg) {
  LOOM_CHECK(cfg.amax_history_len >= 1, "fp8 amax_history_len = ", cfg.amax_history_len,
             " must be at least 1 (the current step's amax)");
  // 2^-margin must be a normal float for compute_scale's exact power of two.
  LOOM_CHECK(cfg.margin >= 0 && cfg.margin <= 126, "fp8 margin = ", cfg.margin,
             " is outside [0, 126]: the scale is fp8_max / amax / 2^margin");
}

ScalingState::ScalingState(const ScalingConfig& cfg) : cfg_(cfg) { validate(cfg_); }

int ScalingState::add_linear(std::string name) {
  LOOM_CHECK(steps_ == 0, "fp8 scaling: linear '", name, "' registered after ", steps_,
             " steps; every linear must be registered before the first step");
  names_.push_back(std::move(name));
  const auto t = static_cast<size_t>(tensors());
  step_amax_.resize(t, 0.0f);
  scale_.resize(t, 1.0f);  // TE starts every scale at 1
  scale_inv_.resize(t, 1.0f);
  // No step was taken, so the history is all zeros and its row stride may change.
  if (cfg_.scaling == Scaling::delayed) history_.assign(t * static_cast<size_t>(cfg_.amax_history_len), 0.0f);
  return linears() - 1;
}

const std::string& ScalingState::linear_name(int linear) const {
  LOOM_CHECK(linear >= 0 && linear < linears(), "fp8 scaling: linear ", linear, " is not one of the ", linears(),
             " registered");
  return names_[static_cast<size_t>(linear)];
}

void ScalingState::check_slot(int linear, Role r, const char* what) const {
  LOOM_CHECK(linear >= 0 && linear < linears(), "fp8 scaling: ", what, " of linear ", linear, ", but ", linears(),
             " are registered");
  LOOM_CHECK(static_cast<int>(r) >= 0 && static_cast<int>(r) < kRolesPerLinear, "fp8 scaling: ", what,
             " of role ", static_cast<int>(r), ", not x (0), w (1) or dy (2)");
}

void ScalingState::record_amax(int linear, Role r, float amax) {
  check_slot(linear, r, "record_amax");
  float& cur = step_amax_[static_cast<size_t>(slot(linear, r))];
  const float a = is_nan(amax) ? bits_float(0x7F800000u) : amax;
  if (a > cur) cur = a;
}

void ScalingState::set_scale(int64_t t, float s) {
  scale_[static_cast<size_t>(t)] = s;
  // s is in (0, FLT_MAX], so 1 / s is finite and, at worst subnormal, not 0.
  scale_inv_[static_cast<size_t>(t)] = 1.0f / s;
}

float ScalingState::current_scale(int linear, Role r, float amax) {
  check_slot(linear, r, "current_scale");
  record_amax(linear, r, amax);
  const int64_t t = slot(linear, r);
  const ScaleUpdate u = compute_scale(amax, max_value(format(r)), cfg_.margin, scale_[static_cast<size_t>(t)]);
  if (u.skipped) {
    ++skipped_;
    if (!is_finite(amax)) ++nonfinite_;
  }
  set_scale(t, u.scale);
  return u.scale;
}

float ScalingState::window_amax(int64_t t) const {
  const auto T = static_cast<size_t>(tensors());
  if (cfg_.amax_compute_algo == AmaxAlgo::most_recent) return history_[static_cast<size_t>(head_) * T + t];
  float m = 0.0f;  // entries are finite and >= 0 (update_scales writes no other)
  for (size_t row = 0; row < static_cast<size_t>(cfg_.amax_history_len); ++row) {
    const float a = history_[row * T + static_cast<size_t>(t)];
    if (a > m) m = a;
  }
  return m;
}

int64_t ScalingState::update_scales() {
  const int64_t T = tensors();
  int64_t kept = 0;
  if (cfg_.scaling == Scaling::delayed) {
    // One roll per step: the oldest row becomes the newest.
    head_ = (head_ + 1) % cfg_.amax_history_len;
    float* row = history_.data() + static_cast<size_t>(head_ * T);
    for (int64_t t = 0; t < T; ++t) {
      const float a = step_amax_[static_cast<size_t>(t)];
      const bool bad = !is_finite(a);  // NaN too: the all-reduce may have passed one in
      row[t] = bad || a < 0.0f ? 0.0f : a;
      if (bad) {
        ++nonfinite_;
        ++kept;
        continue;
      }
      const float fp8_max = max_value(format(static_cast<Role>(t % kRolesPerLinear)));
      const ScaleUpdate u = compute_scale(window_amax(t), fp8_max, cfg_.margin, scale_[static_cast<size_t>(t)]);
      if (u.skipped) ++kept;
      set_scale(t, u.scale);
    }
    skipped_ += kept;
  }
  for (auto& a : step_amax_) a = 0.0f;
  ++steps_;
  return kept;
}

void ScalingState::restore(const Counters& c) {
  LOOM_CHECK(c.steps >= 0 && c.skipped >= 0 && c.nonfinite >= 0 && c.head >= 0 &&
                 (cfg_.scaling != Scaling::delayed || c.head < cfg_.amax_history_len),
             "fp8 scaling: restored counters are impossible (history head ", c.head, " of ", cfg_.amax_history_len,
             ", steps ", c.steps, ", skipped ", c.skipped, ", non-finite ", c.nonfinite, ")");
  for (int64_t t = 0; t < tensors(); ++t) {
    const float s = scale_[static_cast<size_t>(t)];
    LOOM_CHECK(s > 0.0f && is_finite(s), "fp8 scaling: restored scale of ", names_[static_cast<size_t>(t / kRolesPerLinear)],
               " (role ", t % kRolesPerLinear, ") is ", s, "; a scale must be positive and finite");
    set_scale(t, s);
  }
  for (size_t i = 0; i < history_.size(); ++i) {
    const float a = history_[i];
    LOOM_CHECK(a >= 0.0f && is_finite(a), "fp8 scaling: restored amax history entry ", i, " is ", a,
               "; entries are finite and >= 0");
  }
  head_ = c.head;
  steps_ = c.steps;
  skipped_ = c.skipped;
  nonfinite_ = c.nonfinite;
  for (auto& a : step_amax_) a = 0.0f;
}

std::vector<float> ScalingState::history(int linear, Role r) const {
  check_slot(linear, r, "history");
  std::vector<float> h;
  if (cfg_.scaling != Scaling::delayed) return h;
  const int64_t len = cfg_.amax_history_len, T = tensors(), t = slot(linear, r);
  for (int64_t i = 0; i < len; ++i) {
    const int64_t row = ((head_ - i) % len + len) % len;
    h.push_back(history_[static_cast<size_t>(row * T + t)]);
  }
  return h;
}

}  // namespace loom::fp8
