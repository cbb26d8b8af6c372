// The CUDA backend: owns the device resources of one rank (a non-blocking
// stream, a cuBLASLt handle for the precision plugins' GEMMs, timer events,
// a scratch buffer for reductions, the RoPE tables) and forwards each op to
// its kernels (one .cu per layer in this folder).
//
// Memory: the scratch (kScratchBytes) and a pinned result slot are allocated
// once, here at creation, never inside a step; so are the timer ring's
// events (timer_reserve), the pinned staging buffers (host_alloc) and the
// RoPE cos/sin tables (prepare_rope, when the model binds its arena; a rope
// call for an (S, D, theta) nobody prepared builds its table then, once).
//
// Host synchronisations: every call that makes the host wait for the device
// (synchronize, upload, download, sum, sq_norm, timer_stop_ms,
// timer_elapsed_ms, a RoPE table upload, moe_read_counts) counts one in host_syncs_; the
// asynchronous step's ops (upload_async, sum_into, clip_scale, adamw with
// device scalars, timer_mark) only queue work and never wait.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/moe_kernels.hpp"
#include "loom/error.hpp"
#include "loom/ops/backend.hpp"
#include "loom/ops/cuda_check.hpp"
#include "loom/precision.hpp"

namespace loom {
namespace {

// rmsnorm dw partials ([chunks <= 256, h] fp32: 16 MiB covers h = 16384 at
// full chunk count, and any h <= 4M with fewer chunks) and the norm partials.
constexpr size_t kScratchBytes = size_t{16} << 20;

void check_dev(const Tensor& t, const char* what) {
  LOOM_CHECK(t.device == Device::cuda, what, ": tensor ", t.shape_str(), " is on ", device_name(t.device),
             ", the CUDA backend needs device memory");
}

class CudaBackend final : public Backend {
 public:
  int device_index() const override { return device_index_; }
  CudaBackend(int device_index, bool deterministic) : device_index_(device_index) {
    int count = 0;
    LOOM_CUDA_CHECK(cudaGetDeviceCount(&count), "counting CUDA devices");
    LOOM_CHECK(device_index >= 0 && device_index < count, "CUDA device ", device_index, " requested but ", count,
               " device(s) are visible (CUDA_VISIBLE_DEVICES limits them)");
    LOOM_CUDA_CHECK(cudaSetDevice(device_index), "device ", device_index);
    try {
      LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "backend stream on device ",
                      device_index);
      const cublasStatus_t st = cublasLtCreate(&blas_);
      LOOM_CHECK(st == CUBLAS_STATUS_SUCCESS, "cublasLtCreate failed: ", cublasLtGetStatusName(st), " (",
                 cublasLtGetStatusString(st), ")");
      LOOM_CUDA_CHECK(cudaEventCreate(&ev_start_), "timer start event");
      LOOM_CUDA_CHECK(cudaEventCreate(&ev_stop_), "timer stop event");
      LOOM_CUDA_CHECK(cudaMalloc(&scratch_.ptr, kScratchBytes), "backend scratch of ", kScratchBytes, " bytes");
      scratch_.bytes = kScratchBytes;
      // The side queue: the optimizer beside the model. Its own scratch, so a
      // norm reduction there never shares partials with the model's.
      LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "side stream on device ",
                      device_index);
      LOOM_CUDA_CHECK(cudaMalloc(&side_scratch_.ptr, kScratchBytes), "side scratch of ", kScratchBytes, " bytes");
      side_scratch_.bytes = kScratchBytes;
      markers_.resize(kMarkers);
      for (size_t i = 0; i < markers_.size(); ++i)
        LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&markers_[i], cudaEventDisableTiming), "marker event ", i);
      LOOM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_result_), sizeof(double)),
                      "pinned reduction result");
      LOOM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_counts_), kMoeCountSlots * sizeof(int64_t)),
                      "pinned MoE expert counts (", kMoeCountSlots, " int64)");
    } catch (...) {
      release();
      throw;
    }
    ctx_.device = Device::cuda;
    ctx_.stream = stream_;
    ctx_.blas_handle = blas_;
    ctx_.deterministic = deterministic;
    side_ctx_ = ctx_;
    side_ctx_.stream = side_;
    cur_ = stream_;
  }
  ~CudaBackend() override { release(); }

  Device device() const override { return Device::cuda; }
  const ExecContext& ctx() const override { return ctx_; }
  const ExecContext& side_ctx() const override { return side_ctx_; }
  void use_side_queue(bool side) override { cur_ = side ? side_ : stream_; }
  uint64_t mark(const ExecContext& on) override {
    const uint64_t m = next_marker_++;
    cudaEvent_t e = markers_[m % markers_.size()];
    LOOM_CUDA_CHECK(cudaEventRecord(e, stream_of(on)), "marker ", m);
    return m;
  }
  void wait(const ExecContext& ctx, uint64_t marker) override {
    LOOM_CHECK(marker < next_marker_, "wait for marker ", marker, ", which was never made (", next_marker_, " so far)");
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(stream_of(ctx), markers_[marker % markers_.size()], 0), "wait for marker ",
                    marker);
  }

  // The host buffer may be reused as soon as upload returns (pinned or not),
  // so the copy is waited for; uploads are per step (tokens) or at start-up.
  void upload(Tensor& dst, const void* host, size_t bytes) override {
    check_dev(dst, "upload");
    LOOM_CHECK(bytes <= dst.bytes(), "upload of ", bytes, " bytes into a ", dst.bytes(), "-byte tensor");
    ++host_syncs_;  // per call, like download
    if (bytes == 0) return;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.data, host, bytes, cudaMemcpyHostToDevice, stream_), "upload of ", bytes,
                    " bytes");
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_), "upload of ", bytes, " bytes");
  }
  void download(void* host, const Tensor& src, size_t bytes) override {
    check_dev(src, "download");
    LOOM_CHECK(bytes <= src.bytes(), "download of ", bytes, " bytes from a ", src.bytes(), "-byte tensor");
    ++host_syncs_;  // counted even when empty, as on the CPU: the count is per call
    if (bytes == 0) return;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(host, src.data, bytes, cudaMemcpyDeviceToHost, stream_), "download of ", bytes,
                    " bytes");
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_), "download of ", bytes, " bytes");
  }
  void zero(Tensor& t) override {
    check_dev(t, "zero");
    LOOM_CHECK(t.is_contiguous(), "zero: tensor ", t.shape_str(), " must be contiguous");
    if (t.bytes() == 0) return;
    LOOM_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), cur_), "zero of ", t.bytes(), " bytes");
  }
  void copy(Tensor& dst, const Tensor& src) override {
    check_dev(dst, "copy dst");
    check_dev(src, "copy src");
    LOOM_CHECK(dst.bytes() == src.bytes(), "copy ", src.shape_str(), " -> ", dst.shape_str());
    LOOM_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy: tensors must be contiguous");
    if (src.bytes() == 0 || dst.data == src.data) return;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, cur_), "copy of ",
                    src.bytes(), " bytes");
  }
  void synchronize() override {
    ++host_syncs_;
    LOOM_CUDA_CHECK(cudaStreamSynchronize(side_), "backend synchronize (side queue)");
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_), "backend synchronize");
  }

  // Pinned (page-locked) memory, so that upload_async's copy is a true
  // asynchronous DMA; from pageable memory cudaMemcpyAsync stages through a
  // driver buffer and may block the host. Start-up only: cudaMallocHost and
  // cudaFreeHost are slow and cudaFreeHost may synchronise the device.
  void* host_alloc(size_t bytes) override {
    const size_t n = std::max<size_t>(bytes, 1);  // a distinct, valid pointer even for 0 bytes
    void* p = nullptr;
    LOOM_CUDA_CHECK(cudaMallocHost(&p, n), "host_alloc: cudaMallocHost of ", n, " bytes");
    try {
      pinned_.emplace(reinterpret_cast<uintptr_t>(p), n);
    } catch (...) {
      cudaFreeHost(p);
      throw;
    }
    return p;
  }
  void host_free(void* p) override {
    if (p == nullptr) return;
    const auto it = pinned_.find(reinterpret_cast<uintptr_t>(p));
    LOOM_CHECK(it != pinned_.end(), "host_free: ", p, " was not returned by this backend's host_alloc");
    const size_t n = it->second;
    pinned_.erase(it);
    LOOM_CUDA_CHECK(cudaFreeHost(p), "host_free: cudaFreeHost of ", n, " bytes");
  }
  // Queued on the stream, so every kernel queued after it sees the data and
  // every kernel queued before it runs first; the host buffer must stay
  // unchanged until the copy has run (the caller's ordering, see backend.hpp).
  // The source must lie inside one host_alloc buffer: a pageable source
  // would make the copy (partly) synchronous, a silent stall in the step.
  void upload_async(Tensor& dst, const void* host, size_t bytes) override {
    check_dev(dst, "upload_async");
    LOOM_CHECK(bytes <= dst.bytes(), "upload_async of ", bytes, " bytes into a ", dst.bytes(), "-byte tensor");
    if (bytes == 0) return;
    LOOM_CHECK(is_pinned(host, bytes), "upload_async: the ", bytes, "-byte source at ", host,
               " is not inside a buffer from host_alloc (pinned memory); asynchronous copies need one");
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.data, host, bytes, cudaMemcpyHostToDevice, stream_), "upload_async of ",
                    bytes, " bytes");
  }
  void sum_into(Tensor& acc, const Tensor& x, int64_t begin, int64_t end, bool square) override {
    gpu::sum_into(acc, x, begin, end, square, cur_ == side_ ? side_scratch_ : scratch_, cur_);
  }
  void clip_scale(Tensor& scalars, float grad_scale, float clip_norm) override {
    gpu::clip_scale(scalars, grad_scale, clip_norm, cur_);
  }

  // The timer ring: one event per slot, all created here at start-up.
  // Calling it again replaces the ring (the old events are destroyed; CUDA
  // releases an event still pending on the stream once it completes).
  void timer_reserve(int slots) override {
    LOOM_CHECK(slots > 0, "timer_reserve(", slots, "): the ring needs at least one slot");
    std::vector<cudaEvent_t> events;
    events.reserve(static_cast<size_t>(slots));
    try {
      for (int i = 0; i < slots; ++i) {
        cudaEvent_t e = nullptr;
        LOOM_CUDA_CHECK(cudaEventCreate(&e), "timer_reserve: event ", i, " of ", slots);
        events.push_back(e);
      }
    } catch (...) {
      for (cudaEvent_t e : events) cudaEventDestroy(e);
      throw;
    }
    destroy_marks();
    marks_ = std::move(events);
    marked_.assign(marks_.size(), false);
  }
  void timer_mark(int slot) override {
    check_slot(slot, "timer_mark");
    LOOM_CUDA_CHECK(cudaEventRecord(marks_[static_cast<size_t>(slot)], stream_), "timer_mark(", slot, ")");
    marked_[static_cast<size_t>(slot)] = true;
  }
  void timestamp(Tensor& dst) override { gpu::timestamp(dst, cur_); }
  double timer_elapsed_ms(int from, int to) override {
    check_slot(from, "timer_elapsed_ms (from)");
    check_slot(to, "timer_elapsed_ms (to)");
    LOOM_CHECK(marked_[static_cast<size_t>(from)] && marked_[static_cast<size_t>(to)], "timer_elapsed_ms(", from,
               ", ", to, "): slot ", marked_[static_cast<size_t>(from)] ? to : from,
               " was never marked since timer_reserve");
    ++host_syncs_;
    LOOM_CUDA_CHECK(cudaEventSynchronize(marks_[static_cast<size_t>(to)]), "timer_elapsed_ms: waiting for mark ", to);
    float ms = 0.f;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, marks_[static_cast<size_t>(from)], marks_[static_cast<size_t>(to)]),
                    "timer_elapsed_ms(", from, ", ", to, ")");
    return ms;
  }

  void embedding_forward(Tensor& out, const Tensor& tokens, const Tensor& wte) override {
    gpu::embedding_forward(out, tokens, wte, stream_);
  }
  void embedding_backward(Tensor& dwte, const Tensor& dout, const Tensor& tokens) override {
    gpu::embedding_backward(dwte, dout, tokens, stream_);
  }
  void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& x, const Tensor& w, float eps) override {
    gpu::rmsnorm_forward(out, rstd, x, w, eps, stream_);
  }
  void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                        const Tensor& rstd) override {
    gpu::rmsnorm_backward(dx, dw, dout, x, w, rstd, scratch_, stream_);
  }
  void rope_forward(Tensor& x, double theta) override { rope(x, theta, +1); }
  void rope_backward(Tensor& dx, double theta) override { rope(dx, theta, -1); }
  void rope_forward_at(Tensor& x, double theta, const Tensor& positions) override {
    rope(x, theta, +1, &positions);
  }
  void rope_backward_at(Tensor& dx, double theta, const Tensor& positions) override {
    rope(dx, theta, -1, &positions);
  }
  void prepare_rope(int64_t seq, int64_t head_dim, double theta) override { rope_table(seq, head_dim, theta); }
  void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up) override {
    gpu::swiglu_forward(out, gate, up, stream_);
  }
  void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) override {
    gpu::swiglu_backward(dgate, dup, dout, gate, up, stream_);
  }
  void rmsnorm_forward_fp8(const Fp8Operand& out, Tensor& rstd, const Tensor& x, const Tensor& w,
                           float eps) override {
    gpu::rmsnorm_forward_fp8(out.q, out.q_t, rstd, x, w, eps, out.scale, out.amax, stream_);
  }
  void rmsnorm_forward_amax(Tensor& out, Tensor& rstd, const Tensor& x, const Tensor& w, float eps,
                            float* amax) override {
    LOOM_CHECK(amax != nullptr, "rmsnorm_forward_amax: no amax to accumulate into");
    gpu::rmsnorm_forward(out, rstd, x, w, eps, stream_, amax);
  }
  void swiglu_forward_amax(Tensor& out, const Tensor& gate, const Tensor& up, float* amax) override {
    LOOM_CHECK(amax != nullptr, "swiglu_forward_amax: no amax to accumulate into");
    gpu::swiglu_forward(out, gate, up, stream_, amax);
  }
  void swiglu_backward_amax(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up,
                            float* amax) override {
    LOOM_CHECK(amax != nullptr, "swiglu_backward_amax: no amax to accumulate into");
    gpu::swiglu_backward(dgate, dup, dout, gate, up, stream_, amax);
  }
  void swiglu_forward_fp8(const Fp8Operand& out, const Tensor& gate, const Tensor& up) override {
    gpu::swiglu_forward_fp8(out.q, out.q_t, gate, up, out.scale, out.amax, stream_);
  }
  void swiglu_backward_fp8(const Fp8Operand& d_gate_up, const Tensor& dout, const Tensor& gate,
                           const Tensor& up) override {
    gpu::swiglu_backward_fp8(d_gate_up.q, d_gate_up.q_t, dout, gate, up, d_gate_up.scale, d_gate_up.amax, stream_);
  }
  void add(Tensor& out, const Tensor& a, const Tensor& b) override { gpu::add(out, a, b, stream_); }
  void accumulate(Tensor& dst, const Tensor& src) override { gpu::accumulate(dst, src, cur_); }
  void cross_entropy(Tensor& logits, const Tensor& targets, Tensor& losses, float dlogits_scale) override {
    gpu::cross_entropy(logits, targets, losses, dlogits_scale, stream_);
  }
  double sum(const Tensor& x) override {
    ++host_syncs_;
    return gpu::reduce_sum(x, 0, x.numel(), false, scratch_, host_result_, stream_);
  }
  double sq_norm(const Tensor& x, int64_t begin, int64_t end) override {
    ++host_syncs_;
    return gpu::reduce_sum(x, begin, end, true, scratch_, host_result_, stream_);
  }
  void scale(Tensor& x, float s) override { gpu::scale(x, s, cur_); }
  void adamw(Tensor& param, Tensor* master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWArgs& a) override {
    gpu::adamw(param, master, grad, m, v, a, cur_);
  }
  void convert(Tensor& dst, const Tensor& src) override { gpu::convert(dst, src, cur_); }

  // Mixture of experts: the routing kernels of moe.cu around the block's
  // expert GEMMs (kernels/cuda/moe_kernels.hpp). Router GEMM and softmax in
  // fp32 whatever the recipe; the sort's and the router gradient's scratch is
  // the backend scratch (the model's queue, like rmsnorm's partials).
  void moe_jitter(Tensor& xin, Tensor& noise, const Tensor& x, double eps, uint64_t seed) override {
    gpu::moe_jitter(xin, noise, x, eps, seed, stream_);
  }
  void moe_route(MoeRouting& r, const Tensor& xin, const Tensor& router) override {
    const cpu::MoeDims d = moe_dims(r, router.size(1));
    check_routing(r, "moe_route");
    gpu::moe_router_forward(f32_ptr(r.logits, "moe logits"), xin, router, d, stream_);
    gpu::moe_route(f32_ptr(r.probs, "moe probs"), i32_ptr(r.experts, "moe experts"), f32_ptr(r.weights, "moe weights"),
                   r.logits, d, stream_);
    // The sort takes longer chunks where its counters for N, E and k outgrow the scratch (moe_sort).
    const int64_t have = static_cast<int64_t>(scratch_.bytes / sizeof(int32_t));
    gpu::moe_sort(r.counts, r.offsets, i32_ptr(r.perm, "moe perm"), i32_ptr(r.row_of, "moe row_of"),
                  i32_ptr(r.experts, "moe experts"), static_cast<int32_t*>(scratch_.ptr), have, d, stream_);
  }
  void moe_gather(Tensor& xs, const Tensor& xin, const MoeRouting& r) override {
    gpu::moe_gather(xs, xin, i32_ptr(r.perm, "moe perm"), moe_dims(r, xin.size(-1)), stream_);
  }
  void moe_combine(Tensor& y, const Tensor& eout, const MoeRouting& r) override {
    gpu::moe_combine(y, eout, f32_ptr(r.weights, "moe weights"), i32_ptr(r.row_of, "moe row_of"),
                     moe_dims(r, y.size(-1)), stream_);
  }
  void moe_combine_backward(Tensor& d_eout, Tensor& d_weights, const Tensor& dy, const Tensor& eout,
                            const MoeRouting& r) override {
    gpu::moe_combine_backward(d_eout, f32_ptr(d_weights, "moe d_weights"), dy, eout, f32_ptr(r.weights, "moe weights"),
                              i32_ptr(r.perm, "moe perm"), moe_dims(r, dy.size(-1)), stream_);
  }
  void moe_route_backward(Tensor& dxin, Tensor& d_router, Tensor& /*d_probs*/, Tensor& d_logits,
                          const Tensor& d_weights, const Tensor& xin, const Tensor& router, const MoeRouting& r,
                          const Tensor* aux_dprobs) override {
    const cpu::MoeDims d = moe_dims(r, router.size(1));
    float* dl = f32_ptr(d_logits, "moe d_logits");
    LOOM_CHECK(d_logits.numel() == d.N * d.E, "moe_route_backward: d_logits ", d_logits.shape_str(), " for N=", d.N,
               " E=", d.E);
    LOOM_CHECK(aux_dprobs == nullptr || aux_dprobs->numel() == d.E, "moe_route_backward: aux_dprobs ",
               aux_dprobs ? aux_dprobs->shape_str() : std::string(), " for E=", d.E);
    gpu::moe_route_backward(dl, f32_ptr(d_weights, "moe d_weights"), f32_ptr(r.probs, "moe probs"),
                            i32_ptr(r.experts, "moe experts"), f32_ptr(r.weights, "moe weights"),
                            aux_dprobs ? f32_ptr(*aux_dprobs, "moe aux dprobs") : nullptr, d, stream_);
    gpu::moe_router_backward(dxin, d_router, dl, xin, router, scratch_.ptr, scratch_.bytes, d, stream_);
  }
  void moe_scatter_add(Tensor& dx, const Tensor& d_xs, const MoeRouting& r, const Tensor* noise) override {
    gpu::moe_scatter_add(dx, d_xs, i32_ptr(r.row_of, "moe row_of"), true, moe_dims(r, dx.size(-1)), stream_);
    if (noise) gpu::moe_scale_by(dx, *noise, stream_);
  }
  void moe_aux_accumulate(Tensor& stats, const MoeRouting& r) override {
    check_stats(stats, r.E);
    check_routing(r, "moe_aux_accumulate");
    gpu::moe_aux_accumulate_flat(static_cast<double*>(stats.data), r.counts, f32_ptr(r.probs, "moe probs"),
                                 moe_dims(r, 1), stream_);
  }
  void moe_aux_finish(Tensor& aux, Tensor& dprobs, const Tensor& stats, double coef, double grad_scale) override {
    const int64_t E = dprobs.numel();
    check_stats(stats, E);
    LOOM_CHECK(aux.numel() >= 1, "moe_aux_finish: aux ", aux.shape_str(), " holds no value");
    gpu::moe_aux_finish_flat(f32_ptr(aux, "moe aux"), f32_ptr(dprobs, "moe aux dprobs"),
                             static_cast<const double*>(stats.data), coef * grad_scale, E, stream_);
  }
  // The one host wait of a MoE layer: its expert GEMMs' row counts, copied
  // through the pinned buffer made at creation (no allocation per call).
  void moe_read_counts(int64_t* host, const MoeRouting& r) override {
    check_routing(r, "moe_read_counts");
    const size_t n = static_cast<size_t>(2 * r.E + 1);
    LOOM_CHECK(n <= kMoeCountSlots, "moe_read_counts: ", r.E, " experts need ", n,
               " counts, the pinned buffer holds ", kMoeCountSlots);
    ++host_syncs_;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(host_counts_, r.counts, n * sizeof(int64_t), cudaMemcpyDeviceToHost, stream_),
                    "moe_read_counts: ", n, " int64 expert counts and offsets (E=", r.E, ")");
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_), "moe_read_counts: waiting for the expert counts (E=", r.E, ")");
    std::memcpy(host, host_counts_, n * sizeof(int64_t));
  }

  void timer_start() override {
    LOOM_CUDA_CHECK(cudaEventRecord(ev_start_, stream_), "timer start");
    timer_running_ = true;
  }
  double timer_stop_ms() override {
    LOOM_CHECK(timer_running_, "timer_stop_ms without timer_start");
    timer_running_ = false;
    ++host_syncs_;
    LOOM_CUDA_CHECK(cudaEventRecord(ev_stop_, stream_), "timer stop");
    LOOM_CUDA_CHECK(cudaEventSynchronize(ev_stop_), "timer stop");
    float ms = 0.f;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, ev_start_, ev_stop_), "timer elapsed");
    return ms;
  }
  std::string device_name() const override {
    cudaDeviceProp p{};
    LOOM_CUDA_CHECK(cudaGetDeviceProperties(&p, device_index_), "device properties of device ", device_index_);
    return p.name;
  }
  // NVTX ranges cost nothing measurable when no profiler is attached.
  void range_push(const char* name) override { nvtxRangePushA(name); }
  void range_pop() override { nvtxRangePop(); }
  size_t device_memory_used() const override {
    size_t free_b = 0, total_b = 0;
    LOOM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b), "device memory query on device ", device_index_);
    return total_b - free_b;
  }
  size_t device_memory_free() const override {
    size_t free_b = 0, total_b = 0;
    LOOM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b), "device memory query on device ", device_index_);
    return free_b;
  }

 private:
  static cpu::MoeDims moe_dims(const MoeRouting& r, int64_t h) {
    cpu::MoeDims d;
    d.N = r.N;
    d.E = r.E;
    d.k = r.k;
    d.h = h;
    d.f = 1;
    d.row_align = r.row_align;
    cpu::moe_check(d);
    return d;
  }
  static float* f32_ptr(const Tensor& t, const char* what) {
    check_dev(t, what);
    LOOM_CHECK(t.dtype == DType::f32, what, " must be fp32, got ", dtype_name(t.dtype), " ", t.shape_str());
    return static_cast<float*>(t.data);
  }
  static int32_t* i32_ptr(const Tensor& t, const char* what) {
    check_dev(t, what);
    LOOM_CHECK(t.dtype == DType::i32, what, " must be int32, got ", dtype_name(t.dtype), " ", t.shape_str());
    return static_cast<int32_t*>(t.data);
  }
  static void check_routing(const MoeRouting& r, const char* what) {
    LOOM_CHECK(r.counts != nullptr && r.offsets == r.counts + r.E, what, ": the routing's counts and offsets must be "
               "one [2E + 1] int64 device buffer (E = ", r.E, ")");
  }
  static void check_stats(const Tensor& stats, int64_t E) {
    check_dev(stats, "moe aux statistics");
    LOOM_CHECK(stats.dtype == DType::f64 && stats.numel() == 2 * E + 1, "moe aux statistics: expected fp64 [",
               2 * E + 1, "], got ", dtype_name(stats.dtype), " ", stats.shape_str());
  }

  struct RopeTable {
    float* cos = nullptr;  // [S, D/2], then sin in the same allocation
    float* sin = nullptr;
  };

  void rope(Tensor& x, double theta, int sign, const Tensor* positions = nullptr) {
    LOOM_CHECK(x.ndim == 4, "rope expects [B, S, nh, D], got ", x.shape_str());
    LOOM_CHECK(theta > 0, "rope: theta must be positive, got ", theta);
    // The positions are staged by the host with the tokens, each in [0, S):
    // the table's rows (a kernel cannot check them without a host wait).
    if (positions)
      LOOM_CHECK(positions->data != nullptr && positions->dtype == DType::i32 && positions->device == Device::cuda &&
                     positions->numel() == x.shape[0] * x.shape[1] && positions->is_contiguous(),
                 "rope: positions must be a contiguous int32 cuda tensor of B * S = ", x.shape[0] * x.shape[1],
                 " entries, got ", dtype_name(positions->dtype), " ", positions->shape_str(), " on ",
                 ::loom::device_name(positions->device));
    const RopeTable& t = rope_table(x.shape[1], x.shape[3], theta);
    gpu::rope_apply(x, t.cos, t.sin, sign, stream_, positions ? positions->ptr<const int32_t>() : nullptr);
  }

  // The CPU's table (cpu::rope_angle: HF's fp32 angles; cos/sin in double,
  // rounded to fp32), built once per (S, D, theta).
  const RopeTable& rope_table(int64_t S, int64_t D, double theta) {
    LOOM_CHECK(D > 0 && D % 2 == 0, "rope: head_dim must be even and positive, got D=", D);
    const auto key = std::make_tuple(S, D, theta);
    auto it = rope_tables_.find(key);
    if (it != rope_tables_.end()) return it->second;
    const int64_t half = D / 2;
    const size_t count = static_cast<size_t>(S * half);
    std::vector<float> host(2 * count);
    for (int64_t pos = 0; pos < S; ++pos)
      for (int64_t i = 0; i < half; ++i) {
        const double angle = cpu::rope_angle(pos, i, D, theta);
        host[static_cast<size_t>(pos * half + i)] = static_cast<float>(std::cos(angle));
        host[count + static_cast<size_t>(pos * half + i)] = static_cast<float>(std::sin(angle));
      }
    RopeTable t;
    void* p = nullptr;
    const size_t bytes = std::max<size_t>(host.size(), 1) * sizeof(float);
    LOOM_CUDA_CHECK(cudaMalloc(&p, bytes), "rope table for S=", S, " D=", D, " (", bytes, " bytes)");
    t.cos = static_cast<float*>(p);
    t.sin = t.cos + count;
    rope_tables_.emplace(key, t);  // owned from here on (freed in release())
    // On the backend's stream, so the kernels that read the table are ordered
    // after the copy (a plain cudaMemcpy from pageable memory may return
    // before the DMA lands, and the non-blocking stream would not wait for
    // it); the wait keeps `host` alive until the copy is done.
    if (!host.empty()) {
      ++host_syncs_;
      LOOM_CUDA_CHECK(cudaMemcpyAsync(p, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream_),
                      "rope table upload, ", host.size() * sizeof(float), " bytes");
      LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_), "rope table upload");
    }
    return rope_tables_.at(key);
  }

  void check_slot(int slot, const char* what) const {
    LOOM_CHECK(!marks_.empty(), what, ": slot ", slot, " but timer_reserve was never called");
    LOOM_CHECK(slot >= 0 && static_cast<size_t>(slot) < marks_.size(), what, ": slot ", slot,
               " is outside the timer ring of ", marks_.size(), " slots (timer_reserve)");
  }
  void destroy_marks() noexcept {
    for (cudaEvent_t e : marks_) cudaEventDestroy(e);
    marks_.clear();
    marked_.clear();
  }
  // [p, p + bytes) inside one host_alloc buffer.
  bool is_pinned(const void* p, size_t bytes) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = pinned_.upper_bound(a);  // the first buffer starting after p
    if (it == pinned_.begin()) return false;
    --it;
    return a - it->first <= it->second && bytes <= it->second - (a - it->first);
  }

  // Frees everything that was created; errors are ignored (destructors must
  // not throw, and a failed device leaves nothing to do). Pinned buffers
  // nobody gave back are freed too.
  void release() noexcept {
    if (stream_) cudaStreamSynchronize(stream_);
    if (side_) cudaStreamSynchronize(side_);
    for (cudaEvent_t e : markers_)
      if (e) cudaEventDestroy(e);
    markers_.clear();
    if (side_scratch_.ptr) cudaFree(side_scratch_.ptr);
    side_scratch_ = {};
    if (side_) cudaStreamDestroy(side_);
    side_ = nullptr;
    for (auto& kv : rope_tables_) cudaFree(kv.second.cos);
    rope_tables_.clear();
    destroy_marks();
    for (auto& kv : pinned_) cudaFreeHost(reinterpret_cast<void*>(kv.first));
    pinned_.clear();
    if (host_result_) cudaFreeHost(host_result_);
    if (host_counts_) cudaFreeHost(host_counts_);
    host_counts_ = nullptr;
    if (scratch_.ptr) cudaFree(scratch_.ptr);
    if (ev_start_) cudaEventDestroy(ev_start_);
    if (ev_stop_) cudaEventDestroy(ev_stop_);
    if (blas_) cublasLtDestroy(blas_);
    if (stream_) cudaStreamDestroy(stream_);
    host_result_ = nullptr;
    scratch_ = {};
    ev_start_ = ev_stop_ = nullptr;
    blas_ = nullptr;
    stream_ = nullptr;
  }

  int device_index_;
  ExecContext ctx_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;    // the optimizer's queue
  cudaStream_t cur_ = nullptr;     // where the optimizer-class ops go now (stream_ or side_)
  ExecContext side_ctx_;
  gpu::Scratch side_scratch_;
  static constexpr size_t kMarkers = 4096;
  std::vector<cudaEvent_t> markers_;
  uint64_t next_marker_ = 0;
  cudaStream_t stream_of(const ExecContext& c) const {
    LOOM_CHECK(c.stream == stream_ || c.stream == side_, "a context whose stream is neither of this backend's queues");
    return static_cast<cudaStream_t>(c.stream);
  }
  cublasLtHandle_t blas_ = nullptr;
  cudaEvent_t ev_start_ = nullptr, ev_stop_ = nullptr;
  bool timer_running_ = false;
  gpu::Scratch scratch_;
  double* host_result_ = nullptr;
  // moe_read_counts' pinned landing buffer: counts and offsets of up to
  // kMaxExperts, the most experts a routing takes (kernels/cpu/moe.hpp), 64 KiB.
  static constexpr size_t kMoeCountSlots = 2 * static_cast<size_t>(kMaxExperts) + 1;
  int64_t* host_counts_ = nullptr;
  std::map<std::tuple<int64_t, int64_t, double>, RopeTable> rope_tables_;
  std::vector<cudaEvent_t> marks_;  // the timer ring (timer_reserve)
  std::vector<bool> marked_;        // slot recorded since timer_reserve
  std::map<uintptr_t, size_t> pinned_;  // host_alloc buffers: address -> bytes
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device_index, bool deterministic) {
  return std::make_unique<CudaBackend>(device_index, deterministic);
}

int cuda_device_for_rank(int local_rank, int local_world) {
  int count = 0;
  LOOM_CUDA_CHECK(cudaGetDeviceCount(&count), "counting CUDA devices");
  // One GPU per rank. A launcher that binds each rank to one GPU (Slurm
  // --gpus-per-task, CUDA_VISIBLE_DEVICES per rank) leaves one visible: use it.
  if (count == 1) return 0;
  if (local_rank >= count)
    throw Error(cat("rank with node-local rank ", local_rank, " of ", local_world, " has no GPU of its own: ", count,
                    " CUDA devices are visible on this node. NCCL needs one GPU per rank: start at most ", count,
                    " ranks per node (mpirun -np / srun --ntasks-per-node)"));
  return local_rank;
}

bool cuda_available() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: no driver / no device is an answer, not a failure
    return false;
  }
  return count > 0;
}

}  // namespace loom
