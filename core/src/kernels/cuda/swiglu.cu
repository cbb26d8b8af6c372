// SwiGLU on the GPU: out = silu(gate) * up, silu(g) = g * sigmoid(g).
// Element-wise, packed loads, fp32 math (expf, not the fast __expf, so the
// fp32 path matches the CPU reference to ~1e-7).
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

template <typename T>
struct SwigluForward {
  T* out;
  const T* gate;
  const T* up;
  template <int K>
  __device__ void apply(int64_t i) const {
    float g[K], u[K], o[K];
    load_vec<K>(gate + i, g);
    load_vec<K>(up + i, u);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float sg = 1.f / (1.f + expf(-g[k]));
      o[k] = g[k] * sg * u[k];
    }
    store_vec<K>(out + i, o);
  }
};

// d silu(g)/dg = sig(g) (1 + g (1 - sig(g)))
template <typename T>
struct SwigluBackward {
  T* dgate;
  T* dup;
  const T* dout;
  const T* gate;
  const T* up;
  template <int K>
  __device__ void apply(int64_t i) const {
    float d[K], g[K], u[K], dg[K], du[K];
    load_vec<K>(dout + i, d);
    load_vec<K>(gate + i, g);
    load_vec<K>(up + i, u);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float sg = 1.f / (1.f + expf(-g[k]));
      dg[k] = d[k] * u[k] * sg * (1.f + g[k] * (1.f - sg));
      du[k] = d[k] * g[k] * sg;
    }
    store_vec<K>(dgate + i, dg);
    store_vec<K>(dup + i, du);
  }
};

void check_same(const Tensor& a, const Tensor& b, const char* what) {
  check_device(a, what);
  check_device(b, what);
  check_contiguous(a, what);
  check_contiguous(b, what);
  LOOM_CHECK(a.dtype == b.dtype && a.numel() == b.numel(), what, ": ", dtype_name(a.dtype), a.shape_str(), " vs ",
             dtype_name(b.dtype), b.shape_str());
}

}  // namespace

void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up, cudaStream_t stream) {
  check_same(out, gate, "swiglu_forward out/gate");
  check_same(out, up, "swiglu_forward out/up");
  dispatch_float(out.dtype, "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const size_t a = K * sizeof(T);
    const bool vec = aligned_bytes(out.data, a) && aligned_bytes(gate.data, a) && aligned_bytes(up.data, a);
    launch_elementwise<K>(SwigluForward<T>{out.ptr<T>(), gate.ptr<T>(), up.ptr<T>()}, out.numel(), vec, stream,
                          "swiglu_forward");
  });
}

void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up,
                     cudaStream_t stream) {
  check_same(dout, dgate, "swiglu_backward dout/dgate");
  check_same(dout, dup, "swiglu_backward dout/dup");
  check_same(dout, gate, "swiglu_backward dout/gate");
  check_same(dout, up, "swiglu_backward dout/up");
  dispatch_float(dout.dtype, "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const size_t a = K * sizeof(T);
    const bool vec = aligned_bytes(dgate.data, a) && aligned_bytes(dup.data, a) && aligned_bytes(dout.data, a) &&
                     aligned_bytes(gate.data, a) && aligned_bytes(up.data, a);
    launch_elementwise<K>(
        SwigluBackward<T>{dgate.ptr<T>(), dup.ptr<T>(), dout.ptr<T>(), gate.ptr<T>(), up.ptr<T>()}, dout.numel(), vec,
        stream, "swiglu_backward");
  });
}

}  // namespace loom::gpu
