// SwiGLU on the GPU: out = silu(gate) * up, silu(g) = g * sigmoid(g).
// Element-wise, packed loads, fp32 math (expf, not the fast __expf, so the
// fp32 path matches the CPU reference to ~1e-7).
//
// Operands are [rows, f] row views (fold_rows): gate and up (and dgate, dup)
// may be the two halves of a packed [N, 2f] gate_up buffer, row stride 2f,
// as the fused feed-forward block computes them; out and dout are usually
// packed. When every operand is packed the whole range is one flat row.
// Otherwise a 2-D grid walks rows (y) and the columns of a row (x), so no
// thread divides by f; each row runs the packed path over its first
// f / K * K columns and the scalar path over the rest. The packed path needs
// every base pointer aligned for 16-byte accesses and every row stride a
// multiple of K (so each row's start stays aligned); when any is not (odd f,
// an unaligned half), the whole call is scalar.
//
// The *_fp8 entry points write a linear's FP8 operand instead of the bf16
// tensor (loom/precision.hpp's Fp8Operand): the down projection's x in the
// forward, the gate_up projection's dy ([dgate, dup], packed) in the
// backward. They run fp8_tile.cuh's 128 x 64 tiles over the SwiGLU columns:
// each thread computes 4 rows x 8 columns with the same math as the bf16
// kernels, rounds every value to bf16 (the value the bf16 kernel stores and
// the cast would read), and encodes it into q and q_t. So they are bitwise
// the bf16 kernel followed by fp8_cast, codes and amax alike, and skip that
// pair's bf16 write and read: 4 of 10 bytes per forward output element, 8 of
// 18 in the backward.
//
// Given an amax, the bf16 kernels also measure what they store (each thread
// the max |v| of its stored values, then one atomicMax per block), for a
// recipe that scales from the tensor's own amax (Fp8OperandAmax): its cast
// then reads the tensor once instead of twice.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/fp8_tile.cuh"

namespace loom::gpu {
namespace {

// One operand: its base pointer and row stride (elements).
template <typename P>
struct RowPtr {
  P* p;
  int64_t ld;
  __device__ __forceinline__ P* at(int64_t row, int64_t col) const { return p + row * ld + col; }
};

// The math of both paths, fp32.
__device__ __forceinline__ float swiglu_value(float g, float u) {
  const float sg = 1.f / (1.f + expf(-g));
  return g * sg * u;
}
// d silu(g)/dg = sig(g) (1 + g (1 - sig(g)))
__device__ __forceinline__ void swiglu_grads(float d, float g, float u, float& dg, float& du) {
  const float sg = 1.f / (1.f + expf(-g));
  dg = d * u * sg * (1.f + g * (1.f - sg));
  du = d * g * sg;
}

template <typename T>
struct SwigluForward {
  RowPtr<T> out;
  RowPtr<const T> gate, up;
  template <int K, bool kAmax>
  __device__ void apply(int64_t row, int64_t col, uint32_t& m) const {
    float g[K], u[K], o[K];
    load_vec<K>(gate.at(row, col), g);
    load_vec<K>(up.at(row, col), u);
#pragma unroll
    for (int k = 0; k < K; ++k) o[k] = swiglu_value(g[k], u[k]);
    store_vec<K>(out.at(row, col), o);
    fp8_tile::amax_add_stored<T, kAmax>(m, o);
  }
};

template <typename T>
struct SwigluBackward {
  RowPtr<T> dgate, dup;
  RowPtr<const T> dout, gate, up;
  template <int K, bool kAmax>
  __device__ void apply(int64_t row, int64_t col, uint32_t& m) const {
    float d[K], g[K], u[K], dg[K], du[K];
    load_vec<K>(dout.at(row, col), d);
    load_vec<K>(gate.at(row, col), g);
    load_vec<K>(up.at(row, col), u);
#pragma unroll
    for (int k = 0; k < K; ++k) swiglu_grads(d[k], g[k], u[k], dg[k], du[k]);
    store_vec<K>(dgate.at(row, col), dg);
    store_vec<K>(dup.at(row, col), du);
    fp8_tile::amax_add_stored<T, kAmax>(m, dg);
    fp8_tile::amax_add_stored<T, kAmax>(m, du);
  }
};

constexpr int kThreads = 256;

// Rows blockIdx.y, blockIdx.y + gridDim.y, ...; in each, the groups of K
// columns grid-strided over x, then the cols % K tail one column per thread.
// kAmax: the block's max |output| ends in one atomicMax on *amax.
template <int K, bool kAmax, typename Op>
__global__ void __launch_bounds__(kThreads) rows_kernel(Op op, int64_t rows, int64_t cols, float* amax) {
  const int64_t xstride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t x0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = cols / K;
  uint32_t m = 0;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t v = x0; v < nvec; v += xstride) op.template apply<K, kAmax>(r, v * K, m);
    for (int64_t c = nvec * K + x0; c < cols; c += xstride) op.template apply<1, kAmax>(r, c, m);
  }
  if constexpr (kAmax) fp8_tile::block_amax_to(fp8_tile::amax_value(m), amax);
}

