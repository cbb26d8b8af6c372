// AdamW on the GPU, element-wise over flat ranges (see Backend::AdamWArgs and
// kernels/cpu/adamw.cpp for the update; the fp32 arithmetic is the CPU's,
// operation for operation, each rounded on its own: no FMA contraction).
//
// Storage: param fp32 or bf16; grad fp32 or bf16; m and v fp32 or bf16
// (one dtype for both); optional fp32 master.
//   with a master: the master is updated, then param = round-to-nearest-even(master);
//   without: param is read, updated in fp32 and rounded back to its dtype, for
//   bf16 stochastically when asked (bf16_pure). Stochastic rounding adds 16
//   random bits below bf16's last mantissa bit and truncates, so x rounds up
//   with probability equal to its distance from the lower neighbour over the
//   gap: unbiased. The bits are a pure function of (seed, step, index in the
//   range) through a counter-based hash (splitmix64 finalizers): runs are
//   reproducible, and no RNG state needs checkpointing.
// m and v in bf16 are updated in fp32 and rounded to nearest even.
//
// AdamWArgs::consume_grad: each gradient element is zeroed right after it is
// read (also on a skipped step), so the next step needs no zeroing pass.
//
// The step's device scalars (AdamWArgs::scalars, set by the asynchronous
// step): each thread reads scalars[kSkip] and scalars[kUpdateScale] once,
// before touching any element. A skipped step (non-finite gradient norm)
// returns at once, so param, master, m and v keep their bits; otherwise the
// gradient scale is grad_scale * fp32(scalars[kUpdateScale]), the same fp32
// product the CPU forms, so the update is bitwise the one a call with that
// grad_scale and no scalars makes.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__host__ __device__ __forceinline__ uint32_t sr_bits(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(splitmix64(key ^ splitmix64(index)) >> 32);
}

__host__ __device__ __forceinline__ uint64_t sr_key(uint64_t seed, uint64_t step) {
  return splitmix64(seed ^ splitmix64(step ^ 0x5AD5EEDull));
}

// x rounded to a bf16 value (returned as the fp32 holding it): up with
// probability (x - lower) / (upper - lower). Inf and NaN pass unchanged.
__device__ __forceinline__ float round_bf16_stochastic(float x, uint32_t r) {
  const uint32_t b = __float_as_uint(x);
  if ((b & 0x7f800000u) == 0x7f800000u) return x;
  return __uint_as_float((b + (r & 0xffffu)) & 0xffff0000u);
}

struct AdamWScalars {
  float lr, beta1, beta2, eps, weight_decay, inv_bc1, inv_bc2, grad_scale;
  uint64_t sr_key;
};

template <typename TP, typename TG, typename TM, bool kMaster, bool kStochastic>
struct AdamWOp {
  TP* param;
  float* master;
  TG* grad;  // written only when consume (zeroed once read)
  TM* m;
  TM* v;
  AdamWScalars a;
  bool consume;
  template <int K>
  __device__ void apply(int64_t i) const {
    float g[K], mi[K], vi[K], p[K];
    load_vec<K>(grad + i, g);
    load_vec<K>(m + i, mi);
    load_vec<K>(v + i, vi);
    if constexpr (kMaster) load_vec<K>(master + i, p);
    else load_vec<K>(param + i, p);
    // Every operation rounded on its own (the _rn intrinsics are never fused
    // into FMAs), in the CPU's order. Left to the compiler, a multiply and an
    // add were contracted differently in the packed and the scalar path (v's
    // update fused beta2 * v in one, g * g in the other), so a tensor's bits
    // depended on its alignment, i.e. on where a shard boundary fell.
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float gk = __fmul_rn(g[k], a.grad_scale);
      mi[k] = __fadd_rn(__fmul_rn(a.beta1, mi[k]), __fmul_rn(__fsub_rn(1.f, a.beta1), gk));
      vi[k] = __fadd_rn(__fmul_rn(a.beta2, vi[k]), __fmul_rn(__fmul_rn(__fsub_rn(1.f, a.beta2), gk), gk));
      const float m_hat = __fmul_rn(mi[k], a.inv_bc1);
      const float v_hat = __fmul_rn(vi[k], a.inv_bc2);
      const float step = __fadd_rn(__fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), a.eps)), __fmul_rn(a.weight_decay, p[k]));
      p[k] = __fsub_rn(p[k], __fmul_rn(a.lr, step));
    }
    store_vec<K>(m + i, mi);
    store_vec<K>(v + i, vi);
    if constexpr (kMaster) store_vec<K>(master + i, p);
    if constexpr (kStochastic) {
#pragma unroll
      for (int k = 0; k < K; ++k) p[k] = round_bf16_stochastic(p[k], sr_bits(a.sr_key, static_cast<uint64_t>(i + k)));
    }
    store_vec<K>(param + i, p);  // round to nearest even (exact after stochastic rounding)
    // Last: a store before the other loads would serialise them behind it
    // (the compiler must assume the pointers may alias), halving the
    // bandwidth of this memory-bound kernel.
    if (consume) zero_grad<K>(i);
  }
  template <int K>
  __device__ void zero_grad(int64_t i) const {
    float z[K];
#pragma unroll
    for (int k = 0; k < K; ++k) z[k] = 0.f;
    store_vec<K>(grad + i, z);
  }
};

