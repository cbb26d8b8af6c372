// The CPU backend: Tensor-level checks, then the fp32 reference kernels.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/moe.hpp"
#include "loom/error.hpp"
#include "loom/ops/backend.hpp"

namespace loom {
namespace {

float* f32(const Tensor& t, const char* what) {
  LOOM_CHECK(t.device == Device::cpu, what, ": tensor is on ", device_name(t.device), ", the CPU backend needs host memory");
  LOOM_CHECK(t.dtype == DType::f32, what, ": the CPU backend computes in fp32, got ", dtype_name(t.dtype));
  return static_cast<float*>(t.data);
}

// A [rows, cols] fp32 view with row stride ld (fold_rows), for the row-strided ops.
struct Rows {
  float* p;
  RowMatrix m;
};
Rows rows_of(const Tensor& t, const char* what) {
  float* p = f32(t, what);
  return {p, fold_rows(t, what)};
}

const int32_t* i32(const Tensor& t, const char* what) {
  LOOM_CHECK(t.device == Device::cpu && t.dtype == DType::i32, what, ": expected an int32 host tensor, got ",
             dtype_name(t.dtype), " on ", device_name(t.device));
  return static_cast<const int32_t*>(t.data);
}

// The routing's dims, checked against a tensor of h columns.
cpu::MoeDims moe_dims(const MoeRouting& r, int64_t h, int64_t f = 1) {
  cpu::MoeDims d;
  d.N = r.N;
  d.h = h;
  d.f = f;
  d.E = r.E;
  d.k = r.k;
  cpu::moe_check(d);
  LOOM_CHECK(r.row_align == 1, "moe: the CPU backend packs each expert's rows (row_align 1), got row_align ",
             r.row_align);
  return d;
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, bool deterministic) {
    if (threads > 0) omp_set_num_threads(threads);
    ctx_.device = Device::cpu;
    ctx_.deterministic = deterministic;
  }
  Device device() const override { return Device::cpu; }
  const ExecContext& ctx() const override { return ctx_; }

