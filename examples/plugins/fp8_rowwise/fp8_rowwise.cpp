// "fp8_rowwise": torchao's rowwise FP8 recipe as a third-party precision
// plugin, built out of tree against the installed Loom SDK (loom/*.hpp and
// the public ops of loom/ops/: the per-row casts and the cuBLASLt plan cache).
//
// Every GEMM operand is scaled per row of its k-major view, each row from its
// own amax over the contracted dim (axiswise scaling), all in E4M3 with
// power-of-two scales (torchao's Float8LinearRecipeName.ROWWISE):
//   fprop  y  = x W^T  : x per row (token),      W per row (output feature)
//   dgrad  dx = dy W   : dy per row (token),     W per column (input feature)
//   wgrad  dW = dy^T x : dy per column (output), x per column (input)
// so there is no scaling state at all (nothing to checkpoint, nothing to
// reduce across ranks): every scale comes from the tensor being cast.
//
// CPU (run.device = "cpu"): emulated as the built-in FP8 recipes are: each
// operand is cast with ops::fp8_cast_rowwise_host / fp8_cast_colwise_host and
// decoded back (decode(q) / scale, exact with power-of-two scales), then the
// product runs in fp32 through loom/cpu_gemm.hpp. Everything is fp32.
// CUDA (run.device = "cuda", a Loom built with CUDA): bf16 parameters and
// activations, fp32 master, gradients and AdamW state (the bf16 recipe's
// layout); the casts are gpu::fp8_cast_rowwise / fp8_cast_colwise and the
// products one cuBLASLt call each with outer-vector scales
// (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, GemmScale::outer), fp32 D for
// dW. A call whose rows or features are not multiples of 16 (cuBLASLt's FP8
// kernels need them) runs in bf16, and so does the LM head unless
// lm_head = "fp8" (as the built-in FP8 recipes keep it).
//
// Keys of its [precision] table: plugin, path, lm_head ("high" | "fp8"),
// pow2_scales (true), gemm_algo ("auto" | "heuristic" | "fastest", CUDA),
// master ("fp32" | "bf16": bf16 parameters, gradients and AdamW state without
// an fp32 copy, CUDA only; the built-in FP8 recipes' key).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/cpu_gemm.hpp"
#include "loom/error.hpp"
#include "loom/fp8.hpp"
#include "loom/gemm_algo.hpp"
#include "loom/ops/fp8_rowwise.hpp"
#include "loom/precision.hpp"
#ifdef FP8_ROWWISE_GPU
#include <cuda_runtime_api.h>

#include "loom/ops/gemm.hpp"
#endif

namespace fp8_rowwise {
namespace {

using loom::DType;
using loom::Device;
using loom::ExecContext;
using loom::LinearDesc;
using loom::RowMatrix;
using loom::Tensor;

constexpr const char* kName = "fp8_rowwise";

// Decodes codes q of an operand cast per row (scale_inv per row) into y
// [rows, cols] (row stride cols); with `transposed`, q is the per-column cast's
// [cols, rows] and y gets it back in x's orientation.
void decode(const uint8_t* q, const float* scale_inv, int64_t rows, int64_t cols, bool transposed, float* y) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      y[r * cols + c] = transposed ? loom::fp8::decode(q[c * rows + r], loom::fp8::Format::e4m3) * scale_inv[c]
                                   : loom::fp8::decode(q[r * cols + c], loom::fp8::Format::e4m3) * scale_inv[r];
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

class RowwisePrecision final : public loom::Precision {
 public:
  explicit RowwisePrecision(const loom::PluginInit& init) : device_(init.device) {
    const auto& t = init.config;
    lm_head_fp8_ = t.get_choice("lm_head", "high", {"high", "fp8"}) == "fp8";
    opt_.pow2_scales = t.get_bool("pow2_scales", true);
    algo_ = loom::read_gemm_algo(t, init.deterministic);
    master_bf16_ = t.get_choice("master", "fp32", {"fp32", "bf16"}) == "bf16";
    t.finish();
    LOOM_CHECK(!master_bf16_ || device_ == Device::cuda, "precision ", kName,
               ": master = \"bf16\" (bf16 parameters, gradients and AdamW state) is for run.device = \"cuda\"; the "
               "CPU emulation keeps everything in fp32");
#ifndef FP8_ROWWISE_GPU
    LOOM_CHECK(device_ == Device::cpu, "precision ", kName, ": run.device = \"", loom::device_name(device_),
               "\" but this build of the plugin has no CUDA path (the Loom SDK it was built against has none); set "
               "run.device = \"cpu\"");
#endif
  }

