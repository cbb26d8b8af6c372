// The loop under every token scan (TokenShard::scan, the megatron plugin's
// IndexedDataset::scan, a third-party source's loom::TokenScan): the first
// token of an array outside [0, limit).
#pragma once
#include <cstdint>

namespace loom::data {

// The index of the first of the n tokens at p that is < 0 or >= limit, n if
// none. p must be aligned to the token's size. Blocks of a fixed size reduce
// to their minimum and maximum first (vector instructions, AVX2 where the CPU
// has it), so a scan runs at memory bandwidth; only a block holding a bad
// token is looked at token by token.
uint64_t first_token_outside(const uint8_t* p, uint64_t n, int64_t limit);
uint64_t first_token_outside(const int8_t* p, uint64_t n, int64_t limit);
uint64_t first_token_outside(const uint16_t* p, uint64_t n, int64_t limit);
uint64_t first_token_outside(const int16_t* p, uint64_t n, int64_t limit);
uint64_t first_token_outside(const uint32_t* p, uint64_t n, int64_t limit);
uint64_t first_token_outside(const int32_t* p, uint64_t n, int64_t limit);
uint64_t first_token_outside(const int64_t* p, uint64_t n, int64_t limit);

}  // namespace loom::data
