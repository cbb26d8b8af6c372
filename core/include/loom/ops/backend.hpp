// Backend: the element-wise and normalisation ops of the model, on Tensors.
//
// Dtypes (the precision recipe decides; see loom/precision.hpp):
//   activations (x, out, dout, dx, logits, q/k/v, gate/up): the recipe's activation dtype (fp32 or bf16)
//   parameters (w, wte): the param dtype (fp32 or bf16); parameter gradients (dw, dwte): the grad dtype
//   rstd, losses, stats: always fp32. Every op accumulates in fp32.
// Combinations a backend must support: (act, param, grad) = (f32, f32, f32), (bf16, bf16, f32), (bf16, bf16, bf16).
// The model and its blocks (core/src/model/, blocks/) are written once against
// this interface, which is the SDK's (a block sees only loom/): the CPU
// backend (core/src/kernels/cpu) calls the fp32 reference kernels, the CUDA
// backend (core/src/kernels/cuda) the device kernels; they implement it, and
// depend on nothing above them (not the model, not the config). GEMMs and attention
// are not here: they belong to the precision and attention plugins, which
// build on the public ops of loom/ops/ (the cuBLASLt plan cache, the FP8 casts).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "loom/context.hpp"
#include "loom/tensor.hpp"

namespace loom {

// loom/precision.hpp's (not included: this header is also read by nvcc, in C++17).
struct Fp8Operand;

// One layer's routing in the `moe` feed-forward block (HF Mixtral's sparse MoE
// block; kernels/cpu/moe.hpp defines every step): N tokens, E experts, top_k = k.
struct MoeRouting {
  int64_t N = 0, E = 0, k = 0;
  Tensor logits, probs;         // fp32 [N, E]: the router's, in fp32 whatever the recipe
  Tensor weights;               // fp32 [N, k]: the k selected probabilities renormalised to 1
  Tensor experts;               // int32 [N, k]: selected experts, descending probability (ties: lower index)
  Tensor perm, row_of;          // int32: sorted row -> token * k + slot (-1: no pair) [padded rows], its inverse [N k]
  int64_t* counts = nullptr;    // [E] rows per expert, in backend memory
  int64_t* offsets = nullptr;   // [E + 1] first sorted row of each expert
  // Each expert's run of sorted rows starts at a multiple of row_align and
  // spans its count rounded up to one; the rows between hold no pair and are
  // zero in the gathered input and in the combine's gradient. The sorted
  // buffers hold N k + E (row_align - 1) rows. The MoE block sets it on a
  // device to the precision recipe's variable_row_multiple() (the FP8 GEMMs'
  // 16, fp8_block's 128); the CPU backend takes 1 only.
  int64_t row_align = 1;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual const ExecContext& ctx() const = 0;

  // Two queues. The model runs on the compute queue (ctx()). The optimizer may
  // run on a second one beside it (side_ctx(): on CUDA a second stream, so
  // memory-bound AdamW overlaps the next step's compute-bound GEMMs; on the CPU
  // the compute queue itself). While use_side_queue(true) is in effect, the
  // optimizer-class ops — zero, copy, convert, accumulate, scale, sum_into,
  // clip_scale, adamw, timestamp — go to the side queue; model ops never do.
  // The queues are ordered only through markers, never by the host.
  virtual const ExecContext& side_ctx() const { return ctx(); }
  virtual void use_side_queue(bool /*side*/) {}
  // A point in `on`'s queued work; wait() makes `ctx`'s later work wait for it.
  // A marker stays valid for the next 4096 markers (the ring of events
  // behind them; an older one makes wait() wait longer, never shorter).
  virtual uint64_t mark(const ExecContext& /*on*/) { return 0; }
  virtual void wait(const ExecContext& /*ctx*/, uint64_t /*marker*/) {}
  virtual int device_index() const { return -1; }  // the CUDA device, -1 on CPU

  // Host <-> backend memory. upload and download wait for the copy (download
  // counts as a host synchronisation); they are for start-up, checkpoints,
  // tests and log steps, never for the ordinary step.
  virtual void upload(Tensor& dst, const void* host, size_t bytes) = 0;
  virtual void download(void* host, const Tensor& src, size_t bytes) = 0;
  // Page-locked host memory for upload_async (CUDA: cudaMallocHost; CPU: plain
  // aligned memory). Allocated at start-up only.
  virtual void* host_alloc(size_t bytes) = 0;
  virtual void host_free(void* p) = 0;
  // Queues a host -> device copy on the stream and returns at once: `host`
  // (from host_alloc) must stay unchanged until the copy has run, which the
  // caller ensures by the step's ordering (see train/token_stager.hpp).
  virtual void upload_async(Tensor& dst, const void* host, size_t bytes) = 0;
  virtual void zero(Tensor& t) = 0;
  virtual void copy(Tensor& dst, const Tensor& src) = 0;
  // Wait for the work queued on both queues (CUDA: stream syncs; CPU:
  // nothing). Only at step boundaries. Counts as a host synchronisation.
  virtual void synchronize() = 0;
  // How many times this backend has made the host wait for the device
  // (synchronize, download, sum, sq_norm, timer_elapsed_ms, and any other
  // blocking read). The step-async test pins this down per step; the CPU
  // backend counts the same calls, so the test also runs without a GPU.
  int64_t host_syncs() const { return host_syncs_; }

