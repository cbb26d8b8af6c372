// Writes Megatron indexed datasets (PREFIX.bin + PREFIX.idx, the layout of
// plugins/data/megatron/indexed_dataset.hpp) from C++, for the suites that need one
// without the Python writer of tests/data/megatron_model.py: a dataset of any
// size, of any token type, with any token (negative, beyond a vocabulary).
#pragma once
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::test {

// The dtype code Megatron writes for T.
template <typename T>
constexpr uint8_t megatron_dtype_code() {
  if constexpr (std::is_same_v<T, uint8_t>) return 1;
  if constexpr (std::is_same_v<T, int8_t>) return 2;
  if constexpr (std::is_same_v<T, int16_t>) return 3;
  if constexpr (std::is_same_v<T, int32_t>) return 4;
  if constexpr (std::is_same_v<T, int64_t>) return 5;
  if constexpr (std::is_same_v<T, uint16_t>) return 8;
}

// One document per sequence, tokens of type T.
template <typename T>
void write_megatron(const std::filesystem::path& prefix, const std::vector<std::vector<T>>& docs) {
  std::ofstream bin(prefix.string() + ".bin", std::ios::binary | std::ios::trunc);
  std::vector<int32_t> sizes;
  std::vector<int64_t> pointers;
  int64_t at = 0;
  for (const auto& d : docs) {
    bin.write(reinterpret_cast<const char*>(d.data()), static_cast<std::streamsize>(d.size() * sizeof(T)));
    sizes.push_back(static_cast<int32_t>(d.size()));
    pointers.push_back(at);
    at += static_cast<int64_t>(d.size() * sizeof(T));
  }
  std::ofstream idx(prefix.string() + ".idx", std::ios::binary | std::ios::trunc);
  auto put = [&](const auto& v) { idx.write(reinterpret_cast<const char*>(&v), sizeof v); };
  idx.write("MMIDIDX\0\0", 9);
  put(uint64_t{1});
  put(megatron_dtype_code<T>());
  put(static_cast<uint64_t>(docs.size()));
  put(static_cast<uint64_t>(docs.size() + 1));
  idx.write(reinterpret_cast<const char*>(sizes.data()), static_cast<std::streamsize>(sizes.size() * 4));
  idx.write(reinterpret_cast<const char*>(pointers.data()), static_cast<std::streamsize>(pointers.size() * 8));
  for (uint64_t i = 0; i <= docs.size(); ++i) put(static_cast<int64_t>(i));
}

// `n_docs` documents of `len` tokens each, token k of document d = (d * len + k) % vocab.
template <typename T = uint16_t>
std::vector<std::vector<T>> megatron_docs(std::size_t n_docs, std::size_t len, int64_t vocab) {
  std::vector<std::vector<T>> docs(n_docs, std::vector<T>(len));
  for (std::size_t d = 0; d < n_docs; ++d)
    for (std::size_t k = 0; k < len; ++k) docs[d][k] = static_cast<T>(static_cast<int64_t>(d * len + k) % vocab);
  return docs;
}

}  // namespace loom::test