  loom::PrecisionDTypes dtypes() const override {
    if (device_ == Device::cpu) return {DType::f32, DType::f32, DType::f32, DType::f32, DType::f32, false};
    // master = "bf16": the bf16_pure layout (no fp32 copy), as the built-in FP8 recipes' key.
    if (master_bf16_) return {DType::bf16, DType::bf16, DType::bf16, DType::bf16, DType::bf16, false};
    return {DType::bf16, DType::f32, DType::f32, DType::f32, DType::bf16, true};
  }

  int register_linear(const LinearDesc& d) override {
    LOOM_CHECK(d.in > 0 && d.out > 0 && d.max_rows >= 0, "precision ", kName, ": linear '", d.name,
               "' has invalid shape in=", d.in, " out=", d.out, " max_rows=", d.max_rows);
    linears_.push_back(d);
    const int64_t m = std::max<int64_t>(d.max_rows, 1), wide = std::max(d.in, d.out);
    max_act_ = std::max(max_act_, m * wide);
    max_w_ = std::max(max_w_, d.in * d.out);
    max_vec_ = std::max({max_vec_, m, wide});
    return static_cast<int>(linears_.size()) - 1;
  }

  void setup(const loom::PrecisionSetup& s) override {
    LOOM_CHECK(s.device == device_, "precision ", kName, ": set up for ", loom::device_name(s.device),
               " but created for ", loom::device_name(device_));
    if (device_ != Device::cpu) return;
    // The CPU emulation's scratch, once: a step allocates nothing.
    codes_.resize(static_cast<size_t>(std::max(max_act_, max_w_)));
    sinv_.resize(static_cast<size_t>(max_vec_));
    a_.resize(static_cast<size_t>(max_act_));
    b_.resize(static_cast<size_t>(std::max(max_act_, max_w_)));
  }

  // CUDA: the plan cache's workspace, then the codes of two operands, then four scale vectors.
  size_t workspace_bytes() const override {
#ifdef FP8_ROWWISE_GPU
    if (device_ == Device::cuda)
      return align256(loom::ops::GemmPlans::kWorkspaceBytes + loom::ops::GemmPlans::kScaleSlotBytes) +
             2 * align256(static_cast<size_t>(max_act_)) + align256(static_cast<size_t>(max_w_)) +
             4 * align256(static_cast<size_t>(max_vec_) * sizeof(float));
#endif
    return 0;
  }
  void set_workspace(void* ptr, size_t bytes) override {
    LOOM_CHECK(bytes >= workspace_bytes(), "precision ", kName, ": a workspace of ", bytes, " bytes, ",
               workspace_bytes(), " needed");
    ws_ = static_cast<char*>(ptr);
  }

  void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                      const Tensor* residual) override {
    const LinearDesc& d = lookup(ctx, id);
    const RowMatrix mx = matrix(x, d, "x", d.in), my = matrix(y, d, "y", d.out);
    weight(w, d, "w");
    LOOM_CHECK(my.rows == mx.rows && mx.rows <= std::max<int64_t>(d.max_rows, mx.rows), "precision ", kName, ": ",
               d.name, ": y has ", my.rows, " rows but x has ", mx.rows);
    if (residual != nullptr) {
      const RowMatrix mr = matrix(*residual, d, "residual", d.out);
      LOOM_CHECK(mr.rows == my.rows, "precision ", kName, ": ", d.name, ": the residual has ", mr.rows,
                 " rows, y ", my.rows);
    }
    if (mx.rows == 0) return;
#ifdef FP8_ROWWISE_GPU
    if (device_ == Device::cuda) return gpu_forward(ctx, d, x, w, y, residual, mx.rows);
#endif
    const int64_t m = mx.rows;
    float* yp = y.ptr<float>();
    if (residual != nullptr && residual->data != y.data) {
      const RowMatrix mr = loom::fold_rows(*residual, "residual");
      const float* r = residual->ptr<const float>();
      for (int64_t i = 0; i < m; ++i) std::copy(r + i * mr.ld, r + i * mr.ld + d.out, yp + i * my.ld);
    }
    if (!fp8(d)) {
      loom::cpu::linear_forward(yp, my.ld, x.ptr<const float>(), mx.ld, w.ptr<const float>(), m, d.in, d.out,
                                residual != nullptr);
      return;
    }
    rows_qdq(x.ptr<const float>(), m, d.in, mx.ld, a_.data());            // x per token
    rows_qdq(w.ptr<const float>(), d.out, d.in, d.in, b_.data());         // W per output feature
    loom::cpu::linear_forward(yp, my.ld, a_.data(), d.in, b_.data(), m, d.in, d.out, residual != nullptr);
  }

