// Tensor views. A Tensor never owns memory: it points into an Arena (or a
// caller's buffer). Shapes are row-major with explicit element strides so that
// views into fused buffers (e.g. Q/K/V inside one QKV activation) need no copy.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "loom/dtype.hpp"
#include "loom/error.hpp"

namespace loom {

struct Tensor {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};  // in elements

  Tensor() = default;
  Tensor(void* p, DType t, Device d, std::initializer_list<int64_t> dims) : data(p), dtype(t), device(d) {
    LOOM_CHECK(dims.size() <= static_cast<size_t>(kMaxDims), "tensor with ", dims.size(), " dims");
    for (int64_t s : dims) shape[ndim++] = s;
    set_contiguous();
  }
  void set_contiguous() {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; --i) { stride[i] = s; s *= shape[i]; }
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t size(int i) const { return shape[i < 0 ? ndim + i : i]; }
  bool is_contiguous() const {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; --i) { if (shape[i] != 1 && stride[i] != s) return false; s *= shape[i]; }
    return true;
  }
  template <typename T> T* ptr() const { return static_cast<T*>(data); }
  std::string shape_str() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) s += (i ? "," : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

// A tensor seen as a row-major matrix [rows, cols] with row stride `ld`: the
// leading dims fold into rows, which needs each of them to step over whole
// rows of the next (e.g. an [B, S, H] activation, or a view of every row of a
// wider fused buffer). GEMM wrappers use it to pass strided views without a copy.
struct RowMatrix {
  int64_t rows = 0, cols = 0, ld = 0;
};

// Throws loom::Error, prefixed with the `what` parts ("precision fp32: ",
// "layer.0.q_proj", ": x"), when the tensor has fewer than 2 dims, a
// non-contiguous last dim, leading dims that do not fold into rows, or
// overlapping rows. The parts are only joined into a message on failure, so
// GEMM wrappers call this on every GEMM without building strings.
template <typename... What>
RowMatrix fold_rows(const Tensor& t, const What&... what) {
  LOOM_CHECK(t.ndim >= 2, what..., " must have at least 2 dims, got shape ", t.shape_str());
  const int last = t.ndim - 1;
  LOOM_CHECK(t.stride[last] == 1 || t.shape[last] == 1, what..., " must be contiguous in its last dim, got stride ",
             t.stride[last], " for shape ", t.shape_str());
  RowMatrix m;
  m.cols = t.shape[last];
  m.ld = t.stride[last - 1];
  m.rows = 1;
  for (int i = 0; i < last; ++i) m.rows *= t.shape[i];
  for (int i = 0; i + 1 < last; ++i)
    LOOM_CHECK(t.shape[i] == 1 || t.stride[i] == t.stride[i + 1] * t.shape[i + 1], what..., " of shape ",
               t.shape_str(), " has a dim ", i, " stride ", t.stride[i], " that does not fold into rows (need ",
               t.stride[i + 1] * t.shape[i + 1], ")");
  if (m.rows <= 1) m.ld = m.ld > m.cols ? m.ld : m.cols;  // a single row's stride is irrelevant
  LOOM_CHECK(m.ld >= m.cols, what..., " rows overlap: row stride ", m.ld, " < ", m.cols, " columns (shape ",
             t.shape_str(), ")");
  return m;
}

// A view of `dims` elements starting `offset` elements into a flat tensor.
inline Tensor view(const Tensor& flat, int64_t offset, std::initializer_list<int64_t> dims) {
  Tensor t(static_cast<char*>(flat.data) + offset * static_cast<int64_t>(dtype_size(flat.dtype)), flat.dtype,
           flat.device, dims);
  LOOM_CHECK(offset >= 0 && offset + t.numel() <= flat.numel(), "view [", offset, ", ", offset + t.numel(),
             ") outside a tensor of ", flat.numel(), " elements");
  return t;
}

}  // namespace loom