// One operand seen as [rows, cols] with row stride ld: fold_rows for 2+
// dims; a 1-D tensor (contiguous) is one row.
struct Operand {
  const Tensor* t;
  RowMatrix m;
};

Operand operand(const Tensor& t, const char* what) {
  check_device(t, what);
  if (t.ndim <= 1) {
    LOOM_CHECK(t.is_contiguous(), what, ": a 1-D operand must be contiguous, got ", t.shape_str(), " stride ",
               t.stride[0]);
    const int64_t n = t.numel();
    return {&t, RowMatrix{1, n, n}};
  }
  return {&t, fold_rows(t, what)};
}

bool is_packed(const RowMatrix& m) { return m.rows <= 1 || m.ld == m.cols; }

// The common [rows, cols] of the operands (the first one's), and whether the
// call is one flat row: every operand packed, equal element counts (so a
// packed [N, f] and a flat [N f] mix, as before row views existed).
struct Shape {
  int64_t rows = 0, cols = 0;
  bool flat = true;
};

template <size_t N>
Shape common_shape(const Operand (&ops)[N], const char* const (&what)[N], DType dtype) {
  Shape s{ops[0].m.rows, ops[0].m.cols, true};
  for (size_t i = 0; i < N; ++i) {
    LOOM_CHECK(ops[i].t->dtype == dtype, what[i], " is ", dtype_name(ops[i].t->dtype), ", ", what[0], " is ",
               dtype_name(dtype));
    if (!is_packed(ops[i].m) || ops[i].m.rows * ops[i].m.cols != s.rows * s.cols) s.flat = false;
  }
  if (s.flat) return s;
  for (size_t i = 0; i < N; ++i)
    LOOM_CHECK(ops[i].m.rows == s.rows && ops[i].m.cols == s.cols, what[i], " is [", ops[i].m.rows, ", ",
               ops[i].m.cols, "] (shape ", ops[i].t->shape_str(), ", row stride ", ops[i].m.ld, "), ", what[0],
               " is [", s.rows, ", ", s.cols, "]");
  return s;
}

template <typename T>
RowPtr<T> row_ptr(const Operand& o, bool flat) {
  return {static_cast<T*>(o.t->data), flat ? 0 : o.m.ld};  // a flat call has one row: its stride is never used
}

// Every base pointer aligned for K-element packed accesses and, unless the
// call is one flat row, every row stride a multiple of K (each row's start
// stays aligned).
template <typename T, int K, size_t N>
bool can_pack(const Operand (&ops)[N], bool flat) {
  for (const Operand& o : ops) {
    if (!aligned_bytes(o.t->data, K * sizeof(T))) return false;
    if (!flat && o.m.ld % K != 0) return false;
  }
  return true;
}