  void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                       Tensor& dw, bool accumulate) override {
    const LinearDesc& d = lookup(ctx, id);
    const RowMatrix mx = matrix(x, d, "x", d.in), mdy = matrix(dy, d, "dy", d.out);
    weight(w, d, "w");
    weight(dw, d, "dw");
    LOOM_CHECK(mdy.rows == mx.rows, "precision ", kName, ": ", d.name, ": dy has ", mdy.rows, " rows but x has ",
               mx.rows);
    RowMatrix mdx{};
    if (dx != nullptr) {
      mdx = matrix(*dx, d, "dx", d.in);
      LOOM_CHECK(mdx.rows == mx.rows, "precision ", kName, ": ", d.name, ": dx has ", mdx.rows, " rows but x has ",
                 mx.rows);
    }
    const int64_t m = mx.rows;
#ifdef FP8_ROWWISE_GPU
    if (device_ == Device::cuda) return gpu_backward(ctx, d, x, w, dy, dx, dw, accumulate, m);
#endif
    if (m == 0) {
      if (!accumulate) std::fill_n(dw.ptr<float>(), d.out * d.in, 0.0f);
      return;
    }
    const float* xp = x.ptr<const float>();
    const float* dyp = dy.ptr<const float>();
    if (!fp8(d)) {
      if (dx != nullptr)
        loom::cpu::linear_backward_input(dx->ptr<float>(), mdx.ld, dyp, mdy.ld, w.ptr<const float>(), m, d.in, d.out);
      loom::cpu::linear_backward_weight(dw.ptr<float>(), dyp, mdy.ld, xp, mx.ld, m, d.in, d.out, accumulate);
      return;
    }
    if (dx != nullptr) {
      rows_qdq(dyp, m, d.out, mdy.ld, a_.data());                    // dy per token
      cols_qdq(w.ptr<const float>(), d.out, d.in, d.in, b_.data());  // W per input feature (over out)
      loom::cpu::linear_backward_input(dx->ptr<float>(), mdx.ld, a_.data(), d.out, b_.data(), m, d.in, d.out);
    }
    cols_qdq(dyp, m, d.out, mdy.ld, a_.data());  // dy per output feature (over tokens)
    cols_qdq(xp, m, d.in, mx.ld, b_.data());     // x per input feature (over tokens)
    loom::cpu::linear_backward_weight(dw.ptr<float>(), a_.data(), d.out, b_.data(), d.in, m, d.in, d.out, accumulate);
  }

 private:
  bool fp8(const LinearDesc& d) const { return lm_head_fp8_ || d.role != loom::LinearRole::lm_head; }

  // x [rows, cols] (row stride ld) -> its per-row FP8 values, packed [rows, cols].
  void rows_qdq(const float* x, int64_t rows, int64_t cols, int64_t ld, float* y) {
    loom::ops::fp8_cast_rowwise_host(x, rows, cols, ld, opt_, codes_.data(), sinv_.data());
    decode(codes_.data(), sinv_.data(), rows, cols, false, y);
  }
  // x [rows, cols] -> its per-column FP8 values, packed [rows, cols].
  void cols_qdq(const float* x, int64_t rows, int64_t cols, int64_t ld, float* y) {
    loom::ops::fp8_cast_colwise_host(x, rows, cols, ld, opt_, codes_.data(), sinv_.data());
    decode(codes_.data(), sinv_.data(), rows, cols, true, y);
  }

