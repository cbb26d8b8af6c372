// dtype conversion on the GPU: fp32 -> bf16 rounds to nearest even (NaN stays
// NaN), bf16 -> fp32 is exact; equal dtypes are a device copy.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

template <typename TD, typename TS>
struct ConvertOp {
  TD* dst;
  const TS* src;
  template <int K>
  __device__ void apply(int64_t i) const {
    float v[K];
    load_vec<K>(src + i, v);
    store_vec<K>(dst + i, v);
  }
};

}  // namespace

void convert(Tensor& dst, const Tensor& src, cudaStream_t stream) {
  check_device(dst, "convert dst");
  check_device(src, "convert src");
  check_contiguous(dst, "convert dst");
  check_contiguous(src, "convert src");
  LOOM_CHECK(dst.numel() == src.numel(), "convert ", src.shape_str(), " -> ", dst.shape_str());
  if (dst.dtype == src.dtype) {
    if (dst.data != src.data && src.bytes() > 0)
      LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, stream),
                      "convert copy of ", src.bytes(), " bytes");
    return;
  }
  LOOM_CHECK(dst.data != src.data, "convert between ", dtype_name(src.dtype), " and ", dtype_name(dst.dtype),
             " cannot run in place");
  dispatch_float(dst.dtype, "convert dst", [&](auto td) {
    dispatch_float(src.dtype, "convert src", [&](auto ts) {
      using TD = decltype(td);
      using TS = decltype(ts);
      constexpr int K = vec_width<TD, TS>();
      const bool vec = aligned_bytes(dst.data, K * sizeof(TD)) && aligned_bytes(src.data, K * sizeof(TS));
      launch_elementwise<K>(ConvertOp<TD, TS>{dst.ptr<TD>(), src.ptr<TS>()}, dst.numel(), vec, stream, "convert");
    });
  });
}

}  // namespace loom::gpu
