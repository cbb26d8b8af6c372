// The scaling state of an FP8 recipe, host side: every linear's x, w and dy
// tensors with their scale, inverse scale, amax history and this step's amax.
//
// Delayed scaling follows TransformerEngine's DelayedScaling: each cast
// measures its input's amax into this step's slot; once per optimizer step
// the slot enters a history of the last amax_history_len steps (the current
// one included), amax = max over the history ("max") or this step's
// ("most_recent"), and scale = (fp8_max / amax) / 2^margin (compute_scale in
// loom/fp8.hpp). Casts in a step use the scale from the steps before it.
// Current scaling takes the scale from the tensor's own amax just before its
// cast (current_scale), so it has no history.
//
// Layout: this step's amaxes are one contiguous float buffer of tensors()
// entries, linear-major (slot = 3 * linear + role), so that data-parallel
// ranks agree on every scale with one all-reduce (max) over it per step,
// before update_scales(). Scales and inverse scales are laid out the same
// way, and the history as [amax_history_len][tensors()] rows, a ring.
//
// Host-only (throws loom::Error); a device version keeps the same layout
// (loom/ops/fp8_slots.hpp; the device scale updates of loom/ops/fp8_cast.hpp
// are bitwise update_scales'). The recipes' own logic: it lives with the FP8
// precision plugins and is compiled into each (plugins/CMakeLists.txt).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loom/fp8.hpp"
#include "loom/ops/fp8_slots.hpp"

namespace loom::fp8 {

enum class Scaling : uint8_t { delayed, current };

struct ScalingConfig {
  Scaling scaling = Scaling::delayed;
  Formats formats = Formats::hybrid;
  int amax_history_len = 1024;                 // TE's default
  AmaxAlgo amax_compute_algo = AmaxAlgo::max;  // TE's default
  int margin = 0;                              // in [0, 126]
};

// Config strings ("delayed" | "current", "hybrid" | "e4m3", "max" | "most_recent");
// an unknown one throws loom::Error naming it and the choices.
Scaling parse_scaling(std::string_view s);
Formats parse_formats(std::string_view s);
AmaxAlgo parse_amax_algo(std::string_view s);
const char* name(Scaling s);
const char* name(Formats f);
const char* name(AmaxAlgo a);
// Throws loom::Error naming the bad value (history length >= 1, margin in [0, 126]).
void validate(const ScalingConfig& cfg);


// The names of a ScalingState's tensors in a checkpoint, for messages.
struct ScalingStateNames {
  std::string scale = "fp8.scale", history = "fp8.amax_history", counters = "fp8.counters", options = "fp8.options";
};

class ScalingState {
 public:
  explicit ScalingState(const ScalingConfig& cfg);  // validates cfg

  const ScalingConfig& config() const { return cfg_; }
  // Registers a linear (before the first update_scales); returns its index.
  int add_linear(std::string name);
  int linears() const { return static_cast<int>(names_.size()); }
  int64_t tensors() const { return static_cast<int64_t>(names_.size()) * kRolesPerLinear; }
  const std::string& linear_name(int linear) const;
  static int64_t slot(int linear, Role r) { return int64_t{linear} * kRolesPerLinear + static_cast<int>(r); }
  Format format(Role r) const { return role_format(cfg_.formats, r); }

  // This step's amaxes, [tensors()] floats (see the layout above).
  float* step_amax() { return step_amax_.data(); }
  const float* step_amax() const { return step_amax_.data(); }
  // A cast's amax, max-accumulated over the step's micro-batches. A NaN is
  // stored as +inf: max over NaN is unspecified in MPI and NCCL reductions,
  // and both mean the same here (the update skips the tensor).
  void record_amax(int linear, Role r, float amax);

  // Current scaling: records amax and returns the scale for this cast from it
  // (the previous scale of the tensor, counted as skipped, when amax is 0 or
  // not finite; 1 before any good amax).
  float current_scale(int linear, Role r, float amax);

  // Once per optimizer step, after the all-reduce of step_amax(). Delayed: the
  // step's amaxes enter the history (one roll), every scale is recomputed,
  // keeping the previous one (and counting it) where this step's amax is not
  // finite, which also enters the history as 0 so that one bad step cannot
  // hold the scale for amax_history_len steps, or where the history's amax is
  // 0. Both scalings: the step's amaxes are cleared. Returns the number of
  // scales kept this step.
  int64_t update_scales();