template <int K, typename Op>
void launch_rows(const Op& op, const Shape& s, bool vectorise, cudaStream_t stream, const char* name, float* amax) {
  LOOM_CHECK(amax == nullptr || aligned_bytes(amax, 4), name, ": amax at ", static_cast<const void*>(amax),
             " is not a device float");
  const int64_t rows = s.flat ? 1 : s.rows, cols = s.flat ? s.rows * s.cols : s.cols;
  if (rows == 0 || cols == 0) return;
  const int k = vectorise ? K : 1;
  const int64_t per_row = (cols + k - 1) / k;
  const int threads = row_threads(per_row, kThreads);
  const unsigned gx = grid_for(per_row, threads);
  // Enough rows in flight to fill the GPU (grid_for's block budget), within
  // CUDA's grid.y limit; each block strides over the remaining rows.
  int64_t gy = kMaxGridBlocks / static_cast<int64_t>(gx);
  if (gy > rows) gy = rows;
  if (gy > 65535) gy = 65535;
  if (gy < 1) gy = 1;
  const dim3 grid(gx, static_cast<unsigned>(gy));
  if (amax != nullptr) {
    if (vectorise) rows_kernel<K, true><<<grid, threads, 0, stream>>>(op, rows, cols, amax);
    else rows_kernel<1, true><<<grid, threads, 0, stream>>>(op, rows, cols, amax);
  } else {
    if (vectorise) rows_kernel<K, false><<<grid, threads, 0, stream>>>(op, rows, cols, nullptr);
    else rows_kernel<1, false><<<grid, threads, 0, stream>>>(op, rows, cols, nullptr);
  }
  LOOM_CUDA_LAUNCH_CHECK(name, "rows=", rows, " cols=", cols, " K=", k, " grid=(", gx, ",", gy, ") threads=", threads,
                         s.flat ? " flat" : " row-strided", amax != nullptr ? " amax" : "");
}

// ---- writing the FP8 operand ----------------------------------------------------

// v rounded to bf16, as a float (what the bf16 kernel stores, read back exactly).
__device__ __forceinline__ float bf16_value(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// 8 bf16 (one 16-byte load) as floats: the bits moved up, exact.
__device__ __forceinline__ void unpack8(const uint4& r, float (&v)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(w[k] << 16);
    v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
  }
}

// Where a tile kernel writes: q [rows, ldq] (ldq = outputs x cols) and q_t [ldq, rows].
struct Fp8Dest {
  uint8_t* q;
  uint8_t* qt;
  int64_t ldq;
  const float* scale;
  float* amax;
};

// The tiles of [rows, cols] SwiGLU columns, grid-stride; registers capped for
// 4 (forward) or 3 (backward) resident blocks an SM, so that enough loads are
// in flight to keep the memory busy. Forward: one output,
// silu(g) u, at q's column c. Backward: two, dgate at column c and dup at
// column cols + c. rows and cols are multiples of 16, so a thread's 4 rows x 8
// columns lie wholly inside or wholly outside the matrix.
template <fp8::Format F, bool kBackward>
__global__ void __launch_bounds__(fp8_tile::kThreads, kBackward ? 3 : 4)
    swiglu_fp8_kernel(const bf16* __restrict__ dout, int64_t ldd, const bf16* __restrict__ gate,
                      const bf16* __restrict__ up, int64_t ldg, int64_t rows, int64_t cols, int64_t tiles_c,
                      int64_t tiles, Fp8Dest o) {
  __shared__ fp8_tile::Shared sh;
  const float s = *o.scale;
  const fp8_tile::Lane ln = fp8_tile::lane();
  uint32_t m = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const fp8_tile::TilePos p = fp8_tile::tile_pos(t, tiles_c, ln, rows, cols);
    const int64_t r0 = p.r0, c0 = p.c0, r = p.r, c = p.c;
    const bool live = p.live;
    // Codes, as fp8_tile::encode lays them out: forward wa = out; backward wa = dgate, wb = dup.
    uint32_t wa[4][2] = {}, wb[4][2] = {};
    if (live) {
      // Every load of the 4 rows first (16 bytes each, 8 or 12 in flight),
      // then the math a row at a time, encoded at once (few registers live).
      uint4 gr[4], ur[4], dr[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        gr[i] = *reinterpret_cast<const uint4*>(gate + (r + i) * ldg + c);
        ur[i] = *reinterpret_cast<const uint4*>(up + (r + i) * ldg + c);
        if constexpr (kBackward) dr[i] = *reinterpret_cast<const uint4*>(dout + (r + i) * ldd + c);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float g[8], u[8], va[8], vb[8];
        unpack8(gr[i], g);
        unpack8(ur[i], u);
        if constexpr (kBackward) {
          float d[8];
          unpack8(dr[i], d);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float dg, du;
            swiglu_grads(d[j], g[j], u[j], dg, du);
            va[j] = bf16_value(dg);
            vb[j] = bf16_value(du);
            fp8_tile::amax_add(m, va[j]);
            fp8_tile::amax_add(m, vb[j]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            va[j] = bf16_value(swiglu_value(g[j], u[j]));
            fp8_tile::amax_add(m, va[j]);
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wa[i][h] = fp8_tile::encode4<F>(va[4 * h] * s, va[4 * h + 1] * s, va[4 * h + 2] * s, va[4 * h + 3] * s);
          if constexpr (kBackward)
            wb[i][h] = fp8_tile::encode4<F>(vb[4 * h] * s, vb[4 * h + 1] * s, vb[4 * h + 2] * s, vb[4 * h + 3] * s);
        }
      }
    }
    const int64_t rows_left = rows - r0, cols_left = cols - c0;
    if (live && o.q != nullptr) fp8_tile::store_rows(o.q + r * o.ldq + c, o.ldq, wa);
    fp8_tile::store_transposed<true>(sh, ln, wa, o.qt + c0 * rows + r0, rows, rows_left, cols_left);
    if constexpr (kBackward) {
      if (live && o.q != nullptr) fp8_tile::store_rows(o.q + r * o.ldq + cols + c, o.ldq, wb);
      fp8_tile::store_transposed<true>(sh, ln, wb, o.qt + (cols + c0) * rows + r0, rows, rows_left, cols_left);
    }
  }
  if (o.amax != nullptr) fp8_tile::block_amax_to(fp8_tile::amax_value(m), o.amax);
}

