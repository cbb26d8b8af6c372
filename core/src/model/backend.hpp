// Backend: the element-wise and normalisation ops of the model, on Tensors.
//
// Dtypes (the precision recipe decides; see loom/precision.hpp):
//   activations (x, out, dout, dx, logits, q/k/v, gate/up): the recipe's activation dtype (fp32 or bf16)
//   parameters (w, wte): the param dtype (fp32 or bf16); parameter gradients (dw, dwte): the grad dtype
//   rstd, losses, stats: always fp32. Every op accumulates in fp32.
// Combinations a backend must support: (act, param, grad) = (f32, f32, f32), (bf16, bf16, f32), (bf16, bf16, bf16).
// The model (llama.cpp) is written once against this interface; the CPU
// backend calls the fp32 reference kernels in kernels/cpu, the CUDA backend
// (kernels/cuda) the device kernels. GEMMs and attention are not here: they
// belong to the precision and attention plugins.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "loom/context.hpp"
#include "loom/tensor.hpp"

namespace loom {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual const ExecContext& ctx() const = 0;
  virtual int device_index() const { return -1; }  // the CUDA device, -1 on CPU

  // Host <-> backend memory.
  virtual void upload(Tensor& dst, const void* host, size_t bytes) = 0;
  virtual void download(void* host, const Tensor& src, size_t bytes) = 0;
  virtual void zero(Tensor& t) = 0;
  virtual void copy(Tensor& dst, const Tensor& src) = 0;
  // Wait for queued work (CUDA: stream sync; CPU: nothing). Only at step boundaries.
  virtual void synchronize() = 0;

  virtual void embedding_forward(Tensor& out, const Tensor& tokens, const Tensor& wte) = 0;
  virtual void embedding_backward(Tensor& dwte, const Tensor& dout, const Tensor& tokens) = 0;  // +=
  virtual void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& x, const Tensor& w, float eps) = 0;
  // dx += ..., dw += ...
  virtual void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                                const Tensor& rstd) = 0;
  // x: [B, S, nh, D] view (row stride x.stride[1]); in place.
  virtual void rope_forward(Tensor& x, double theta) = 0;
  virtual void rope_backward(Tensor& dx, double theta) = 0;
  // Build whatever RoPE needs for (seq, head_dim, theta) now, at start-up, so
  // the step allocates nothing (the CUDA backend's cos/sin table).
  virtual void prepare_rope(int64_t /*seq*/, int64_t /*head_dim*/, double /*theta*/) {}
  virtual void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up) = 0;
  virtual void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate,
                               const Tensor& up) = 0;
  virtual void add(Tensor& out, const Tensor& a, const Tensor& b) = 0;  // out may alias a
  virtual void accumulate(Tensor& dst, const Tensor& src) = 0;          // dst += src
  // Fused softmax cross-entropy over logits [N, V]: per-row loss into losses[N] (fp32)
  // and, when dlogits_scale != 0, the logits gradient written over the logits.
  virtual void cross_entropy(Tensor& logits, const Tensor& targets, Tensor& losses, float dlogits_scale) = 0;
  // Sum of a fp32 vector (synchronises).
  virtual double sum(const Tensor& x) = 0;
  // Sum of squares of x[begin, end) (synchronises).
  virtual double sq_norm(const Tensor& x, int64_t begin, int64_t end) = 0;
  virtual void scale(Tensor& x, float s) = 0;
  // AdamW on flat ranges of equal length (see cpu_kernels.hpp for the update):
  //   with a master (fp32): master is updated, then param = round(master) in param's dtype;
  //   without: param itself is updated in fp32 arithmetic and rounded back to its dtype
  //   (stochastically when a.stochastic_rounding: bf16_pure's option).
  // grad: fp32 or bf16; m, v: fp32 or bf16.
  struct AdamWArgs {
    float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
    int64_t step = 1;        // 1-based, for bias correction
    float grad_scale = 1;    // applied to grad first (clipping, averaging)
    bool stochastic_rounding = false;
    uint64_t seed = 0;       // stochastic rounding: a pure function of (seed, step, element index)
  };
  virtual void adamw(Tensor& param, Tensor* master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWArgs& a) = 0;
  // dst = src converted (fp32 <-> bf16, or a copy when equal); same element count.
  virtual void convert(Tensor& dst, const Tensor& src) = 0;

  // Step timing: CUDA events on the backend's stream (host clock on CPU).
  virtual void timer_start() = 0;
  virtual double timer_stop_ms() = 0;  // synchronises
  // Bytes of device memory in use by the whole process (cudaMemGetInfo), 0 on CPU.
  virtual size_t device_memory_used() const { return 0; }
  // The device's name ("NVIDIA H100 80GB HBM3", "cpu").
  virtual std::string device_name() const { return "cpu"; }
  // Named ranges for profilers (NVTX on CUDA, so nsys/ncu show every layer and op).
  virtual void range_push(const char* /*name*/) {}
  virtual void range_pop() {}
};

std::unique_ptr<Backend> make_cpu_backend(int threads);
// Defined in kernels/cuda when built with CUDA: one stream, a cuBLASLt handle
// (ExecContext::blas_handle), the device chosen by `device_index`.
std::unique_ptr<Backend> make_cuda_backend(int device_index);
bool cuda_available();  // a CUDA device is present and usable (false in builds without CUDA)
// The GPU of the rank with this node-local rank (one GPU per rank); throws when there is none.
int cuda_device_for_rank(int local_rank, int local_world);

}  // namespace loom
