// Writes token shards (the format of loom/token_shard.hpp) for the suites
// that need one: a pattern of tokens of any length, a shard of them, and the
// damage write_token_shard itself refuses to make — a header vocabulary that
// a token reaches, a token changed in place.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "loom/token_shard.hpp"

namespace loom::test {

// `n` tokens, token i = (base + i * stride) % modulo.
inline std::vector<uint32_t> token_pattern(uint64_t n, uint32_t modulo, uint32_t base = 0, uint32_t stride = 1) {
  std::vector<uint32_t> t(n);
  for (uint64_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>((base + i * stride) % modulo);
  return t;
}

// `tokens` as a shard at `path`, `width` bytes a token, its header declaring
// `vocab` (0: none; every token must be below it). Returns the path.
inline std::string write_tokens(const std::filesystem::path& path, const std::vector<uint32_t>& tokens, int width = 2,
                                uint32_t vocab = 0) {
  loom::write_token_shard(path.string(), tokens.data(), tokens.size(), width, vocab);
  return path.string();
}

// Overwrites `n` bytes at `offset` of a file, in place.
inline void patch_file(const std::filesystem::path& path, std::size_t offset, const void* bytes, std::size_t n) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
}

// Makes a shard's header declare `vocab` (bytes 24..27), whatever its tokens.
inline void set_header_vocab(const std::filesystem::path& path, uint32_t vocab) { patch_file(path, 24, &vocab, 4); }

// `tokens` as a shard whose header declares `vocab` even where a token is at
// or beyond it: a damaged shard, which write_token_shard refuses to write.
inline std::string write_damaged_tokens(const std::filesystem::path& path, const std::vector<uint32_t>& tokens,
                                        int width, uint32_t vocab) {
  write_tokens(path, tokens, width, 0);
  set_header_vocab(path, vocab);
  return path.string();
}

// Changes token `index` of a shard of `width`-byte tokens in place.
inline void set_token(const std::filesystem::path& path, uint64_t index, uint32_t value, int width = 2) {
  const std::size_t at = loom::kTokenShardHeaderBytes + static_cast<std::size_t>(index) * static_cast<std::size_t>(width);
  if (width == 2) {
    const uint16_t v = static_cast<uint16_t>(value);
    patch_file(path, at, &v, 2);
  } else {
    patch_file(path, at, &value, 4);
  }
}

}  // namespace loom::test
