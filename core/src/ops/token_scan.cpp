// The key functions of loom::TokenScan and loom::DocumentStarts
// (loom/data.hpp), and the scanning loop of loom/ops/token_scan.hpp.
#include "loom/ops/token_scan.hpp"

#include <type_traits>

#include "loom/data.hpp"

namespace loom {

// Defined here, out of line: the vtables and type information of TokenScan
// and DocumentStarts live in libloom alone, so a dynamic_cast of a plugin's object finds the one
// type the plugins and the host share.
TokenScan::~TokenScan() = default;
DocumentStarts::~DocumentStarts() = default;

namespace data {
namespace {

template <typename T>
[[gnu::always_inline]] inline uint64_t first_outside(const T* p, uint64_t n, int64_t limit) {
  constexpr uint64_t kBlock = 4096;
  auto bad = [&](T t) { return static_cast<int64_t>(t) < 0 || static_cast<int64_t>(t) >= limit; };
  uint64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    // A fixed trip count without branches: the compiler vectorises it.
    T hi = p[i], lo = p[i];
    for (uint64_t k = 0; k < kBlock; ++k) {
      hi = p[i + k] > hi ? p[i + k] : hi;
      if constexpr (std::is_signed_v<T>) lo = p[i + k] < lo ? p[i + k] : lo;
    }
    if (bad(hi) || bad(lo)) break;
  }
  for (; i < n; ++i)
    if (bad(p[i])) return i;
  return n;
}

}  // namespace

#define LOOM_SCAN_CLONES __attribute__((target_clones("avx2", "default")))
LOOM_SCAN_CLONES uint64_t first_token_outside(const uint8_t* p, uint64_t n, int64_t limit) { return first_outside(p, n, limit); }
LOOM_SCAN_CLONES uint64_t first_token_outside(const int8_t* p, uint64_t n, int64_t limit) { return first_outside(p, n, limit); }
LOOM_SCAN_CLONES uint64_t first_token_outside(const uint16_t* p, uint64_t n, int64_t limit) { return first_outside(p, n, limit); }
LOOM_SCAN_CLONES uint64_t first_token_outside(const int16_t* p, uint64_t n, int64_t limit) { return first_outside(p, n, limit); }
LOOM_SCAN_CLONES uint64_t first_token_outside(const uint32_t* p, uint64_t n, int64_t limit) { return first_outside(p, n, limit); }
LOOM_SCAN_CLONES uint64_t first_token_outside(const int32_t* p, uint64_t n, int64_t limit) { return first_outside(p, n, limit); }
LOOM_SCAN_CLONES uint64_t first_token_outside(const int64_t* p, uint64_t n, int64_t limit) { return first_outside(p, n, limit); }
#undef LOOM_SCAN_CLONES

}  // namespace data
}  // namespace loom