  float scale(int linear, Role r) const { return scale_[static_cast<size_t>(slot(linear, r))]; }
  float scale_inv(int linear, Role r) const { return scale_inv_[static_cast<size_t>(slot(linear, r))]; }
  const float* scales() const { return scale_.data(); }
  const float* scale_invs() const { return scale_inv_.data(); }
  // The history of one tensor, newest first (amax_history_len entries, 0 for
  // steps not taken yet); empty under current scaling.
  std::vector<float> history(int linear, Role r) const;

  // Checkpointing (a recipe's state tensors): the scales, [tensors()], and the
  // history ring, [amax_history_len][tensors()] (empty under current
  // scaling), as raw arrays, the counters that go with them, and the record
  // of the options that give them their meaning. This step's amaxes are not
  // part of it.
  struct Counters {
    int64_t head = 0, steps = 0, skipped = 0, nonfinite = 0;
  };
  float* scale_data() { return scale_.data(); }
  float* history_data() { return history_.data(); }
  int64_t history_floats() const { return static_cast<int64_t>(history_.size()); }
  Counters counters() const { return {head_, steps_, skipped_, nonfinite_}; }

  // The options record saved beside the state (f64, kOptionsRecord values):
  // record version 1, formats (0 hybrid, 1 e4m3), margin, amax_history_len
  // and amax_compute_algo (0 max, 1 most_recent; both 0 under current scaling).
  static constexpr int kOptionsRecord = 5;
  void options_record(double* out) const;

  using StateNames = ScalingStateNames;
  // A checkpoint's f64 counters [head, steps, skipped, non-finite] as
  // Counters: each must be a whole number in [0, 2^53] (throws loom::Error
  // naming the tensor, the field and the value; nothing is converted first).
  static Counters counters_from(const double* c, const StateNames& names = {});

  // After the arrays were overwritten from a checkpoint: checks every
  // restored value as a checkpoint's own fields are checked, then sets the
  // counters and recomputes the inverse scales. Throws loom::Error naming the
  // tensor, the element (linear and role, history row) and the value for a
  // scale that is not positive and finite; a history entry that is negative
  // or not finite, or not 0 in a row no step has written yet; a history head
  // outside the ring or not steps mod its length (the two advance together);
  // more non-finite amaxes than skipped updates; under delayed scaling more
  // skipped updates than steps x tensors; an options record that is not one.
  // `saved_options` (kOptionsRecord values; null: the checkpoint holds none,
  // as one written before the record existed, and the state is taken as
  // written under this state's options): where an option changed what a
  // saved field means, that field starts afresh instead of being reused —
  // the scales of a role whose format changed (hybrid <-> e4m3 changes dy's),
  // every scale when the margin or amax_compute_algo changed — delayed
  // scaling derives them from the kept amax history (amaxes of the unscaled
  // tensors, which no option changes) as update_scales() would, 1 where the
  // history holds no amax; current scaling sets them to 1 (its fallback for
  // a cast whose amax is 0 or not finite). Returns one line per option that
  // changed ("precision.format \"hybrid\" -> \"e4m3\": ..."), for the log.
  std::vector<std::string> restore(const Counters& c, const double* saved_options = nullptr,
                                   const StateNames& names = {});

  int64_t steps() const { return steps_; }
  // Scales kept since the start (amax 0 or not finite, or a scale that would be 0).
  int64_t skipped_updates() const { return skipped_; }
  // Non-finite amaxes recorded since the start (each also counts as skipped).
  int64_t nonfinite_amaxes() const { return nonfinite_; }

 private:
  void check_slot(int linear, Role r, const char* what) const;
  float window_amax(int64_t t) const;
  void set_scale(int64_t t, float s);

  ScalingConfig cfg_;
  std::vector<std::string> names_;
  std::vector<float> step_amax_, scale_, scale_inv_;
  std::vector<float> history_;  // [amax_history_len][tensors()], row head_ is the newest
  int64_t head_ = 0;
  int64_t steps_ = 0, skipped_ = 0, nonfinite_ = 0;
};

}  // namespace loom::fp8
