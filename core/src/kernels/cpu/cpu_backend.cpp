// The CPU backend: Tensor-level checks, then the fp32 reference kernels.
#include <omp.h>

#include <chrono>
#include <cstring>

#include "kernels/cpu/cpu_kernels.hpp"
#include "loom/error.hpp"
#include "model/backend.hpp"

namespace loom {
namespace {

float* f32(const Tensor& t, const char* what) {
  LOOM_CHECK(t.device == Device::cpu, what, ": tensor is on ", device_name(t.device), ", the CPU backend needs host memory");
  LOOM_CHECK(t.dtype == DType::f32, what, ": the CPU backend computes in fp32, got ", dtype_name(t.dtype));
  return static_cast<float*>(t.data);
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) {
    if (threads > 0) omp_set_num_threads(threads);
    ctx_.device = Device::cpu;
  }
  Device device() const override { return Device::cpu; }
  const ExecContext& ctx() const override { return ctx_; }

  void upload(Tensor& dst, const void* host, size_t bytes) override {
    LOOM_CHECK(bytes <= dst.bytes(), "upload of ", bytes, " bytes into a ", dst.bytes(), "-byte tensor");
    std::memcpy(dst.data, host, bytes);
  }
  void download(void* host, const Tensor& src, size_t bytes) override {
    LOOM_CHECK(bytes <= src.bytes(), "download of ", bytes, " bytes from a ", src.bytes(), "-byte tensor");
    std::memcpy(host, src.data, bytes);
  }
  void zero(Tensor& t) override { std::memset(t.data, 0, t.bytes()); }
  void copy(Tensor& dst, const Tensor& src) override {
    LOOM_CHECK(dst.bytes() == src.bytes(), "copy ", src.shape_str(), " -> ", dst.shape_str());
    std::memcpy(dst.data, src.data, src.bytes());
  }
  void synchronize() override {}

  void embedding_forward(Tensor& out, const Tensor& tokens, const Tensor& wte) override {
    LOOM_CHECK(tokens.dtype == DType::i32, "embedding tokens must be int32");
    cpu::embedding_forward(f32(out, "embedding out"), tokens.ptr<int32_t>(), f32(wte, "wte"), tokens.numel(), wte.size(1));
  }
  void embedding_backward(Tensor& dwte, const Tensor& dout, const Tensor& tokens) override {
    cpu::embedding_backward(f32(dwte, "dwte"), f32(dout, "embedding dout"), tokens.ptr<int32_t>(), tokens.numel(),
                            dwte.size(1));
  }
  void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& x, const Tensor& w, float eps) override {
    const int64_t h = w.numel(), N = x.numel() / h;
    cpu::rmsnorm_forward(f32(out, "rmsnorm out"), f32(rstd, "rstd"), f32(x, "rmsnorm x"), f32(w, "rmsnorm w"), N, h, eps);
  }
  void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                        const Tensor& rstd) override {
    const int64_t h = w.numel(), N = x.numel() / h;
    cpu::rmsnorm_backward(f32(dx, "rmsnorm dx"), f32(dw, "rmsnorm dw"), f32(dout, "rmsnorm dout"), f32(x, "rmsnorm x"),
                          f32(w, "rmsnorm w"), f32(rstd, "rstd"), N, h);
  }
  void rope_forward(Tensor& x, double theta) override {
    LOOM_CHECK(x.ndim == 4, "rope expects [B,S,nh,D], got ", x.shape_str());
    cpu::rope_forward(f32(x, "rope x"), x.shape[0], x.shape[1], x.shape[2], x.shape[3], x.stride[1], theta);
  }
  void rope_backward(Tensor& dx, double theta) override {
    LOOM_CHECK(dx.ndim == 4, "rope expects [B,S,nh,D], got ", dx.shape_str());
    cpu::rope_backward(f32(dx, "rope dx"), dx.shape[0], dx.shape[1], dx.shape[2], dx.shape[3], dx.stride[1], theta);
  }
  void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up) override {
    cpu::swiglu_forward(f32(out, "swiglu out"), f32(gate, "gate"), f32(up, "up"), out.numel());
  }
  void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) override {
    cpu::swiglu_backward(f32(dgate, "dgate"), f32(dup, "dup"), f32(dout, "swiglu dout"), f32(gate, "gate"),
                         f32(up, "up"), dout.numel());
  }
  void add(Tensor& out, const Tensor& a, const Tensor& b) override {
    cpu::residual_forward(f32(out, "add out"), f32(a, "add a"), f32(b, "add b"), out.numel());
  }
  void accumulate(Tensor& dst, const Tensor& src) override {
    cpu::accumulate(f32(dst, "accumulate dst"), f32(src, "accumulate src"), dst.numel());
  }
  void cross_entropy(Tensor& logits, const Tensor& targets, Tensor& losses, float dlogits_scale) override {
    // The CPU kernel returns the sum; per-row losses are what the interface promises,
    // so compute row by row (rows are independent; N calls of one row each).
    const int64_t V = logits.size(-1), N = logits.numel() / V;
    float* lg = f32(logits, "logits");
    float* out = f32(losses, "losses");
    const int32_t* tg = targets.ptr<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      out[n] = static_cast<float>(cpu::cross_entropy(lg + n * V, tg + n, 1, V, dlogits_scale));
  }
  double sum(const Tensor& x) override {
    const float* p = f32(x, "sum");
    double s = 0;
    for (int64_t i = 0; i < x.numel(); ++i) s += p[i];
    return s;
  }
  double sq_norm(const Tensor& x, int64_t begin, int64_t end) override {
    LOOM_CHECK(0 <= begin && begin <= end && end <= x.numel(), "sq_norm range [", begin, ",", end, ") of ", x.numel());
    return cpu::sq_norm(f32(x, "sq_norm") + begin, end - begin);
  }
  void scale(Tensor& x, float s) override { cpu::scale(f32(x, "scale"), s, x.numel()); }
  void adamw(Tensor& param, Tensor* master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWArgs& a) override {
    LOOM_CHECK(master == nullptr && !a.stochastic_rounding,
               "the CPU backend runs the fp32 recipe: no master copy, no stochastic rounding");
    LOOM_CHECK(param.numel() == grad.numel() && grad.numel() == m.numel() && m.numel() == v.numel(),
               "adamw sizes differ: param ", param.numel(), " grad ", grad.numel(), " m ", m.numel(), " v ", v.numel());
    cpu::adamw(f32(param, "param"), f32(grad, "grad"), f32(m, "adam m"), f32(v, "adam v"), param.numel(), a.lr,
               a.beta1, a.beta2, a.eps, a.weight_decay, a.step, a.grad_scale);
  }
  void convert(Tensor& dst, const Tensor& src) override {
    LOOM_CHECK(dst.numel() == src.numel(), "convert ", src.shape_str(), " -> ", dst.shape_str());
    f32(dst, "convert dst");
    f32(src, "convert src");
    if (dst.data != src.data) std::memcpy(dst.data, src.data, src.bytes());
  }
  void timer_start() override { t0_ = std::chrono::steady_clock::now(); }
  double timer_stop_ms() override {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  ExecContext ctx_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads) { return std::make_unique<CpuBackend>(threads); }

#ifndef LOOM_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw Error(
      "run.device = \"cuda\": this build of loom has no CUDA backend (configure with -DLOOM_WITH_CUDA=ON on a "
      "machine with the CUDA toolkit), or set run.device = \"cpu\"");
}
bool cuda_available() { return false; }
int cuda_device_for_rank(int, int) { return 0; }
#endif

}  // namespace loom