// launch_elementwise's loop, after the device scalars are applied to the op's
// grad_scale (a per-thread copy: the op is a kernel parameter).
template <int K, typename Op>
__global__ void adamw_kernel(Op op, int64_t n, const double* scalars) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / K;
  if (scalars != nullptr) {
    if (scalars[kSkip] != 0.0) {
      // The step is skipped: param, master, m and v keep their bits; consumed
      // gradients are still zeroed (the skipped step's gradients are dropped).
      if (op.consume) {
        for (int64_t v = gid; v < nvec; v += stride) op.template zero_grad<K>(v * K);
        for (int64_t i = nvec * K + gid; i < n; i += stride) op.template zero_grad<1>(i);
      }
      return;
    }
    op.a.grad_scale *= static_cast<float>(scalars[kUpdateScale]);
  }
  for (int64_t v = gid; v < nvec; v += stride) op.template apply<K>(v * K);
  for (int64_t i = nvec * K + gid; i < n; i += stride) op.template apply<1>(i);
}

template <typename TP, typename TG, typename TM, bool kMaster, bool kStochastic>
void launch_adamw(Tensor& param, Tensor* master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWScalars& s,
                  const double* scalars, bool consume, cudaStream_t stream) {
  constexpr int K = 4;  // 16-byte fp32 accesses; 8-byte ones for bf16 operands
  float* mp = kMaster ? master->ptr<float>() : nullptr;
  const bool vec = aligned_bytes(param.data, K * sizeof(TP)) && aligned_bytes(grad.data, K * sizeof(TG)) &&
                   aligned_bytes(m.data, K * sizeof(TM)) && aligned_bytes(v.data, K * sizeof(TM)) &&
                   (!kMaster || aligned_bytes(mp, K * sizeof(float)));
  const AdamWOp<TP, TG, TM, kMaster, kStochastic> op{param.ptr<TP>(), mp, grad.ptr<TG>(), m.ptr<TM>(), v.ptr<TM>(), s,
                                                      consume};
  const int64_t n = param.numel();
  if (n == 0) return;
  if (vec) {
    const unsigned grid = grid_for((n + K - 1) / K, kElementwiseThreads);
    adamw_kernel<K><<<grid, kElementwiseThreads, 0, stream>>>(op, n, scalars);
    LOOM_CUDA_LAUNCH_CHECK("adamw_kernel", "n=", n, " K=", K, " grid=", grid, " device scalars=", scalars != nullptr);
  } else {
    const unsigned grid = grid_for(n, kElementwiseThreads);
    adamw_kernel<1><<<grid, kElementwiseThreads, 0, stream>>>(op, n, scalars);
    LOOM_CUDA_LAUNCH_CHECK("adamw_kernel", "n=", n, " K=1 (unaligned) grid=", grid,
                           " device scalars=", scalars != nullptr);
  }
}

}  // namespace

uint32_t sr_random_bits(uint64_t seed, uint64_t step, uint64_t index) {
  return sr_bits(sr_key(seed, step), index);
}

void adamw(Tensor& param, Tensor* master, const Tensor& grad, Tensor& m, Tensor& v, const Backend::AdamWArgs& a,
           cudaStream_t stream) {
  check_device(param, "adamw param");
  check_device(grad, "adamw grad");
  check_device(m, "adamw m");
  check_device(v, "adamw v");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v}) check_contiguous(*t, "adamw");
  LOOM_CHECK(param.numel() == grad.numel() && grad.numel() == m.numel() && m.numel() == v.numel(),
             "adamw sizes differ: param ", param.numel(), " grad ", grad.numel(), " m ", m.numel(), " v ", v.numel());
  LOOM_CHECK(m.dtype == v.dtype, "adamw: m is ", dtype_name(m.dtype), " but v is ", dtype_name(v.dtype));
  LOOM_CHECK(a.step >= 1, "adamw: step is 1-based (bias correction divides by 1 - beta^step), got step=", a.step);
  if (master) {
    check_device(*master, "adamw master");
    check_contiguous(*master, "adamw master");
    LOOM_CHECK(master->dtype == DType::f32, "adamw: the master copy must be fp32, got ", dtype_name(master->dtype));
    LOOM_CHECK(master->numel() == param.numel(), "adamw: master has ", master->numel(), " elements, param ",
               param.numel());
    LOOM_CHECK(!a.stochastic_rounding,
               "adamw: stochastic rounding applies to a param updated in place (bf16_pure); with an fp32 master the "
               "param is the master rounded to nearest");
  }
  // Bias corrections in double, as on the CPU (beta2^step is 1 - O(1e-3) early on).
  const double bc1 = 1.0 - std::pow(static_cast<double>(a.beta1), static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(a.beta2), static_cast<double>(a.step));
  const AdamWScalars s{a.lr,
                       a.beta1,
                       a.beta2,
                       a.eps,
                       a.weight_decay,
                       static_cast<float>(1.0 / bc1),
                       static_cast<float>(1.0 / bc2),
                       a.grad_scale,
                       sr_key(a.seed, static_cast<uint64_t>(a.step))};
  const bool sr = a.stochastic_rounding && !master && param.dtype == DType::bf16;  // fp32 params need no rounding
  dispatch_float(param.dtype, "adamw param", [&](auto tp) {
    dispatch_float(grad.dtype, "adamw grad", [&](auto tg) {
      dispatch_float(m.dtype, "adamw m/v", [&](auto tm) {
        using TP = decltype(tp);
        using TG = decltype(tg);
        using TM = decltype(tm);
        if (master) launch_adamw<TP, TG, TM, true, false>(param, master, grad, m, v, s, a.scalars, a.consume_grad, stream);
        else if constexpr (std::is_same_v<TP, bf16>) {
          if (sr) launch_adamw<TP, TG, TM, false, true>(param, master, grad, m, v, s, a.scalars, a.consume_grad, stream);
          else launch_adamw<TP, TG, TM, false, false>(param, master, grad, m, v, s, a.scalars, a.consume_grad, stream);
        } else {
          launch_adamw<TP, TG, TM, false, false>(param, master, grad, m, v, s, a.scalars, a.consume_grad, stream);
        }
      });
    });
  });
}

}  // namespace loom::gpu
