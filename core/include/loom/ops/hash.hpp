// Stateless hashing for data sources (the SDK's; the in-tree sources and
// `loom prepare` use it): every token, window order and train/val assignment
// is a pure function of (seed, indices), so a resumed or resharded run
// reproduces exactly what an uninterrupted one would have seen.
#pragma once
#include <cstdint>
#include <string_view>

namespace loom::data {

// SplitMix64 finaliser: a bijective mix with full avalanche.
constexpr uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Hash of a tuple of integers; order matters.
constexpr uint64_t hash_combine(uint64_t h, uint64_t v) { return mix64(h ^ mix64(v)); }
template <typename... Ts>
constexpr uint64_t hash_of(uint64_t seed, Ts... vs) {
  uint64_t h = mix64(seed);
  ((h = hash_combine(h, static_cast<uint64_t>(vs))), ...);
  return h;
}

// 64-bit hash of a byte string (FNV-1a then mixed), for content-keyed decisions.
inline uint64_t hash_bytes(uint64_t seed, std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull ^ mix64(seed);
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return mix64(h ^ s.size());
}

// Uniform integer in [0, n) from a 64-bit hash (multiply-shift, no modulo bias to speak of).
inline uint64_t bounded(uint64_t h, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(h) * n) >> 64);
}

// A pseudo-random permutation of [0, n) computed per element with O(1) memory:
// a 4-round Feistel network on the smallest even-bit power of two >= n, with
// cycle walking back into range. Materialising a permutation of every window
// would cost 8 bytes a window (gigabytes for trillion-token corpora).
class IndexPermutation {
 public:
  IndexPermutation(uint64_t n, uint64_t seed, uint64_t epoch) : n_(n) {
    while (half_bits_ < 32 && (uint64_t{1} << (2 * half_bits_)) < n) ++half_bits_;
    mask_ = (uint64_t{1} << half_bits_) - 1;
    for (int k = 0; k < 4; ++k) keys_[k] = hash_of(seed, 0x5045524dull /* "PERM" */, epoch, k);
  }
  uint64_t operator()(uint64_t i) const {
    uint64_t x = i;
    do x = round_trip(x);
    while (x >= n_);
    return x;
  }

 private:
  uint64_t round_trip(uint64_t x) const {
    uint64_t l = x >> half_bits_, r = x & mask_;
    for (uint64_t key : keys_) {
      const uint64_t f = mix64(r ^ key) & mask_;
      const uint64_t nl = r;
      r = l ^ f;
      l = nl;
    }
    return (l << half_bits_) | r;
  }
  uint64_t n_;
  int half_bits_ = 0;
  uint64_t mask_ = 0;
  uint64_t keys_[4] = {};
};

}  // namespace loom::data