  // upload counts as a wait (the CUDA one waits for its copy); upload_async does not.
  void upload(Tensor& dst, const void* host, size_t bytes) override {
    ++host_syncs_;
    copy_in(dst, host, bytes);
  }
  void download(void* host, const Tensor& src, size_t bytes) override {
    LOOM_CHECK(bytes <= src.bytes(), "download of ", bytes, " bytes from a ", src.bytes(), "-byte tensor");
    ++host_syncs_;
    std::memcpy(host, src.data, bytes);
  }
  void* host_alloc(size_t bytes) override {
    void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
    LOOM_CHECK(p != nullptr, "host_alloc of ", bytes, " bytes failed");
    return p;
  }
  void host_free(void* p) override { std::free(p); }
  void upload_async(Tensor& dst, const void* host, size_t bytes) override { copy_in(dst, host, bytes); }
  void zero(Tensor& t) override { std::memset(t.data, 0, t.bytes()); }
  void copy(Tensor& dst, const Tensor& src) override {
    LOOM_CHECK(dst.bytes() == src.bytes(), "copy ", src.shape_str(), " -> ", dst.shape_str());
    std::memcpy(dst.data, src.data, src.bytes());
  }
  void synchronize() override { ++host_syncs_; }

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
  void rope_forward_at(Tensor& x, double theta, const Tensor& positions) override {
    LOOM_CHECK(x.ndim == 4, "rope expects [B,S,nh,D], got ", x.shape_str());
    cpu::rope_forward(f32(x, "rope x"), x.shape[0], x.shape[1], x.shape[2], x.shape[3], x.stride[1], theta,
                      rope_positions(positions, x));
  }
  void rope_backward_at(Tensor& dx, double theta, const Tensor& positions) override {
    LOOM_CHECK(dx.ndim == 4, "rope expects [B,S,nh,D], got ", dx.shape_str());
    cpu::rope_backward(f32(dx, "rope dx"), dx.shape[0], dx.shape[1], dx.shape[2], dx.shape[3], dx.stride[1], theta,
                       rope_positions(positions, dx));
  }
  static const int32_t* rope_positions(const Tensor& p, const Tensor& x) {
    LOOM_CHECK(p.data != nullptr && p.dtype == DType::i32 && p.device == Device::cpu &&
                   p.numel() == x.shape[0] * x.shape[1] && p.is_contiguous(),
               "rope: positions must be a contiguous int32 cpu tensor of B * S = ", x.shape[0] * x.shape[1],
               " entries, got ", dtype_name(p.dtype), " ", p.shape_str(), " on ", ::loom::device_name(p.device));
    return p.ptr<const int32_t>();
  }
  // Row by row: gate/up (and their gradients) may be the two halves of a packed gate_up buffer.
  void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up) override {
    const Rows o = rows_of(out, "swiglu out"), g = rows_of(gate, "swiglu gate"), u = rows_of(up, "swiglu up");
    check_same_rows(o, g, "swiglu gate");
    check_same_rows(o, u, "swiglu up");
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < o.m.rows; ++r)
      cpu::swiglu_forward(o.p + r * o.m.ld, g.p + r * g.m.ld, u.p + r * u.m.ld, o.m.cols);
  }
  void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) override {
    const Rows dg = rows_of(dgate, "swiglu dgate"), du = rows_of(dup, "swiglu dup"), d = rows_of(dout, "swiglu dout");
    const Rows g = rows_of(gate, "swiglu gate"), u = rows_of(up, "swiglu up");
    for (const Rows* x : {&dg, &du, &g, &u}) check_same_rows(d, *x, "swiglu operand");
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < d.m.rows; ++r)
      cpu::swiglu_backward(dg.p + r * dg.m.ld, du.p + r * du.m.ld, d.p + r * d.m.ld, g.p + r * g.m.ld,
                           u.p + r * u.m.ld, d.m.cols);
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
  // Mixture of experts: the steps of the reference (kernels/cpu/moe.hpp).
  void moe_jitter(Tensor& xin, Tensor& noise, const Tensor& x, double eps, uint64_t seed) override {
    LOOM_CHECK(xin.numel() == x.numel() && noise.numel() == x.numel(), "moe_jitter: ", xin.shape_str(), ", ",
               noise.shape_str(), " for x ", x.shape_str());
    float* nz = f32(noise, "moe noise");
    cpu::moe_jitter_noise(nz, x.numel(), eps, seed);
    cpu::moe_jitter_apply(f32(xin, "moe xin"), f32(x, "moe x"), nz, x.numel());
  }
  void moe_route(MoeRouting& r, const Tensor& xin, const Tensor& router) override {
    const cpu::MoeDims d = moe_dims(r, router.size(1));
    LOOM_CHECK(xin.numel() == d.N * d.h && router.size(0) == d.E, "moe_route: x ", xin.shape_str(), ", router ",
               router.shape_str(), " for ", d.N, " tokens and ", d.E, " experts");
    int32_t* experts = const_cast<int32_t*>(i32(r.experts, "moe experts"));
    cpu::moe_route(f32(r.logits, "moe logits"), f32(r.probs, "moe probs"), experts, f32(r.weights, "moe weights"),
                   f32(xin, "moe x"), f32(router, "moe router"), d);
    cpu::moe_sort(r.counts, r.offsets, const_cast<int32_t*>(i32(r.perm, "moe perm")),
                  const_cast<int32_t*>(i32(r.row_of, "moe row_of")), experts, d);
  }
  void moe_gather(Tensor& xs, const Tensor& xin, const MoeRouting& r) override {
    const cpu::MoeDims d = moe_dims(r, xin.size(-1));
    LOOM_CHECK(xs.numel() == d.rows() * d.h, "moe_gather: xs ", xs.shape_str(), " for ", d.rows(), " rows");
    cpu::moe_gather(f32(xs, "moe xs"), f32(xin, "moe x"), i32(r.perm, "moe perm"), d);
  }
  void moe_combine(Tensor& y, const Tensor& eout, const MoeRouting& r) override {
    const cpu::MoeDims d = moe_dims(r, y.size(-1));
    LOOM_CHECK(eout.numel() == d.rows() * d.h, "moe_combine: eout ", eout.shape_str(), " for ", d.rows(), " rows");
    cpu::moe_combine(f32(y, "moe y"), f32(eout, "moe eout"), f32(r.weights, "moe weights"),
                     i32(r.row_of, "moe row_of"), d);
  }
  void moe_combine_backward(Tensor& d_eout, Tensor& d_weights, const Tensor& dy, const Tensor& eout,
                            const MoeRouting& r) override {
    const cpu::MoeDims d = moe_dims(r, dy.size(-1));
    cpu::moe_combine_backward(f32(d_eout, "moe d_eout"), f32(d_weights, "moe d_weights"), f32(dy, "moe dy"),
                              f32(eout, "moe eout"), f32(r.weights, "moe weights"), i32(r.perm, "moe perm"), d);
  }
  void moe_route_backward(Tensor& dxin, Tensor& d_router, Tensor& d_probs, Tensor& d_logits, const Tensor& d_weights,
                          const Tensor& xin, const Tensor& router, const MoeRouting& r,
                          const Tensor* aux_dprobs) override {
    const cpu::MoeDims d = moe_dims(r, router.size(1));
    cpu::moe_route_backward(f32(dxin, "moe dx"), f32(d_router, "moe d_router"), f32(d_probs, "moe d_probs"),
                            f32(d_logits, "moe d_logits"), f32(d_weights, "moe d_weights"), f32(xin, "moe x"),
                            f32(router, "moe router"), f32(r.probs, "moe probs"), i32(r.experts, "moe experts"),
                            f32(r.weights, "moe weights"), aux_dprobs ? f32(*aux_dprobs, "moe aux dprobs") : nullptr,
                            d);
  }
  void moe_scatter_add(Tensor& dx, const Tensor& d_xs, const MoeRouting& r, const Tensor* noise) override {
    const cpu::MoeDims d = moe_dims(r, dx.size(-1));
    cpu::moe_scatter_add(f32(dx, "moe dx"), f32(d_xs, "moe d_xs"), i32(r.row_of, "moe row_of"),
                         noise ? f32(*noise, "moe noise") : nullptr, d);
  }
  void moe_aux_accumulate(Tensor& stats, const MoeRouting& r) override {
    LOOM_CHECK(stats.dtype == DType::f64 && stats.numel() == 2 * r.E + 1, "moe aux statistics: expected fp64 [",
               2 * r.E + 1, "], got ", dtype_name(stats.dtype), " ", stats.shape_str());
    cpu::moe_aux_accumulate_flat(static_cast<double*>(stats.data), f32(r.probs, "moe probs"),
                                 i32(r.experts, "moe experts"), moe_dims(r, 1));
  }
  void moe_aux_finish(Tensor& aux, Tensor& dprobs, const Tensor& stats, double coef, double grad_scale) override {
    const int64_t E = dprobs.numel();
    LOOM_CHECK(stats.dtype == DType::f64 && stats.numel() == 2 * E + 1, "moe aux statistics: expected fp64 [",
               2 * E + 1, "], got ", dtype_name(stats.dtype), " ", stats.shape_str());
    const double* st = static_cast<const double*>(stats.data);
    f32(aux, "moe aux")[0] = static_cast<float>(cpu::moe_aux_loss_flat(st, E));
    cpu::moe_aux_grad_flat(f32(dprobs, "moe aux dprobs"), st, E, coef * grad_scale);
  }

  double sum(const Tensor& x) override {
    ++host_syncs_;
    const float* p = f32(x, "sum");
    double s = 0;
    for (int64_t i = 0; i < x.numel(); ++i) s += p[i];
    return s;
  }
  double sq_norm(const Tensor& x, int64_t begin, int64_t end) override {
    ++host_syncs_;
    LOOM_CHECK(0 <= begin && begin <= end && end <= x.numel(), "sq_norm range [", begin, ",", end, ") of ", x.numel());
    return cpu::sq_norm(f32(x, "sq_norm") + begin, end - begin);
  }
  void sum_into(Tensor& acc, const Tensor& x, int64_t begin, int64_t end, bool square) override {
    LOOM_CHECK(acc.dtype == DType::f64 && acc.numel() >= 1 && acc.device == Device::cpu,
               "sum_into: the accumulator must be a host f64 scalar, got ", dtype_name(acc.dtype), acc.shape_str());
    LOOM_CHECK(0 <= begin && begin <= end && end <= x.numel(), "sum_into range [", begin, ",", end, ") of ",
               x.numel());
    const float* p = f32(x, "sum_into") + begin;
    double s = 0;
    if (square) s = cpu::sq_norm(p, end - begin);
    else
      for (int64_t i = 0; i < end - begin; ++i) s += p[i];
    acc.ptr<double>()[0] += s;
  }
  void clip_scale(Tensor& scalars, float grad_scale, float clip_norm) override {
    LOOM_CHECK(scalars.dtype == DType::f64 && scalars.numel() >= kStepScalars, "clip_scale: scalars must be f64[",
               kStepScalars, "], got ", dtype_name(scalars.dtype), scalars.shape_str());
    double* s = scalars.ptr<double>();
    const double norm = std::sqrt(s[kNormSq]) * grad_scale;
    s[kGradNorm] = norm;
    s[kSkip] = std::isfinite(norm) ? 0.0 : 1.0;
    double coef = 1.0;
    if (clip_norm > 0 && std::isfinite(norm)) {
      const double c = clip_norm / (norm + 1e-6);
      if (c < 1.0) coef = c;
    }
    // fp32 as the kernels apply it, so CPU and CUDA scale identically.
    s[kUpdateScale] = static_cast<double>(static_cast<float>(grad_scale * coef));
  }
  void scale(Tensor& x, float s) override { cpu::scale(f32(x, "scale"), s, x.numel()); }
  void adamw(Tensor& param, Tensor* master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWArgs& a) override {
    LOOM_CHECK(master == nullptr && !a.stochastic_rounding,
               "the CPU backend runs the fp32 recipe: no master copy, no stochastic rounding");
    LOOM_CHECK(param.numel() == grad.numel() && grad.numel() == m.numel() && m.numel() == v.numel(),
               "adamw sizes differ: param ", param.numel(), " grad ", grad.numel(), " m ", m.numel(), " v ", v.numel());
    float scale = a.grad_scale;
    const bool skip = a.scalars && a.scalars[kSkip] != 0.0;  // a non-finite step: nothing changes
    if (a.scalars) scale *= static_cast<float>(a.scalars[kUpdateScale]);
    if (!skip)
      cpu::adamw(f32(param, "param"), f32(grad, "grad"), f32(m, "adam m"), f32(v, "adam v"), param.numel(), a.lr,
                 a.beta1, a.beta2, a.eps, a.weight_decay, a.step, scale);
    // Consumed: the next step starts from zero gradients (a skipped step's are dropped).
    if (a.consume_grad) std::memset(grad.data, 0, grad.bytes());
  }
  void convert(Tensor& dst, const Tensor& src) override {
    LOOM_CHECK(dst.numel() == src.numel(), "convert ", src.shape_str(), " -> ", dst.shape_str());
    f32(dst, "convert dst");
    f32(src, "convert src");
    if (dst.data != src.data) std::memcpy(dst.data, src.data, src.bytes());
  }
  void timer_start() override { t0_ = std::chrono::steady_clock::now(); }
  double timer_stop_ms() override {
    ++host_syncs_;
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  }
  void timestamp(Tensor& dst) override {
    LOOM_CHECK(dst.dtype == DType::f64 && dst.numel() >= 1, "timestamp: dst must be an f64 scalar, got ",
               dtype_name(dst.dtype), dst.shape_str());
    dst.ptr<double>()[0] =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void timer_reserve(int slots) override {
    LOOM_CHECK(slots > 0, "timer_reserve(", slots, ")");
    marks_.assign(static_cast<size_t>(slots), {});
  }
  void timer_mark(int slot) override { marks_.at(static_cast<size_t>(slot)) = std::chrono::steady_clock::now(); }
  double timer_elapsed_ms(int from, int to) override {
    ++host_syncs_;
    return std::chrono::duration<double, std::milli>(marks_.at(static_cast<size_t>(to)) -
                                                     marks_.at(static_cast<size_t>(from)))
        .count();
  }

 private:
  static void copy_in(Tensor& dst, const void* host, size_t bytes) {
    LOOM_CHECK(bytes <= dst.bytes(), "upload of ", bytes, " bytes into a ", dst.bytes(), "-byte tensor");
    std::memcpy(dst.data, host, bytes);
  }
  static void check_same_rows(const Rows& a, const Rows& b, const char* what) {
    LOOM_CHECK(a.m.rows == b.m.rows && a.m.cols == b.m.cols, what, " is [", b.m.rows, ", ", b.m.cols, "], expected [",
               a.m.rows, ", ", a.m.cols, "]");
  }
  ExecContext ctx_;
  std::chrono::steady_clock::time_point t0_;
  std::vector<std::chrono::steady_clock::time_point> marks_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads, bool deterministic) {
  return std::make_unique<CpuBackend>(threads, deterministic);
}

#ifndef LOOM_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend(int, bool) {
  throw Error(
      "run.device = \"cuda\": this build of loom has no CUDA backend (configure with -DLOOM_WITH_CUDA=ON on a "
      "machine with the CUDA toolkit), or set run.device = \"cpu\"");
}
bool cuda_available() { return false; }
int cuda_device_for_rank(int, int) { return 0; }
#endif

}  // namespace loom
