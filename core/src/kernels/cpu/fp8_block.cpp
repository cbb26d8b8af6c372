// Host reference of the fine-grained FP8 casts (loom/fp8_block.hpp): every
// tile's amax, scale and codes computed straightforwardly, in tile order.
// The device casts (kernels/cuda/fp8_block_cast.cu) are checked bitwise
// against these.
#include "loom/fp8_block.hpp"

#include <cmath>

#include "loom/error.hpp"

namespace loom::fp8::block {

const char* name(ScaleMode m) { return m == ScaleMode::tile_1x128 ? "1x128 tiles" : "128x128 blocks"; }

namespace {

void check_dims(const char* fn, const float* x, int64_t rows, int64_t cols, int64_t ld) {
  LOOM_CHECK(x != nullptr || rows * cols == 0, fn, ": x is null");
  LOOM_CHECK(rows >= 0 && cols >= 0 && rows % kBlock == 0 && cols % kBlock == 0, fn, ": x is [", rows, ", ", cols,
             "]; fine-grained FP8 scaling needs both dims to be multiples of ", kBlock);
  LOOM_CHECK(ld >= cols, fn, ": row stride ", ld, " is shorter than a row (", cols, " columns)");
}

// max |v| over the tile; +inf when one is NaN (the tile is then non-finite either way).
inline void amax_step(float v, float& m) {
  if (is_nan(v)) m = bits_float(0x7F800000u);
  else m = std::fmax(m, std::fabs(v));
}

const float* e4m3_table() {
  static const auto* t = [] {
    auto* a = new float[256];
    for (int c = 0; c < 256; ++c) a[c] = decode(static_cast<uint8_t>(c), Format::e4m3);
    return a;
  }();
  return t;
}

// Tiles of `th` rows x `tw` columns of x; emit(r, c, code, tile) for every
// element and tile_done(tr, tc, TileScale) once per tile before its elements.
template <typename Emit, typename Done>
int64_t for_tiles(const float* x, int64_t rows, int64_t cols, int64_t ld, int64_t th, int64_t tw, Emit&& emit,
                  Done&& done) {
  const int64_t tr_n = rows / th, tc_n = cols / tw;
  int64_t nonfinite = 0;
#pragma omp parallel for schedule(static) reduction(+ : nonfinite) if (rows * cols > (1 << 16))
  for (int64_t t = 0; t < tr_n * tc_n; ++t) {
    const int64_t tr = t / tc_n, tc = t % tc_n;
    const int64_t r0 = tr * th, c0 = tc * tw;
    float m = 0.0f;
    for (int64_t r = r0; r < r0 + th; ++r)
      for (int64_t c = c0; c < c0 + tw; ++c) amax_step(x[r * ld + c], m);
    const TileScale s = tile_scale(m);
    if (s.nonfinite) ++nonfinite;
    done(tr, tc, s);
    for (int64_t r = r0; r < r0 + th; ++r)
      for (int64_t c = c0; c < c0 + tw; ++c) emit(r, c, encode(x[r * ld + c] * s.scale, Format::e4m3), s);
  }
  return nonfinite;
}

}  // namespace

int64_t cast_row_tiles(const float* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q, float* scale_inv) {
  check_dims("fp8_block cast_row_tiles", x, rows, cols, ld);
  return for_tiles(
      x, rows, cols, ld, 1, kBlock,
      [&](int64_t r, int64_t c, uint8_t code, const TileScale&) {
        if (q != nullptr) q[r * cols + c] = code;
      },
      [&](int64_t tr, int64_t tc, const TileScale& s) {
        if (scale_inv != nullptr) scale_inv[scale_index(ScaleMode::tile_1x128, tr, tc, rows, cols)] = s.scale_inv;
      });
}

int64_t cast_col_tiles(const float* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q_t, float* scale_inv_t) {
  check_dims("fp8_block cast_col_tiles", x, rows, cols, ld);
  // The transposed operand [cols, rows]: tile (tr, tc) of x is row tc, k block tr of it.
  return for_tiles(
      x, rows, cols, ld, kBlock, 1,
      [&](int64_t r, int64_t c, uint8_t code, const TileScale&) {
        if (q_t != nullptr) q_t[c * rows + r] = code;
      },
      [&](int64_t tr, int64_t tc, const TileScale& s) {
        if (scale_inv_t != nullptr)
          scale_inv_t[scale_index(ScaleMode::tile_1x128, tc, tr, cols, rows)] = s.scale_inv;
      });
}

int64_t cast_blocks(const float* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q, uint8_t* q_t,
                    float* scale_inv, float* scale_inv_t) {
  check_dims("fp8_block cast_blocks", x, rows, cols, ld);
  return for_tiles(
      x, rows, cols, ld, kBlock, kBlock,
      [&](int64_t r, int64_t c, uint8_t code, const TileScale&) {
        if (q != nullptr) q[r * cols + c] = code;
        if (q_t != nullptr) q_t[c * rows + r] = code;
      },
      [&](int64_t tr, int64_t tc, const TileScale& s) {
        if (scale_inv != nullptr)
          scale_inv[scale_index(ScaleMode::block_128x128, tr, tc, rows, cols)] = s.scale_inv;
        if (scale_inv_t != nullptr)
          scale_inv_t[scale_index(ScaleMode::block_128x128, tc, tr, cols, rows)] = s.scale_inv;
      });
}

void dequantize(const uint8_t* q, int64_t rows, int64_t k, ScaleMode m, const float* scale_inv, float* y) {
  LOOM_CHECK(rows % kBlock == 0 && k % kBlock == 0, "fp8_block dequantize: operand [", rows, ", ", k,
             "] is not in multiples of ", kBlock);
  const float* table = e4m3_table();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const int64_t tr = m == ScaleMode::tile_1x128 ? r : r / kBlock;
      y[r * k + c] = table[q[r * k + c]] * scale_inv[scale_index(m, tr, c / kBlock, rows, k)];
    }
}

int64_t qdq_row_tiles(const float* x, int64_t rows, int64_t cols, int64_t ld, float* out) {
  check_dims("fp8_block qdq_row_tiles", x, rows, cols, ld);
  const float* table = e4m3_table();
  return for_tiles(
      x, rows, cols, ld, 1, kBlock,
      [&](int64_t r, int64_t c, uint8_t code, const TileScale& s) { out[r * cols + c] = table[code] * s.scale_inv; },
      [](int64_t, int64_t, const TileScale&) {});
}

int64_t qdq_col_tiles(const float* x, int64_t rows, int64_t cols, int64_t ld, float* out) {
  check_dims("fp8_block qdq_col_tiles", x, rows, cols, ld);
  const float* table = e4m3_table();
  return for_tiles(
      x, rows, cols, ld, kBlock, 1,
      [&](int64_t r, int64_t c, uint8_t code, const TileScale& s) { out[r * cols + c] = table[code] * s.scale_inv; },
      [](int64_t, int64_t, const TileScale&) {});
}

int64_t qdq_blocks(const float* x, int64_t rows, int64_t cols, int64_t ld, float* out) {
  check_dims("fp8_block qdq_blocks", x, rows, cols, ld);
  const float* table = e4m3_table();
  return for_tiles(
      x, rows, cols, ld, kBlock, kBlock,
      [&](int64_t r, int64_t c, uint8_t code, const TileScale& s) { out[r * cols + c] = table[code] * s.scale_inv; },
      [](int64_t, int64_t, const TileScale&) {});
}

}  // namespace loom::fp8::block