  const LinearDesc& lookup(const ExecContext& ctx, int id) const {
    LOOM_CHECK(ctx.device == device_, "precision ", kName, ": called with a ", loom::device_name(ctx.device),
               " context; this object was created for ", loom::device_name(device_));
    LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision ", kName, ": linear id ", id,
               " was never registered (", linears_.size(), " linears registered)");
    LOOM_CHECK(device_ == Device::cpu ? codes_.size() > 0 || max_act_ == 0 : ws_ != nullptr, "precision ", kName,
               ": a GEMM before setup() and set_workspace()");
    return linears_[static_cast<size_t>(id)];
  }
  RowMatrix matrix(const Tensor& t, const LinearDesc& d, const char* what, int64_t cols) const {
    const DType want = dtypes().activation;
    LOOM_CHECK(t.data != nullptr && t.dtype == want && t.device == device_, "precision ", kName, ": ", d.name, ": ",
               what, " must be a ", loom::dtype_name(want), " tensor on ", loom::device_name(device_), ", got ",
               loom::dtype_name(t.dtype), " on ", loom::device_name(t.device));
    const RowMatrix m = loom::fold_rows(t, "precision fp8_rowwise: ", d.name, ": ", what);
    LOOM_CHECK(m.cols == cols, "precision ", kName, ": ", d.name, ": ", what, " has ", m.cols, " columns, expected ",
               cols);
    LOOM_CHECK(d.max_rows == 0 || m.rows <= d.max_rows, "precision ", kName, ": ", d.name, ": ", what, " has ",
               m.rows, " rows, more than the max_rows=", d.max_rows, " it was registered with");
    return m;
  }
  void weight(const Tensor& t, const LinearDesc& d, const char* what) const {
    const DType want = what[1] == 'w' ? dtypes().grad : dtypes().param;  // "dw" or "w"
    LOOM_CHECK(t.data != nullptr && t.dtype == want && t.device == device_ && t.ndim == 2 && t.shape[0] == d.out &&
                   t.shape[1] == d.in && t.is_contiguous(),
               "precision ", kName, ": ", d.name, ": ", what, " must be a contiguous ", loom::dtype_name(want),
               " [out, in] = [", d.out, ", ", d.in, "] on ", loom::device_name(device_), ", got ",
               loom::dtype_name(t.dtype), " ", t.shape_str(), " on ", loom::device_name(t.device));
  }