  virtual void embedding_forward(Tensor& out, const Tensor& tokens, const Tensor& wte) = 0;
  virtual void embedding_backward(Tensor& dwte, const Tensor& dout, const Tensor& tokens) = 0;  // +=
  virtual void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& x, const Tensor& w, float eps) = 0;
  // dx += ..., dw += ...
  virtual void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                                const Tensor& rstd) = 0;
  // x: [B, S, nh, D] view (row stride x.stride[1]); in place.
  virtual void rope_forward(Tensor& x, double theta) = 0;
  virtual void rope_backward(Tensor& dx, double theta) = 0;
  // The same with the position of each row given instead of its index s:
  // positions is int32 [B * S] in backend memory, row (b, s) at position
  // positions[b * S + s] in [0, S) (train.reset_position_ids: positions
  // restart at every document start; DocumentSpans::positions). The
  // defaults refuse with one message (the CPU and CUDA backends have them).
  virtual void rope_forward_at(Tensor& x, double theta, const Tensor& positions);
  virtual void rope_backward_at(Tensor& dx, double theta, const Tensor& positions);
  // Build whatever RoPE needs for (seq, head_dim, theta) now, at start-up, so
  // the step allocates nothing (the CUDA backend's cos/sin table).
  virtual void prepare_rope(int64_t /*seq*/, int64_t /*head_dim*/, double /*theta*/) {}
  // SwiGLU: out = silu(gate) * up on [N, f] matrices. gate, up, dgate and dup
  // may be row views with a row stride above f (the two halves of a packed
  // [N, 2f] gate_up buffer, as the fused feed-forward block computes it);
  // out and dout are packed. Rows fold as in fold_rows (loom/tensor.hpp).
  virtual void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up) = 0;
  virtual void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate,
                               const Tensor& up) = 0;
  // SwiGLU writing a linear's FP8 operand (loom/precision.hpp's Fp8Operand)
  // instead of bf16, where the recipe offered it (Precision::fp8_operand): the forward's out as
  // op.q [N, f] (the down projection's x); the backward's [dgate, dup] as
  // op.q [N, 2f] (the gate_up projection's dy, packed like its output). Each
  // value is rounded to bf16 before it is encoded, so the codes and the amax
  // are those of swiglu_forward/backward followed by the recipe's cast. An
  // empty op.q (no data; the forward and rmsnorm_forward_fp8 only) writes
  // op.q_t alone: a recomputed x whose wgrad reads xᵀ only
  // (Fp8RecastOperand, loom/precision.hpp). The defaults refuse with one
  // message (the CPU backend has none, and no recipe on the CPU offers an FP8
  // operand).
  virtual void swiglu_forward_fp8(const Fp8Operand& out, const Tensor& gate, const Tensor& up);
  // RMSNorm writing the next linear's x as an FP8 operand (op.q [N, h]) and
  // rstd, bitwise rmsnorm_forward followed by the recipe's cast (the fused
  // blocks' norms before qkv and gate_up). Refused by default, as above.
  virtual void rmsnorm_forward_fp8(const Fp8Operand& out, Tensor& rstd, const Tensor& x, const Tensor& w, float eps);
  virtual void swiglu_backward_fp8(const Fp8Operand& d_gate_up, const Tensor& dout, const Tensor& gate,
                                   const Tensor& up);
  virtual void add(Tensor& out, const Tensor& a, const Tensor& b) = 0;  // out may alias a
  virtual void accumulate(Tensor& dst, const Tensor& src) = 0;          // dst += src
  // Fused softmax cross-entropy over logits [N, V]: per-row loss into losses[N] (fp32)
  // and, when dlogits_scale != 0, the logits gradient written over the logits.
  virtual void cross_entropy(Tensor& logits, const Tensor& targets, Tensor& losses, float dlogits_scale) = 0;
  // Sum of a fp32 vector (synchronises).
  virtual double sum(const Tensor& x) = 0;
  // Sum of squares of x[begin, end) (synchronises).
  virtual double sq_norm(const Tensor& x, int64_t begin, int64_t end) = 0;
  // acc[0] += sum of x[begin, end) (square: of its squares), x fp32 or bf16,
  // acc a device f64 scalar; accumulated in double in an order fixed by
  // (end - begin) alone, so it is deterministic. Queued, never waits.
  virtual void sum_into(Tensor& acc, const Tensor& x, int64_t begin, int64_t end, bool square) = 0;
  // The step's clipping decision, on the device, from StepScalars (below):
  //   norm = sqrt(s[kNormSq]) * grad_scale
  //   s[kGradNorm] = norm
  //   s[kSkip] = 1 if norm is not finite, else 0
  //   s[kUpdateScale] = grad_scale * (clip_norm > 0 && clip_norm / (norm + 1e-6) < 1 ? clip_norm / (norm + 1e-6) : 1)
  // Queued, never waits.
  virtual void clip_scale(Tensor& scalars, float grad_scale, float clip_norm) = 0;
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
    // When set (a StepScalars tensor's data, device memory): the gradient is
    // also multiplied by scalars[kUpdateScale], and nothing is written when
    // scalars[kSkip] != 0 — the clipping decision never visits the host.
    const double* scalars = nullptr;
    // Zero the gradient once it is read (also on a skipped step), so that the
    // next step starts from zero gradients without a pass of its own.
    bool consume_grad = false;
  };
  virtual void adamw(Tensor& param, Tensor* master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWArgs& a) = 0;
  // dst = src converted (fp32 <-> bf16, or a copy when equal); same element count.
  virtual void convert(Tensor& dst, const Tensor& src) = 0;

  // Mixture of experts: the routing steps of the `moe` feed-forward block
  // (blocks/ffn_moe.cpp), which runs the expert GEMMs itself through the
  // precision plugin. The defaults refuse with one message: a backend without
  // MoE kernels stops at the first call (the CPU and CUDA backends have them).
  //   moe_jitter: noise = uniform [1 - eps, 1 + eps) from (seed, index); xin = x * noise
  //   moe_route: router GEMM (fp32), softmax, top-k, renormalised weights, the sort by expert
  //   moe_gather: xs [N k, h] = the token rows of each sorted row
  //   moe_combine: y [N, h] = each token's weighted expert rows, in ascending expert order
  //   moe_combine_backward: d_eout [N k, h], d_weights [N, k] (fp32) written
  //   moe_route_backward: through the renormalisation, softmax (+ aux_dprobs [E] on every
  //     row when not null) and router: dxin written, d_router accumulated; d_probs,
  //     d_logits fp32 [N, E] scratch
  //   moe_scatter_add: dx += each token's expert-row gradients; then dx *= noise (when not null)
  //   moe_aux_accumulate: stats (f64 [2E + 1]: selections per expert, probability sums, rows) += this layer's
  //   moe_aux_finish: aux[0] (fp32) = E sum_e f_e P_e over the accumulated rows (HF's
  //     load_balancing_loss_func); dprobs [E] (fp32) = grad_scale * coef * d aux / d probs
  virtual void moe_jitter(Tensor& xin, Tensor& noise, const Tensor& x, double eps, uint64_t seed);
  virtual void moe_route(MoeRouting& r, const Tensor& xin, const Tensor& router);
  virtual void moe_gather(Tensor& xs, const Tensor& xin, const MoeRouting& r);
  virtual void moe_combine(Tensor& y, const Tensor& eout, const MoeRouting& r);
  virtual void moe_combine_backward(Tensor& d_eout, Tensor& d_weights, const Tensor& dy, const Tensor& eout,
                                    const MoeRouting& r);
  virtual void moe_route_backward(Tensor& dxin, Tensor& d_router, Tensor& d_probs, Tensor& d_logits,
                                  const Tensor& d_weights, const Tensor& xin, const Tensor& router,
                                  const MoeRouting& r, const Tensor* aux_dprobs);
  virtual void moe_scatter_add(Tensor& dx, const Tensor& d_xs, const MoeRouting& r, const Tensor* noise);
  virtual void moe_aux_accumulate(Tensor& stats, const MoeRouting& r);
  virtual void moe_aux_finish(Tensor& aux, Tensor& dprobs, const Tensor& stats, double coef, double grad_scale);
  // The per-expert row counts then offsets (r.counts, r.offsets: [2E + 1]
  // int64) copied to `host` — the one read the MoE layer makes the host wait
  // for (its expert GEMMs' row counts), so it counts as a host synchronisation.
  // The default downloads them; the CUDA backend copies through a pinned
  // buffer made at creation (one stream sync).
  virtual void moe_read_counts(int64_t* host, const MoeRouting& r);

  // Step timing: CUDA events on the backend's stream (host clock on CPU).
  virtual void timer_start() = 0;
  virtual double timer_stop_ms() = 0;  // synchronises
  // A ring of timing marks for the asynchronous step: timer_reserve(n) at
  // start-up makes n slots; timer_mark(slot) records the stream's position
  // (CUDA: an event; CPU: the host clock, which is the same thing there);
  // timer_elapsed_ms(a, b) waits for mark b (a host synchronisation) and
  // returns the milliseconds from mark a to mark b.
  virtual void timer_reserve(int slots) = 0;
  virtual void timer_mark(int slot) = 0;
  virtual double timer_elapsed_ms(int from, int to) = 0;
  // Writes the time in milliseconds (f64, from an arbitrary origin fixed for
  // the process) into dst[0] when the stream reaches this point: the device's
  // global timer on CUDA, the host clock on CPU. Queued, never waits; the step
  // log reads the stamps with the step's other scalars.
  virtual void timestamp(Tensor& dst) = 0;
  // Bytes of device memory in use by the whole process (cudaMemGetInfo), 0 on CPU.
  virtual size_t device_memory_used() const { return 0; }
  // Bytes of device memory still free (cudaMemGetInfo), 0 on CPU (host memory: train/memory_budget.hpp).
  virtual size_t device_memory_free() const { return 0; }
  // The device's name ("NVIDIA H100 80GB HBM3", "cpu").
  virtual std::string device_name() const { return "cpu"; }
  // Named ranges for profilers (NVTX on CUDA, so nsys/ncu show every layer and op).
  virtual void range_push(const char* /*name*/) {}
  virtual void range_pop() {}

  // RMSNorm and SwiGLU that also measure what they write (ABI 10.2; appended
  // so that the entries above keep their places): the outputs of
  // rmsnorm_forward, swiglu_forward and swiglu_backward bit for bit, and max
  // |v| over the values as stored (NaN as +inf) max-accumulated into the
  // device float *amax: the amax a current-scaling recipe's cast of that
  // tensor would measure, handed over instead (Fp8OperandAmax,
  // loom/precision.hpp). swiglu_backward_amax measures dgate and dup
  // together (the gate_up projection's dy). The defaults refuse with one
  // message (the CUDA backend has them; no recipe asks on the CPU).
  virtual void rmsnorm_forward_amax(Tensor& out, Tensor& rstd, const Tensor& x, const Tensor& w, float eps,
                                    float* amax);
  virtual void swiglu_forward_amax(Tensor& out, const Tensor& gate, const Tensor& up, float* amax);
  virtual void swiglu_backward_amax(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate,
                                    const Tensor& up, float* amax);

 protected:
  int64_t host_syncs_ = 0;
};

