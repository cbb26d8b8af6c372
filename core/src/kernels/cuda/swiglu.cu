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
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

// One operand: its base pointer and row stride (elements).
template <typename P>
struct RowPtr {
  P* p;
  int64_t ld;
  __device__ __forceinline__ P* at(int64_t row, int64_t col) const { return p + row * ld + col; }
};

template <typename T>
struct SwigluForward {
  RowPtr<T> out;
  RowPtr<const T> gate, up;
  template <int K>
  __device__ void apply(int64_t row, int64_t col) const {
    float g[K], u[K], o[K];
    load_vec<K>(gate.at(row, col), g);
    load_vec<K>(up.at(row, col), u);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float sg = 1.f / (1.f + expf(-g[k]));
      o[k] = g[k] * sg * u[k];
    }
    store_vec<K>(out.at(row, col), o);
  }
};

// d silu(g)/dg = sig(g) (1 + g (1 - sig(g)))
template <typename T>
struct SwigluBackward {
  RowPtr<T> dgate, dup;
  RowPtr<const T> dout, gate, up;
  template <int K>
  __device__ void apply(int64_t row, int64_t col) const {
    float d[K], g[K], u[K], dg[K], du[K];
    load_vec<K>(dout.at(row, col), d);
    load_vec<K>(gate.at(row, col), g);
    load_vec<K>(up.at(row, col), u);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float sg = 1.f / (1.f + expf(-g[k]));
      dg[k] = d[k] * u[k] * sg * (1.f + g[k] * (1.f - sg));
      du[k] = d[k] * g[k] * sg;
    }
    store_vec<K>(dgate.at(row, col), dg);
    store_vec<K>(dup.at(row, col), du);
  }
};

constexpr int kThreads = 256;

// Rows blockIdx.y, blockIdx.y + gridDim.y, ...; in each, the groups of K
// columns grid-strided over x, then the cols % K tail one column per thread.
template <int K, typename Op>
__global__ void __launch_bounds__(kThreads) rows_kernel(Op op, int64_t rows, int64_t cols) {
  const int64_t xstride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t x0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = cols / K;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t v = x0; v < nvec; v += xstride) op.template apply<K>(r, v * K);
    for (int64_t c = nvec * K + x0; c < cols; c += xstride) op.template apply<1>(r, c);
  }
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
void launch_rows(const Op& op, const Shape& s, bool vectorise, cudaStream_t stream, const char* name) {
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
  if (vectorise) rows_kernel<K><<<grid, threads, 0, stream>>>(op, rows, cols);
  else rows_kernel<1><<<grid, threads, 0, stream>>>(op, rows, cols);
  LOOM_CUDA_LAUNCH_CHECK(name, "rows=", rows, " cols=", cols, " K=", k, " grid=(", gx, ",", gy, ") threads=", threads,
                         s.flat ? " flat" : " row-strided");
}

}  // namespace

void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up, cudaStream_t stream) {
  static const char* const what[] = {"swiglu_forward out", "swiglu_forward gate", "swiglu_forward up"};
  const Operand ops[] = {operand(out, what[0]), operand(gate, what[1]), operand(up, what[2])};
  const Shape s = common_shape(ops, what, out.dtype);
  dispatch_float(out.dtype, "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const SwigluForward<T> op{row_ptr<T>(ops[0], s.flat), row_ptr<const T>(ops[1], s.flat),
                              row_ptr<const T>(ops[2], s.flat)};
    launch_rows<K>(op, s, can_pack<T, K>(ops, s.flat), stream, "swiglu_forward");
  });
}

void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up,
                     cudaStream_t stream) {
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
    launch_rows<K>(op, s, can_pack<T, K>(ops, s.flat), stream, "swiglu_backward");
  });
}

}  // namespace loom::gpu