// The checks and the launch of both *_fp8 entry points: dout (backward only),
// gate and up bf16 [rows, f] row views; q [rows, outputs f] and q_t
// [outputs f, rows] contiguous FP8 of one format.
void launch_swiglu_fp8(bool backward, const Tensor& q, const Tensor& q_t, const Tensor* dout, const Tensor& gate,
                       const Tensor& up, const float* scale, float* amax, cudaStream_t stream, const char* fn) {
  const Operand g = operand(gate, "swiglu_fp8 gate"), u = operand(up, "swiglu_fp8 up");
  const int64_t rows = g.m.rows, cols = g.m.cols, outputs = backward ? 2 : 1;
  const char* tails = backward ? "the gate_up projection's gradient" : "the down projection's input";
  LOOM_CHECK(gate.dtype == DType::bf16 && up.dtype == DType::bf16 && (dout == nullptr || dout->dtype == DType::bf16),
             fn, ": gate, up", backward ? " and dout" : "", " must be bf16 (the FP8 recipes' activations), got ",
             dtype_name(gate.dtype), ", ", dtype_name(up.dtype), dout != nullptr ? ", " : "",
             dout != nullptr ? dtype_name(dout->dtype) : "");
  LOOM_CHECK(u.m.rows == rows && u.m.cols == cols && u.m.ld == g.m.ld, fn, ": up is [", u.m.rows, ", ", u.m.cols,
             "] with row stride ", u.m.ld, ", gate [", rows, ", ", cols, "] with row stride ", g.m.ld,
             " (the two halves of one packed gate_up buffer, or two tensors of one layout)");
  RowMatrix d{rows, cols, cols};
  if (dout != nullptr) {
    d = operand(*dout, "swiglu_fp8 dout").m;
    LOOM_CHECK(d.rows == rows && d.cols == cols, fn, ": dout is [", d.rows, ", ", d.cols, "], gate [", rows, ", ",
               cols, "]");
  }
  LOOM_CHECK(rows % 16 == 0 && cols % 16 == 0, fn, ": [", rows, ", ", cols,
             "] SwiGLU columns: rows and columns must be multiples of 16 (the FP8 GEMMs' own multiple, which ", tails,
             " has when the recipe hands it out in FP8)");
  const bool packed = aligned_bytes(gate.data, 16) && aligned_bytes(up.data, 16) && g.m.ld % 8 == 0 &&
                      (dout == nullptr || (aligned_bytes(dout->data, 16) && d.ld % 8 == 0));
  LOOM_CHECK(packed, fn, ": gate, up", backward ? " and dout" : "",
             " must start 16-byte aligned with row strides that are multiples of 8 elements (row strides ", g.m.ld,
             backward ? ", " : "", backward ? std::to_string(d.ld) : std::string(), ")");
  fp8_tile::check_fp8_dest(fn, q, q_t, rows, outputs * cols, scale, amax);
  if (rows == 0) return;
  const int64_t tiles_c = (cols + fp8_tile::kCols - 1) / fp8_tile::kCols;
  const int64_t tiles = (rows + fp8_tile::kRows - 1) / fp8_tile::kRows * tiles_c;
  const Fp8Dest o{static_cast<uint8_t*>(q.data), q_t.ptr<uint8_t>(), outputs * cols, scale, amax};
  const bf16* dp = dout != nullptr ? dout->ptr<const bf16>() : nullptr;
  auto go = [&](auto fmt, auto bwd) {
    constexpr fp8::Format F = decltype(fmt)::value;
    constexpr bool B = decltype(bwd)::value;
    const unsigned grid = fp8_tile::grid_for_tiles(tiles, fp8_tile::blocks_per_sm<swiglu_fp8_kernel<F, B>>(fn), fn);
    swiglu_fp8_kernel<F, B><<<grid, fp8_tile::kThreads, 0, stream>>>(
        dp, d.ld, gate.ptr<const bf16>(), up.ptr<const bf16>(), g.m.ld, rows, cols, tiles_c, tiles, o);
    LOOM_CUDA_LAUNCH_CHECK(fn, " rows=", rows, " cols=", cols, " ld=", g.m.ld, " tiles=", tiles, " grid=", grid);
  };
  using E4 = std::integral_constant<fp8::Format, fp8::Format::e4m3>;
  using E5 = std::integral_constant<fp8::Format, fp8::Format::e5m2>;
  if (q_t.dtype == DType::e4m3) {
    if (backward) go(E4{}, std::true_type{});
    else go(E4{}, std::false_type{});
  } else {
    if (backward) go(E5{}, std::true_type{});
    else go(E5{}, std::false_type{});
  }
}

}  // namespace

