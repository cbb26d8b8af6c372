// The FP8 weight gathers' casts on CUDA (fp8_gather.hpp's device_ops): the
// device casts of loom/ops/fp8_cast.hpp (fp8_amax, fp8_update_scales,
// fp8_cast, fp8_dequantize), the ones the per-tensor recipes cast with, on
// the context's stream; every runtime call checked. Built only with CUDA.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "loom/error.hpp"
#include "loom/ops/cuda_check.hpp"
#include "loom/ops/fp8_cast.hpp"
#include "precision/common/fp8_gather.hpp"

namespace loom::fp8_gather {
namespace {

void check_device(const Tensor& t, const char* what) {
  LOOM_CHECK(t.device == Device::cuda, "FP8 gathers: ", what, ": tensor ", t.shape_str(), " is on ",
             device_name(t.device), ", the CUDA path needs device memory");
  LOOM_CHECK(t.is_contiguous(), "FP8 gathers: ", what, ": tensor ", t.shape_str(), " must be contiguous");
}

float* slot(const Tensor& t, const char* what) {
  check_device(t, what);
  LOOM_CHECK(t.dtype == DType::f32 && t.numel() >= 1, "FP8 gathers: ", what, ": expected fp32, got ",
             dtype_name(t.dtype), " ", t.shape_str());
  return static_cast<float*>(t.data);
}

// A contiguous range seen as rows of up to 4096 columns, so that the cast
// kernels' 2-D tiles are full (a [1, n] view would leave all but one row of
// each tile idle).
Tensor as_rows(const Tensor& t) {
  const int64_t n = t.numel();
  int64_t c = 4096;
  while (c > 1 && n % c != 0) c /= 2;
  return Tensor(t.data, t.dtype, t.device, {n / c, c});
}

cudaStream_t stream_of(const ExecContext& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

class DeviceOps final : public Ops {
 public:
  void fill(Tensor& t, float v) override {
    float* p = slot(t, "fill");
    const std::vector<float> host(static_cast<size_t>(t.numel()), v);
    LOOM_CUDA_CHECK(cudaMemcpy(p, host.data(), t.bytes(), cudaMemcpyHostToDevice), "FP8 gathers: writing ",
                    t.numel(), " fp32 values ", v, " to ", static_cast<const void*>(p));
    LOOM_CUDA_CHECK(cudaDeviceSynchronize(), "FP8 gathers: writing ", t.numel(), " fp32 values ", v);
  }
  void zero(const ExecContext& ctx, Tensor& t) override {
    check_device(t, "zero");
    if (t.bytes() == 0) return;
    LOOM_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), stream_of(ctx)), "FP8 gathers: zero of ", t.bytes(),
                    " bytes at ", t.data);
  }
  void copy(const ExecContext& ctx, Tensor& dst, const Tensor& src) override {
    check_device(dst, "copy dst");
    check_device(src, "copy src");
    LOOM_CHECK(dst.bytes() == src.bytes(), "FP8 gathers: copy ", src.shape_str(), " (", dtype_name(src.dtype),
               ") -> ", dst.shape_str(), " (", dtype_name(dst.dtype), ")");
    if (src.bytes() == 0 || dst.data == src.data) return;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, stream_of(ctx)),
                    "FP8 gathers: copy of ", src.bytes(), " bytes from ", src.data, " to ", dst.data);
  }
  void amax(const ExecContext& ctx, Tensor& amax, const Tensor& x) override {
    check_device(x, "amax x");
    if (x.numel() > 0) gpu::fp8_amax(as_rows(x), slot(amax, "amax"), stream_of(ctx));
  }
  void scales(const ExecContext& ctx, Tensor& scale, Tensor& scale_inv, const Tensor& amax, int margin) override {
    LOOM_CHECK(scale.numel() == amax.numel() && scale_inv.numel() == amax.numel(), "FP8 gathers: scales: scale ",
               scale.shape_str(), ", scale_inv ", scale_inv.shape_str(), " and amax ", amax.shape_str(), " differ");
    gpu::fp8_update_scales(slot(amax, "scales amax"), slot(scale, "scales scale"), slot(scale_inv, "scales scale_inv"),
                           0, amax.numel(), fp8::Formats::e4m3, margin, nullptr, stream_of(ctx));
  }
  void encode(const ExecContext& ctx, Tensor& q, const Tensor& x, const Tensor& scale) override {
    check_device(x, "encode x");
    check_device(q, "encode q");
    LOOM_CHECK(q.dtype == DType::e4m3 && q.numel() == x.numel(), "FP8 gathers: encode: q ", q.shape_str(), " (",
               dtype_name(q.dtype), ") for x ", x.shape_str());
    if (x.numel() == 0) return;
    Tensor qm = as_rows(q);
    gpu::fp8_cast(as_rows(x), &qm, nullptr, slot(scale, "encode scale"), nullptr, stream_of(ctx));
  }
  void decode(const ExecContext& ctx, Tensor& y, const Tensor& q, const Tensor& scale) override {
    check_device(q, "decode q");
    check_device(y, "decode y");
    LOOM_CHECK(q.dtype == DType::e4m3 && q.numel() == y.numel(), "FP8 gathers: decode: q ", q.shape_str(), " (",
               dtype_name(q.dtype), ") for y ", y.shape_str());
    if (y.numel() == 0) return;
    gpu::fp8_dequantize(y, q, slot(scale, "decode scale"), stream_of(ctx));
  }
};

}  // namespace

std::unique_ptr<Ops> device_ops() { return std::make_unique<DeviceOps>(); }

}  // namespace loom::fp8_gather
