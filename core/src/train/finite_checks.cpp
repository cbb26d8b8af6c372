#include "train/finite_checks.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/error.hpp"

namespace loom {
namespace {

// The exponent field all ones means inf (zero mantissa) or NaN: bit tests
// work for every float width and do not depend on the FPU's mode.
template <typename Bits, Bits kExpMask, Bits kMantMask>
NonFiniteCount count_bits(const Bits* p, int64_t n) {
  int64_t nan = 0, inf = 0, first = n;
#pragma omp parallel for schedule(static) reduction(+ : nan, inf) reduction(min : first) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const Bits b = p[i];
    if ((b & kExpMask) == kExpMask) {
      if (b & kMantMask) ++nan;
      else ++inf;
      first = std::min(first, i);
    }
  }
  NonFiniteCount c;
  c.nan = nan;
  c.inf = inf;
  c.first = nan + inf > 0 ? first : -1;
  return c;
}

}  // namespace

NonFiniteCount count_nonfinite(const void* data, DType dtype, int64_t n) {
  if (n <= 0 || data == nullptr) return {};
  switch (dtype) {
    case DType::f32:
      return count_bits<uint32_t, 0x7f800000u, 0x007fffffu>(static_cast<const uint32_t*>(data), n);
    case DType::bf16:
      return count_bits<uint16_t, 0x7f80u, 0x007fu>(static_cast<const uint16_t*>(data), n);
    case DType::f16:
      return count_bits<uint16_t, 0x7c00u, 0x03ffu>(static_cast<const uint16_t*>(data), n);
    case DType::f64:
      return count_bits<uint64_t, 0x7ff0000000000000ull, 0x000fffffffffffffull>(
          static_cast<const uint64_t*>(data), n);
    default:
      return {};
  }
}

std::string count_words(const NonFiniteCount& c) {
  std::string kinds;
  if (c.nan) kinds += cat(c.nan, " NaN");
  if (c.inf) kinds += cat(kinds.empty() ? "" : ", ", c.inf, " inf");
  return cat(c.count(), " non-finite value", c.count() == 1 ? "" : "s", " (", kinds, ")");
}

std::string describe_nonfinite(const NonFiniteCount& c, int64_t n) {
  std::string s = count_words(c);
  s.pop_back();
  return cat(s, "; the first at element ", c.first, " of ", n, ")");
}

std::string state_kind_words(const std::string& kind) {
  if (kind == "params") return "weights (params)";
  if (kind == "master") return "fp32 master weights (master)";
  if (kind == "adam_m") return "AdamW first moment (adam_m)";
  if (kind == "adam_v") return "AdamW second moment (adam_v)";
  return kind;
}

}  // namespace loom