void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up, cudaStream_t stream, float* amax) {
  static const char* const what[] = {"swiglu_forward out", "swiglu_forward gate", "swiglu_forward up"};
  const Operand ops[] = {operand(out, what[0]), operand(gate, what[1]), operand(up, what[2])};
  const Shape s = common_shape(ops, what, out.dtype);
  dispatch_float(out.dtype, "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const SwigluForward<T> op{row_ptr<T>(ops[0], s.flat), row_ptr<const T>(ops[1], s.flat),
                              row_ptr<const T>(ops[2], s.flat)};
    launch_rows<K>(op, s, can_pack<T, K>(ops, s.flat), stream, "swiglu_forward", amax);
  });
}

void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up,
                     cudaStream_t stream, float* amax) {
  static const char* const what[] = {"swiglu_backward dout", "swiglu_backward dgate", "swiglu_backward dup",
                                     "swiglu_backward gate", "swiglu_backward up"};
  const Operand ops[] = {operand(dout, what[0]), operand(dgate, what[1]), operand(dup, what[2]),
                         operand(gate, what[3]), operand(up, what[4])};
  const Shape s = common_shape(ops, what, dout.dtype);
  dispatch_float(dout.dtype, "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const SwigluBackward<T> op{row_ptr<T>(ops[1], s.flat), row_ptr<T>(ops[2], s.flat),
                               row_ptr<const T>(ops[0], s.flat), row_ptr<const T>(ops[3], s.flat),
                               row_ptr<const T>(ops[4], s.flat)};
    launch_rows<K>(op, s, can_pack<T, K>(ops, s.flat), stream, "swiglu_backward", amax);
  });
}

void swiglu_forward_fp8(const Tensor& q, const Tensor& q_t, const Tensor& gate, const Tensor& up, const float* scale,
                        float* amax, cudaStream_t stream) {
  launch_swiglu_fp8(false, q, q_t, nullptr, gate, up, scale, amax, stream, "swiglu_forward_fp8");
}

void swiglu_backward_fp8(const Tensor& q, const Tensor& q_t, const Tensor& dout, const Tensor& gate, const Tensor& up,
                         const float* scale, float* amax, cudaStream_t stream) {
  launch_swiglu_fp8(true, q, q_t, &dout, gate, up, scale, amax, stream, "swiglu_backward_fp8");
}

}  // namespace loom::gpu