// The per-step device scalars (a f64 tensor of kStepScalars elements in the
// arena): the norm accumulator, the loss sum, and what clip_scale derives.
// kTimeBegin / kTimeEnd: timestamp() at the step's first and last operation.
// kAuxSum: the MoE load-balancing losses of the step's micro-batches, summed.
enum StepScalar : int {
  kNormSq = 0, kLossSum, kGradNorm, kSkip, kUpdateScale, kTimeBegin, kTimeEnd, kAuxSum, kStepScalars
};

// Sends the backend's optimizer-class ops to the queue of `ctx` (compute or
// side) for the scope's lifetime.
class QueueScope {
 public:
  QueueScope(Backend& b, const ExecContext& ctx) : b_(b) {
    b_.use_side_queue(ctx.stream != nullptr && ctx.stream == b_.side_ctx().stream && ctx.stream != b_.ctx().stream);
  }
  ~QueueScope() { b_.use_side_queue(false); }
  QueueScope(const QueueScope&) = delete;
  QueueScope& operator=(const QueueScope&) = delete;

 private:
  Backend& b_;
};

std::unique_ptr<Backend> make_cpu_backend(int threads, bool deterministic = false);
// Defined in kernels/cuda when built with CUDA: one stream, a cuBLASLt handle
// (ExecContext::blas_handle), the device chosen by `device_index`.
// `deterministic` (run.deterministic) goes into ctx().deterministic, which
// every plugin call sees (cuDNN's deterministic backward reads it).
std::unique_ptr<Backend> make_cuda_backend(int device_index, bool deterministic);
bool cuda_available();  // a CUDA device is present and usable (false in builds without CUDA)
// The GPU of the rank with this node-local rank (one GPU per rank); throws when there is none.
int cuda_device_for_rank(int local_rank, int local_world);

}  // namespace loom