#ifdef FP8_ROWWISE_GPU
  // cuBLASLt's FP8 kernels take multiples of 16 in every dim.
  bool gpu_fp8(const LinearDesc& d, int64_t rows) const { return fp8(d) && rows % 16 == 0 && d.in % 16 == 0 && d.out % 16 == 0; }

  struct Scratch {
    char* a;      // codes of x or dy (x^T in wgrad): activation-sized
    char* b;      // codes of the weight (W or W^T)
    char* c;      // codes of dy^T in wgrad: activation-sized
    float* s[4];  // scale, scale_inv of the first operand; then of the second
  };
  Scratch scratch() const {
    char* p = ws_ + align256(loom::ops::GemmPlans::kWorkspaceBytes + loom::ops::GemmPlans::kScaleSlotBytes);
    Scratch s{};
    s.a = p;
    p += align256(static_cast<size_t>(max_act_));
    s.c = p;
    p += align256(static_cast<size_t>(max_act_));
    s.b = p;
    p += align256(static_cast<size_t>(max_w_));
    for (float*& v : s.s) {
      v = reinterpret_cast<float*>(p);
      p += align256(static_cast<size_t>(max_vec_) * sizeof(float));
    }
    return s;
  }
  loom::ops::GemmPlans& plans(const ExecContext& ctx) {
    if (!plans_) {
      plans_ = std::make_unique<loom::ops::GemmPlans>(
          ctx.blas_handle, ws_, loom::ops::GemmPlans::kWorkspaceBytes + loom::ops::GemmPlans::kScaleSlotBytes, algo_);
    }
    plans_->set_handle(ctx.blas_handle);
    return *plans_;
  }
  void run(const ExecContext& ctx, const LinearDesc& d, loom::ops::GemmArgs& g, loom::ops::GemmVarying v,
           const char* what) {
    if (d.variable_rows) {
      g.varying = v;
      g.varying_max = d.max_rows;
    }
    g.what = what;
    plans(ctx).gemm(g, ctx.stream);
  }
  static loom::ops::GemmOperand outer(const Tensor& q, const float* scale_inv) {
    return {&q, true, loom::ops::GemmScale::outer, scale_inv};
  }

  void gpu_forward(const ExecContext& ctx, const LinearDesc& d, const Tensor& x, const Tensor& w, Tensor& y,
                   const Tensor* residual, int64_t m) {
    loom::ops::GemmArgs g;
    g.d = &y;
    g.c = residual;
    g.beta = residual != nullptr ? 1.0f : 0.0f;
    if (!gpu_fp8(d, m)) {
      g.a = {&x, true};
      g.b = {&w, true};
      return run(ctx, d, g, loom::ops::GemmVarying::m, "fp8_rowwise: fprop (bf16)");
    }
    const Scratch s = scratch();
    Tensor qx(s.a, DType::e4m3, Device::cuda, {m, d.in}), qw(s.b, DType::e4m3, Device::cuda, {d.out, d.in});
    loom::gpu::fp8_cast_rowwise(x, qx, s.s[0], s.s[1], opt_, ctx.stream);
    loom::gpu::fp8_cast_rowwise(w, qw, s.s[2], s.s[3], opt_, ctx.stream);
    g.a = outer(qx, s.s[1]);
    g.b = outer(qw, s.s[3]);
    run(ctx, d, g, loom::ops::GemmVarying::m, "fp8_rowwise: fprop");
  }

  void gpu_backward(const ExecContext& ctx, const LinearDesc& d, const Tensor& x, const Tensor& w, const Tensor& dy,
                    Tensor* dx, Tensor& dw, bool accumulate, int64_t m) {
    if (m == 0) {
      if (!accumulate) {
        const cudaError_t e = cudaMemsetAsync(dw.data, 0, dw.bytes(), static_cast<cudaStream_t>(ctx.stream));
        LOOM_CHECK(e == cudaSuccess, "precision ", kName, ": ", d.name, ": cudaMemsetAsync(dw, 0, ", dw.bytes(),
                   ") failed: ", cudaGetErrorName(e));
      }
      return;
    }
    const bool f8 = gpu_fp8(d, m);
    const Scratch s = scratch();
    if (dx != nullptr) {
      loom::ops::GemmArgs g;
      g.d = dx;
      if (!f8) {
        g.a = {&dy, true};
        g.b = {&w, false};
        run(ctx, d, g, loom::ops::GemmVarying::m, "fp8_rowwise: dgrad (bf16)");
      } else {
        Tensor qdy(s.a, DType::e4m3, Device::cuda, {m, d.out}), qwt(s.b, DType::e4m3, Device::cuda, {d.in, d.out});
        loom::gpu::fp8_cast_rowwise(dy, qdy, s.s[0], s.s[1], opt_, ctx.stream);
        loom::gpu::fp8_cast_colwise(w, qwt, s.s[2], s.s[3], opt_, ctx.stream);
        g.a = outer(qdy, s.s[1]);
        g.b = outer(qwt, s.s[3]);
        run(ctx, d, g, loom::ops::GemmVarying::m, "fp8_rowwise: dgrad");
      }
    }
    loom::ops::GemmArgs g;
    g.d = &dw;
    g.beta = accumulate ? 1.0f : 0.0f;
    if (!f8) {
      g.a = {&dy, false};
      g.b = {&x, false};
      return run(ctx, d, g, loom::ops::GemmVarying::k, "fp8_rowwise: wgrad (bf16)");
    }
    // Both [features, tokens]: activation-sized, so into the two activation
    // buffers (dgrad, queued before on the same stream, is done with s.a).
    Tensor qdyt(s.c, DType::e4m3, Device::cuda, {d.out, m}), qxt(s.a, DType::e4m3, Device::cuda, {d.in, m});
    loom::gpu::fp8_cast_colwise(dy, qdyt, s.s[0], s.s[1], opt_, ctx.stream);
    loom::gpu::fp8_cast_colwise(x, qxt, s.s[2], s.s[3], opt_, ctx.stream);
    g.a = outer(qdyt, s.s[1]);
    g.b = outer(qxt, s.s[3]);
    run(ctx, d, g, loom::ops::GemmVarying::k, "fp8_rowwise: wgrad");
  }

  std::unique_ptr<loom::ops::GemmPlans> plans_;
#endif

  Device device_;
  bool lm_head_fp8_ = false;
  bool master_bf16_ = false;
  loom::ops::RowwiseOptions opt_;
  loom::GemmAlgo algo_ = loom::GemmAlgo::heuristic;
  std::vector<LinearDesc> linears_;
  int64_t max_act_ = 0, max_w_ = 0, max_vec_ = 0;  // codes of an activation, of a weight; longest scale vector
  // CPU scratch (setup()): codes, inverse scales, two decoded operands.
  std::vector<uint8_t> codes_;
  std::vector<float> sinv_, a_, b_;
  char* ws_ = nullptr;  // CUDA workspace
};

}  // namespace
}  // namespace fp8_rowwise

using fp8_rowwise::RowwisePrecision;
LOOM_PLUGIN(precision, RowwisePrecision, "fp8_rowwise", "1.0.0",
            "FP8 with per-row scales (torchao's rowwise: x and dy per token, W per output feature; per column for "
            "dgrad's W and wgrad), E4M3, power-of-two scales; cuBLASLt outer-vector scaled GEMMs on CUDA, emulated "
            "on the CPU")
