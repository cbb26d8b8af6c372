// Backend::timestamp on the GPU: one thread reads the device's global
// nanosecond timer (%globaltimer, the clock CUDA events are timed with) when
// the stream reaches it and stores milliseconds as f64. The step writes one at
// its first and one at its last operation, and the log step reads them with
// the loss and the norm, so timing a step needs no event synchronisation.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

__global__ void timestamp_kernel(double* dst) {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  // Whole microseconds first: ns since the epoch exceed a double's 53 bits,
  // microseconds do not (a double then holds them exactly for 285 years).
  dst[0] = static_cast<double>(ns / 1000) * 1e-3 + static_cast<double>(ns % 1000) * 1e-6;
}

}  // namespace

void timestamp(Tensor& dst, cudaStream_t stream) {
  check_device(dst, "timestamp");
  LOOM_CHECK(dst.dtype == DType::f64 && dst.numel() >= 1, "timestamp: dst must be an f64 scalar, got ",
             dtype_name(dst.dtype), dst.shape_str());
  timestamp_kernel<<<1, 1, 0, stream>>>(static_cast<double*>(dst.data));
  LOOM_CUDA_LAUNCH_CHECK("timestamp_kernel", "dst=", dst.data);
}

}  // namespace loom::gpu
