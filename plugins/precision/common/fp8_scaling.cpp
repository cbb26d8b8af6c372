// FP8 scaling state (precision/common/fp8_scaling.hpp): TransformerEngine's delayed
// scaling and per-tensor current scaling on the host.
#include "precision/common/fp8_scaling.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
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

namespace {

// A float as a message shows it: every digit that tells it apart ("-1",
// "0.00048828125", "nan", "inf").
std::string float_text(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
  return buf;
}
std::string double_text(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

const char* const kRoleNames[kRolesPerLinear] = {"x", "w", "dy"};

// The value of a whole-number field of a checkpoint's f64 record, or why not.
bool whole_in(double v, double lo, double hi) { return std::isfinite(v) && v == std::floor(v) && v >= lo && v <= hi; }

constexpr double kMaxCount = 9007199254740992.0;  // 2^53: every whole number up to it is exact in f64

const char* format_name_of(double f) { return f == 0.0 ? "hybrid" : "e4m3"; }
const char* algo_name_of(double a) { return a == 0.0 ? "max" : "most_recent"; }

}  // namespace

void ScalingState::options_record(double* out) const {
  const bool delayed = cfg_.scaling == Scaling::delayed;
  out[0] = 1.0;
  out[1] = cfg_.formats == Formats::hybrid ? 0.0 : 1.0;
  out[2] = static_cast<double>(cfg_.margin);
  out[3] = delayed ? static_cast<double>(cfg_.amax_history_len) : 0.0;
  out[4] = delayed && cfg_.amax_compute_algo == AmaxAlgo::most_recent ? 1.0 : 0.0;
}

ScalingState::Counters ScalingState::counters_from(const double* c, const StateNames& names) {
  static const char* const what[4] = {"the amax history position", "the steps taken", "the skipped scale updates",
                                      "the non-finite amaxes"};
  for (int i = 0; i < 4; ++i)
    if (!whole_in(c[i], 0.0, kMaxCount))
      throw Error(cat("precision state '", names.counters, "' [", i, "] (", what[i], ") is ", double_text(c[i]),
                      ": a count is a whole number in [0, 2^53]"));
  return {static_cast<int64_t>(c[0]), static_cast<int64_t>(c[1]), static_cast<int64_t>(c[2]),
          static_cast<int64_t>(c[3])};
}

std::vector<std::string> ScalingState::restore(const Counters& c, const double* saved_options, const StateNames& names) {
  const bool delayed = cfg_.scaling == Scaling::delayed;
  const int64_t T = tensors();
  const int64_t len = cfg_.amax_history_len;
  auto where = [&](int64_t t) {
    return cat("linear '", names_[static_cast<size_t>(t / kRolesPerLinear)], "' ", kRoleNames[t % kRolesPerLinear]);
  };
  // Every value is checked before anything is taken.
  double mine[kOptionsRecord];
  options_record(mine);
  const double* saved = saved_options ? saved_options : mine;
  {
    const std::string rec = cat("precision state '", names.options, "'");
    if (saved[0] != 1.0)
      throw Error(cat(rec, " [0] (the record's version) is ", double_text(saved[0]),
                      ": this Loom writes and reads version 1 (a newer Loom wrote it, or it was changed)"));
    if (!(saved[1] == 0.0 || saved[1] == 1.0))
      throw Error(cat(rec, " [1] (precision.format) is ", double_text(saved[1]), ": 0 (hybrid) or 1 (e4m3)"));
    if (!whole_in(saved[2], 0.0, 126.0))
      throw Error(cat(rec, " [2] (precision.margin) is ", double_text(saved[2]), ": a whole number in [0, 126]"));
    if (saved[3] != mine[3])
      throw Error(cat(rec, " [3] (precision.amax_history_len) is ", double_text(saved[3]), ", but the saved history ",
                      delayed ? cat("has ", len, " rows") : std::string("is absent (current scaling: 0)"),
                      ": the record does not describe the state beside it"));
    if (!(saved[4] == 0.0 || (delayed && saved[4] == 1.0)))
      throw Error(cat(rec, " [4] (precision.amax_compute_algo) is ", double_text(saved[4]), ": ",
                      delayed ? "0 (max) or 1 (most_recent)" : "0 under current scaling"));
  }
  const std::string ctr = cat("precision state '", names.counters, "'");
  if (delayed) {
    if (c.head >= len)
      throw Error(cat(ctr, " [0] (the amax history position) is ", c.head, ", but the history has ", len,
                      " rows (positions 0..", len - 1, ")"));
    if (c.head != c.steps % len)
      throw Error(cat(ctr, " [0] (the amax history position) is ", c.head, " after ", c.steps,
                      " steps, which leave it at ", c.steps % len, " (it advances one row per step, modulo ", len,
                      "): the counters do not belong together"));
    // Each step keeps at most every scale once.
    if (T > 0 && c.steps <= INT64_MAX / T && c.skipped > c.steps * T)
      throw Error(cat(ctr, " [2] (the skipped scale updates) is ", c.skipped, ", more than ", c.steps, " steps x ", T,
                      " tensors can skip"));
  } else if (c.head != 0) {
    throw Error(cat(ctr, " [0] (the amax history position) is ", c.head, ": current scaling keeps no history (0)"));
  }
  if (c.nonfinite > c.skipped)
    throw Error(cat(ctr, " [3] (the non-finite amaxes) is ", c.nonfinite, ", more than the ", c.skipped,
                    " skipped scale updates (each non-finite amax also counts as skipped)"));
  for (int64_t t = 0; t < T; ++t) {
    const float s = scale_[static_cast<size_t>(t)];
    // Casts divide by the scale too (its inverse): that must stay finite.
    if (!(s > 0.0f && is_finite(s) && is_finite(1.0f / s)))
      throw Error(cat("precision state '", names.scale, "' element ", t, " (the scale of ", where(t), ") is ",
                      float_text(s), ": a scale is positive and finite, with a finite inverse (about 2.94e-39 or more)"));
  }
  for (int64_t row = 0; row < (delayed ? len : 0); ++row) {
    // After n < len steps rows 1..n hold amaxes (the first step writes row 1); the others are still 0.
    const bool written = c.steps >= len || (row >= 1 && row <= c.steps);
    for (int64_t t = 0; t < T; ++t) {
      const float a = history_[static_cast<size_t>(row * T + t)];
      if (!(a >= 0.0f && is_finite(a)))
        throw Error(cat("precision state '", names.history, "' row ", row, ", element ", t, " (", where(t), ") is ",
                        float_text(a), ": an amax entry is finite and >= 0"));
      if (!written && a != 0.0f)
        throw Error(cat("precision state '", names.history, "' row ", row, ", element ", t, " (", where(t), ") is ",
                        float_text(a), ", but after ", c.steps, " step(s) only rows 1..", c.steps,
                        " hold amaxes: the history does not belong to its counters"));
    }
  }
  // What changed since the state was saved, and which scales it concerns.
  std::vector<std::string> changes;
  bool fresh_role[kRolesPerLinear] = {false, false, false};
  if (saved[1] != mine[1]) {
    const Formats old = saved[1] == 0.0 ? Formats::hybrid : Formats::e4m3;
    std::string roles;
    for (int r = 0; r < kRolesPerLinear; ++r)
      if (role_format(old, static_cast<Role>(r)) != role_format(cfg_.formats, static_cast<Role>(r))) {
        fresh_role[r] = true;
        roles += cat(roles.empty() ? "" : ", ", kRoleNames[r]);
      }
    changes.push_back(cat("precision.format \"", format_name_of(saved[1]), "\" -> \"", name(cfg_.formats),
                          "\": the saved ", roles, " scales were made for ",
                          role_format(old, Role::dy) == Format::e5m2 ? "E5M2 (max 57344)" : "E4M3 (max 448)",
                          " casts and start afresh for ",
                          role_format(cfg_.formats, Role::dy) == Format::e5m2 ? "E5M2" : "E4M3"));
  }
  if (delayed && saved[2] != mine[2]) {
    for (bool& f : fresh_role) f = true;
    changes.push_back(cat("precision.margin ", double_text(saved[2]), " -> ", cfg_.margin,
                          ": every saved scale holds the old margin and starts afresh"));
  }
  if (delayed && saved[4] != mine[4]) {
    for (bool& f : fresh_role) f = true;
    changes.push_back(cat("precision.amax_compute_algo \"", algo_name_of(saved[4]), "\" -> \"",
                          name(cfg_.amax_compute_algo), "\": every saved scale was computed the other way and starts "
                          "afresh"));
  }
  head_ = c.head;
  steps_ = c.steps;
  skipped_ = c.skipped;
  nonfinite_ = c.nonfinite;
  for (auto& a : step_amax_) a = 0.0f;
  for (int64_t t = 0; t < T; ++t) {
    float s = scale_[static_cast<size_t>(t)];
    if (fresh_role[t % kRolesPerLinear]) {
      // What update_scales() would make of the kept history under the new
      // options; 1 (a fresh state's) where there is no amax to go by.
      s = 1.0f;
      if (delayed) s = compute_scale(window_amax(t), max_value(format(static_cast<Role>(t % kRolesPerLinear))),
                                     cfg_.margin, 1.0f).scale;
    }
    set_scale(t, s);
  }
  for (std::string& line : changes)
    line += delayed ? " (delayed scaling: derived from the kept amax history, which holds the unscaled "
                                "tensors' amaxes, as the next update would; 1 where it holds none)"
                              : " (current scaling: 1, its fallback for a cast whose amax is 0 or not finite)";
  return changes;
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
