// Non-finite values (NaN, +-inf) in weights and optimizer state, found on the
// host where the values pass through it anyway: HF import, checkpoint load and
// checkpoint save (docs/RELIABILITY.md "Non-finite values"). A NaN that gets
// into the weights makes every later step non-finite (all skipped) and every
// later checkpoint worthless, so it is refused where it enters, naming the tensor.
#pragma once
#include <cstdint>
#include <string>

#include "loom/dtype.hpp"

namespace loom {

struct NonFiniteCount {
  int64_t nan = 0, inf = 0;
  int64_t first = -1;  // index of the first non-finite element, -1 if none
  int64_t count() const { return nan + inf; }
  explicit operator bool() const { return count() > 0; }
};

// Counts NaN and infinite elements of n values of `dtype` (f32, bf16, f16 or
// f64; other dtypes hold no floats and count nothing). Deterministic (integer
// counts), parallel for large inputs.
NonFiniteCount count_nonfinite(const void* data, DType dtype, int64_t n);

// "3 non-finite values (2 NaN, 1 inf; the first at element 17 of 4096)".
std::string describe_nonfinite(const NonFiniteCount& c, int64_t n);
// "3 non-finite values (2 NaN, 1 inf)".
std::string count_words(const NonFiniteCount& c);

// What a kind of saved state is, in words: "weights (params)", "AdamW second
// moment (adam_v)", ...
std::string state_kind_words(const std::string& kind);

}  // namespace loom
