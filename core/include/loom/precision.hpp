// Precision plugins own storage dtypes and every GEMM (DESIGN.md).
//
// Linear layers follow HF: weight W is [out, in] row-major, y = x W^T.
// The core registers every linear once at start-up (register_linear) and then
// calls forward/backward with the returned id, so a recipe can keep per-GEMM
// state (cached descriptors, fp8 scales and amax history).
#pragma once
#include <cstdint>
#include <string>

#include "loom/context.hpp"
#include "loom/plugin.hpp"
#include "loom/tensor.hpp"

namespace loom {

struct PrecisionDTypes {
  DType param;        // parameters as the GEMMs read them
  DType master;       // master copy updated by the optimizer (== param when has_master is false)
  DType grad;         // gradient buffers
  DType optim_state;  // AdamW m and v
  DType activation;   // activations between ops
  bool has_master;    // a separate master copy exists
  bool stochastic_rounding = false;  // round updated params stochastically (recipes without a master)
};

struct LinearDesc {
  std::string name;   // "layer.3.q_proj"
  int64_t in = 0;     // k
  int64_t out = 0;    // n
  int64_t max_rows = 0;  // m: tokens per micro-batch (rows of x)
  // The row count changes from call to call, up to max_rows (a MoE expert gets
  // the rows its router sends it): a recipe should not build a GEMM plan per
  // row count (the cuBLASLt recipes plan once, for max_rows, and check that
  // plan's algorithm for each new count).
  bool variable_rows = false;
};

class Precision : public Plugin {
 public:
  virtual PrecisionDTypes dtypes() const = 0;
  // Called once per linear before the first step; returns its id.
  virtual int register_linear(const LinearDesc& desc) = 0;
  // Workspace the recipe needs on the device (bytes), known after all linears are registered.
  virtual size_t workspace_bytes() const { return 0; }
  virtual void set_workspace(void* /*ptr*/, size_t /*bytes*/) {}
  // y[m, out] = x[m, in] * W[out, in]^T (+ residual[m, out] when residual is not null).
  // The residual is the GEMM's C input with beta = 1 (cuBLASLt epilogue), so a
  // fused layer adds the residual stream in the same pass that writes y; it has
  // y's dtype and shape, may be a row view, and may be y itself.
  virtual void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                              const Tensor* residual) = 0;
  // dx[m, in] = dy[m, out] * W   (skipped when dx is null)
  // dW[out, in] = dy^T x, added to dW when accumulate is true (micro-batches), else written.
  virtual void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy,
                               Tensor* dx, Tensor& dw, bool accumulate) = 0;
  // Once per optimizer step, after the update (scale/amax bookkeeping).
  virtual void end_step(const ExecContext& /*ctx*/) {}
  // Recipe state to checkpoint (scales, amax history); opaque bytes.
  virtual std::string save_state() const { return {}; }
  virtual void load_state(const std::string& /*state*/) {}
};

template <> struct PluginInterface<PluginKind::precision> { using type = Precision; };

}  // namespace loom
