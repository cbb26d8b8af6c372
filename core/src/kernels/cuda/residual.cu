// Residual stream on the GPU: out = a + b (out may alias a: each thread reads
// its elements before it writes them), and dst += src where two gradient
// paths meet. accumulate accepts any fp32/bf16 pair (e.g. bf16 gradients
// added into an fp32 buffer); add keeps one dtype.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

template <typename T>
struct AddOp {
  T* out;
  const T* a;
  const T* b;
  template <int K>
  __device__ void apply(int64_t i) const {
    float x[K], y[K];
    load_vec<K>(a + i, x);
    load_vec<K>(b + i, y);
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] += y[k];
    store_vec<K>(out + i, x);
  }
};

template <typename TD, typename TS>
struct AccumulateOp {
  TD* dst;
  const TS* src;
  template <int K>
  __device__ void apply(int64_t i) const {
    float x[K], y[K];
    load_vec<K>(dst + i, x);
    load_vec<K>(src + i, y);
#pragma unroll
    for (int k = 0; k < K; ++k) x[k] += y[k];
    store_vec<K>(dst + i, x);
  }
};

}  // namespace

void add(Tensor& out, const Tensor& a, const Tensor& b, cudaStream_t stream) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&out, &a, &b}) {
    check_device(*t, "add");
    check_contiguous(*t, "add");
  }
  LOOM_CHECK(out.dtype == a.dtype && out.dtype == b.dtype && out.numel() == a.numel() && out.numel() == b.numel(),
             "add: out ", dtype_name(out.dtype), out.shape_str(), " a ", dtype_name(a.dtype), a.shape_str(), " b ",
             dtype_name(b.dtype), b.shape_str());
  dispatch_float(out.dtype, "add", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const size_t al = K * sizeof(T);
    const bool vec = aligned_bytes(out.data, al) && aligned_bytes(a.data, al) && aligned_bytes(b.data, al);
    launch_elementwise<K>(AddOp<T>{out.ptr<T>(), a.ptr<T>(), b.ptr<T>()}, out.numel(), vec, stream, "add");
  });
}

void accumulate(Tensor& dst, const Tensor& src, cudaStream_t stream) {
  check_device(dst, "accumulate dst");
  check_device(src, "accumulate src");
  check_contiguous(dst, "accumulate dst");
  check_contiguous(src, "accumulate src");
  LOOM_CHECK(dst.numel() == src.numel(), "accumulate: dst ", dst.shape_str(), " src ", src.shape_str());
  dispatch_float(dst.dtype, "accumulate dst", [&](auto td) {
    dispatch_float(src.dtype, "accumulate src", [&](auto ts) {
      using TD = decltype(td);
      using TS = decltype(ts);
      constexpr int K = vec_width<TD, TS>();
      const bool vec = aligned_bytes(dst.data, K * sizeof(TD)) && aligned_bytes(src.data, K * sizeof(TS));
      launch_elementwise<K>(AccumulateOp<TD, TS>{dst.ptr<TD>(), src.ptr<TS>()}, dst.numel(), vec, stream,
                            "accumulate");
    });
  });
}

}  // namespace loom::gpu
