// The MoE routing kernels (see moe_kernels.hpp for the contract and
// kernels/cpu/moe.hpp for the computation they reproduce).
#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/moe_kernels.hpp"

namespace loom::gpu {
namespace {

// Per-token slot arrays in shared memory; moe_check bounds top_k by the
// reference's own limit (64), which this matches.
constexpr int kMaxTopK = 64;
constexpr int kTokenThreads = 128;  // one thread per token (route, route backward)
constexpr int kSortWarps = 4;       // warps (= chunks) per block of the sort
constexpr int kRowThreads = 256;    // most threads of a one-block-per-row kernel

// ---- argument checks -----------------------------------------------------------

void check_ptr(const void* p, int64_t n, const char* what) {
  LOOM_CHECK(p != nullptr || n == 0, what, ": null device pointer for ", n, " elements");
}

// A [rows, cols] contiguous fp32 or bf16 device tensor of dtype `dtype`.
void check_rows(const Tensor& t, DType dtype, int64_t rows, int64_t cols, const char* what) {
  check_device(t, what);
  check_contiguous(t, what);
  LOOM_CHECK(t.dtype == dtype, what, " is ", dtype_name(t.dtype), ", expected ", dtype_name(dtype));
  LOOM_CHECK(t.numel() == rows * cols && (t.ndim < 1 || t.shape[t.ndim - 1] == cols), what, " is ", t.shape_str(),
             ", expected [", rows, ", ", cols, "] (", rows * cols, " elements)");
}

// ---- router ------------------------------------------------------------------------

template <typename TL>
__global__ void __launch_bounds__(kTokenThreads)
    route_kernel(float* probs, int32_t* experts, float* weights, const TL* logits, int64_t N, int E, int k) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += stride) {
    const TL* l = logits + n * E;
    float* p = probs + n * E;
    double mx = to_f32(l[0]);
    for (int e = 1; e < E; ++e) {
      const double v = to_f32(l[e]);
      mx = mx < v ? v : mx;  // std::max(mx, v)
    }
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum = __dadd_rn(sum, exp(__dsub_rn(static_cast<double>(to_f32(l[e])), mx)));
    for (int e = 0; e < E; ++e)
      p[e] = __double2float_rn(__ddiv_rn(exp(__dsub_rn(static_cast<double>(to_f32(l[e])), mx)), sum));
    // k passes of an argmax with a strict '>': ties go to the lower expert.
    int32_t* sel = experts + n * k;
    double s = 0.0;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      float pbest = 0.f;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken = taken || sel[i] == e;
        const float pe = p[e];
        if (!taken && (best < 0 || pe > pbest)) {
          best = e;
          pbest = pe;
        }
      }
      sel[j] = best;
      s = __dadd_rn(s, static_cast<double>(pbest));
    }
    for (int j = 0; j < k; ++j) weights[n * k + j] = __double2float_rn(__ddiv_rn(static_cast<double>(p[sel[j]]), s));
  }
}

// Renormalisation and softmax backward; d_logits holds dp first, then is
// overwritten element by element with the result.
__global__ void __launch_bounds__(kTokenThreads)
    route_backward_kernel(float* d_logits, const float* d_weights, const float* probs, const int32_t* experts,
                          const float* weights, const float* aux, int64_t N, int E, int k) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < N; t += stride) {
    const float* p = probs + t * E;
    const int32_t* sel = experts + t * k;
    const float* wt = weights + t * k;
    const float* dw = d_weights + t * k;
    float* dp = d_logits + t * E;
    for (int e = 0; e < E; ++e) dp[e] = aux ? aux[e] : 0.f;
    double S = 0.0, dot = 0.0;
    for (int j = 0; j < k; ++j) {
      S = __dadd_rn(S, static_cast<double>(p[sel[j]]));
      dot = __dadd_rn(dot, __dmul_rn(static_cast<double>(dw[j]), static_cast<double>(wt[j])));
    }
    for (int j = 0; j < k; ++j) {
      const int e = sel[j];
      dp[e] = __fadd_rn(dp[e], __double2float_rn(__ddiv_rn(__dsub_rn(static_cast<double>(dw[j]), dot), S)));
    }
    double pd = 0.0;
    for (int e = 0; e < E; ++e) pd = __dadd_rn(pd, __dmul_rn(static_cast<double>(p[e]), static_cast<double>(dp[e])));
    for (int e = 0; e < E; ++e)
      dp[e] = __double2float_rn(__dmul_rn(static_cast<double>(p[e]), __dsub_rn(static_cast<double>(dp[e]), pd)));
  }
}

// ---- sort ------------------------------------------------------------------------------
// scratch[e * nchunks + c]: first the number of pairs of chunk c routed to e,
// then (after the scan) the first row of chunk c within expert e's rows, which
// the placing pass advances as it goes.

__device__ __forceinline__ int expert_key(const int32_t* experts, int64_t i, int E) {
  const int e = experts[i];
  return e >= 0 && e < E ? e : -1;
}

__global__ void sort_count_kernel(int32_t* scratch, const int32_t* experts, int64_t R, int E, int64_t chunk,
                                  int64_t nchunks) {
  const int lane = threadIdx.x % 32;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSortWarps + threadIdx.x / 32;
  if (c >= nchunks) return;  // the whole warp
  for (int e = lane; e < E; e += 32) scratch[e * nchunks + c] = 0;
  __syncwarp();
  const int64_t begin = c * chunk, end = begin + chunk < R ? begin + chunk : R;
  for (int64_t i0 = begin; i0 < end; i0 += 32) {
    const int64_t i = i0 + lane;
    const unsigned active = __ballot_sync(0xffffffffu, i < end);
    if (i < end) {
      const int key = expert_key(experts, i, E);
      const unsigned same = __match_any_sync(active, key);
      if (key >= 0 && lane == __ffs(same) - 1) scratch[key * nchunks + c] += __popc(same);
    }
    __syncwarp();
  }
}

// A warp per expert: exclusive prefix sum of its chunk counts, in chunk order.
__global__ void sort_scan_kernel(int32_t* scratch, int64_t* counts, int E, int64_t nchunks) {
  const int lane = threadIdx.x % 32;
  const int e = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (e >= E) return;
  int32_t* col = scratch + static_cast<int64_t>(e) * nchunks;
  int64_t carry = 0;
  for (int64_t c0 = 0; c0 < nchunks; c0 += 32) {
    const int64_t c = c0 + lane;
    const int v = c < nchunks ? col[c] : 0;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += up;
    }
    if (c < nchunks) col[c] = static_cast<int32_t>(carry + incl - v);
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) counts[e] = carry;
}

// Each expert's run starts at a multiple of align and spans its count rounded up to one.
__global__ void sort_offsets_kernel(int64_t* offsets, const int64_t* counts, int E, int64_t align) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  offsets[0] = 0;
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (counts[e] + align - 1) / align * align;
}

__global__ void sort_place_kernel(int32_t* perm, int32_t* row_of, int32_t* scratch, const int32_t* experts,
                                  const int64_t* offsets, int64_t R, int E, int64_t chunk, int64_t nchunks) {
  const int lane = threadIdx.x % 32;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSortWarps + threadIdx.x / 32;
  if (c >= nchunks) return;
  const unsigned below = (1u << lane) - 1u;
  const int64_t begin = c * chunk, end = begin + chunk < R ? begin + chunk : R;
  for (int64_t i0 = begin; i0 < end; i0 += 32) {
    const int64_t i = i0 + lane;
    const unsigned active = __ballot_sync(0xffffffffu, i < end);
    if (i < end) {
      const int key = expert_key(experts, i, E);
      const unsigned same = __match_any_sync(active, key);
      int32_t* cursor = key >= 0 ? scratch + static_cast<int64_t>(key) * nchunks + c : nullptr;
      if (key >= 0) {
        const int64_t row = offsets[key] + *cursor + __popc(same & below);
        perm[row] = static_cast<int32_t>(i);
        row_of[i] = static_cast<int32_t>(row);
      } else {
        row_of[i] = -1;
      }
      __syncwarp(active);  // every lane has read its cursor before the leaders advance them
      if (key >= 0 && lane == __ffs(same) - 1) *cursor += __popc(same);
    }
    __syncwarp();
  }
}

// ---- gather, combine, scatter-add ------------------------------------------------------

// The k slots of token t in ascending sorted row order (insertion sort by
// thread 0), with their weights when w is given.
__device__ void sorted_slots(int32_t* s_row, float* s_w, const int32_t* row_of, const float* w, int64_t t, int k) {
  if (threadIdx.x == 0) {
    for (int j = 0; j < k; ++j) {
      const int32_t r = row_of[t * k + j];
      const float wj = w ? w[t * k + j] : 0.f;
      int i = j;
      for (; i > 0 && s_row[i - 1] > r; --i) {
        s_row[i] = s_row[i - 1];
        s_w[i] = s_w[i - 1];
      }
      s_row[i] = r;
      s_w[i] = wj;
    }
  }
  __syncthreads();
}

// Zeros into a row of h elements, the block's threads across it (K-wide where packed).
template <int K, typename T>
__device__ __forceinline__ void zero_row(T* dst, int64_t h) {
  const int64_t nvec = h / K;
  const float z[K] = {};
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) store_vec<K>(dst + v * K, z);
  for (int64_t c = nvec * K + threadIdx.x; c < h; c += blockDim.x) dst[c] = from_f32<T>(0.f);
}

// Sorted rows [0, Rp): row r copies token perm[r] / k; a row that holds no
// pair (perm -1: the padding between experts' runs, or past the last run
// when some pair had an invalid expert) is zeroed, so that the expert GEMMs
// that run over it add nothing to the weight gradients.
template <int K, typename T>
__global__ void __launch_bounds__(kRowThreads) gather_kernel(T* xs, const T* x, const int32_t* perm, int64_t R,
                                                             int64_t Rp, int64_t h, int k) {
  const int64_t nvec = h / K;
  for (int64_t r = blockIdx.x; r < Rp; r += gridDim.x) {
    const int32_t pair = perm[r];
    T* dst = xs + r * h;
    if (pair < 0 || pair >= R) {  // uniform over the block
      zero_row<K>(dst, h);
      continue;
    }
    const T* src = x + static_cast<int64_t>(pair / k) * h;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      float a[K];
      load_vec<K>(src + v * K, a);
      store_vec<K>(dst + v * K, a);
    }
    for (int64_t c = nvec * K + threadIdx.x; c < h; c += blockDim.x) dst[c] = src[c];
  }
}

// Per token: out[t] = (accumulate ? out[t] : 0) + sum_j (w_j *) src[row_j], in
// ascending row order, fp32, rounded once. weighted: multiply by the slot's
// weight (the combine); otherwise plain adds (the scatter-add).
template <int K, typename T>
__device__ __forceinline__ void token_sum(T* out, const T* src, const int32_t* s_row, const float* s_w, int64_t col,
                                          int k, int64_t h, bool weighted, bool accumulate) {
  float acc[K];
  if (accumulate) {
    load_vec<K>(out + col, acc);
  } else {
#pragma unroll
    for (int i = 0; i < K; ++i) acc[i] = 0.f;
  }
  for (int j = 0; j < k; ++j) {
    if (s_row[j] < 0) continue;
    float o[K];
    load_vec<K>(src + static_cast<int64_t>(s_row[j]) * h + col, o);
#pragma unroll
    for (int i = 0; i < K; ++i) acc[i] = __fadd_rn(acc[i], weighted ? __fmul_rn(o[i], s_w[j]) : o[i]);
  }
  store_vec<K>(out + col, acc);
}

template <int K, typename T>
__global__ void __launch_bounds__(kRowThreads)
    token_sum_kernel(T* out, const T* src, const int32_t* row_of, const float* w, int64_t N, int64_t h, int k,
                     bool accumulate) {
  __shared__ int32_t s_row[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  const int64_t nvec = h / K;
  for (int64_t t = blockIdx.x; t < N; t += gridDim.x) {
    sorted_slots(s_row, s_w, row_of, w, t, k);
    T* o = out + t * h;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x)
      token_sum<K>(o, src, s_row, s_w, v * K, k, h, w != nullptr, accumulate);
    for (int64_t c = nvec * K + threadIdx.x; c < h; c += blockDim.x)
      token_sum<1>(o, src, s_row, s_w, c, k, h, w != nullptr, accumulate);
    __syncthreads();  // the slots are reloaded for the next token
  }
}

template <int K, typename T>
__global__ void __launch_bounds__(kRowThreads)
    combine_backward_kernel(T* d_eout, float* d_weights, const T* dy, const T* eout, const float* weights,
                            const int32_t* perm, int64_t R, int64_t Rp, int64_t h, int k) {
  __shared__ double red[32];
  const int64_t nvec = h / K;
  for (int64_t r = blockIdx.x; r < Rp; r += gridDim.x) {
    const int32_t pair = perm[r];
    T* de = d_eout + r * h;
    if (pair < 0 || pair >= R) {  // uniform over the block: no barrier is skipped by part of it
      zero_row<K>(de, h);  // a row with no pair: a zero gradient (finite, as the expert GEMMs run over it)
      continue;
    }
    const float wt = weights[pair];
    const T* g = dy + static_cast<int64_t>(pair / k) * h;
    const T* o = eout + r * h;
    double acc = 0.0;
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      float gv[K], ov[K], dv[K];
      load_vec<K>(g + v * K, gv);
      load_vec<K>(o + v * K, ov);
#pragma unroll
      for (int i = 0; i < K; ++i) {
        acc = __dadd_rn(acc, __dmul_rn(static_cast<double>(gv[i]), static_cast<double>(ov[i])));
        dv[i] = __fmul_rn(wt, gv[i]);
      }
      store_vec<K>(de + v * K, dv);
    }
    for (int64_t c = nvec * K + threadIdx.x; c < h; c += blockDim.x) {
      const float gv = to_f32(g[c]), ov = to_f32(o[c]);
      acc = __dadd_rn(acc, __dmul_rn(static_cast<double>(gv), static_cast<double>(ov)));
      de[c] = from_f32<T>(__fmul_rn(wt, gv));
    }
    const double total = block_sum(acc, red);
    if (threadIdx.x == 0) d_weights[pair] = __double2float_rn(total);
  }
}

// ---- aux statistics ------------------------------------------------------------------

__global__ void __launch_bounds__(kRowThreads)
    aux_accumulate_kernel(int64_t* aux_counts, double* aux_prob_sum, const int64_t* counts, const float* probs,
                          int64_t N, int E) {
  __shared__ double red[32];
  for (int e = blockIdx.x; e < E; e += gridDim.x) {
    double acc = 0.0;
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) acc = __dadd_rn(acc, static_cast<double>(probs[n * E + e]));
    const double total = block_sum(acc, red);
    if (threadIdx.x == 0) {
      aux_prob_sum[e] = __dadd_rn(aux_prob_sum[e], total);
      aux_counts[e] += counts[e];
    }
  }
}

__global__ void aux_finish_kernel(double* loss, float* grad, const int64_t* counts, const double* prob_sum,
                                  int64_t rows, double coef, int64_t E) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const double R = static_cast<double>(rows);
  double acc = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    if (rows == 0) {
      grad[e] = 0.f;
      continue;
    }
    const double f = __ddiv_rn(static_cast<double>(counts[e]), R);
    acc = __dadd_rn(acc, __dmul_rn(f, __ddiv_rn(prob_sum[e], R)));
    grad[e] = __double2float_rn(__ddiv_rn(__dmul_rn(__dmul_rn(coef, static_cast<double>(E)), f), R));
  }
  if (loss) *loss = rows == 0 ? 0.0 : __dmul_rn(static_cast<double>(E), acc);
}

// ---- launch helpers -------------------------------------------------------------------

// Grid of one block per row (grid-strided), never more than the H100 budget.
unsigned row_grid(int64_t rows) { return grid_for(rows, 1); }

// Packed K-wide accesses need every base aligned to K elements and h a
// multiple of K (so each row stays aligned).
template <typename T, int K>
bool rows_packable(int64_t h, std::initializer_list<const void*> ptrs) {
  if (h % K != 0) return false;
  for (const void* p : ptrs)
    if (!aligned_bytes(p, K * sizeof(T))) return false;
  return true;
}

}  // namespace

void moe_route(float* probs, int32_t* experts, float* weights, const Tensor& logits, const MoeDims& d,
               cudaStream_t stream) {
  cpu::moe_check(d);
  check_ptr(probs, d.N * d.E, "moe_route probs");
  check_ptr(experts, d.N * d.k, "moe_route experts");
  check_ptr(weights, d.N * d.k, "moe_route weights");
  check_device(logits, "moe_route logits");
  check_rows(logits, logits.dtype, d.N, d.E, "moe_route logits");
  if (d.N == 0) return;
  dispatch_float(logits.dtype, "moe_route logits", [&](auto tag) {
    using TL = decltype(tag);
    const unsigned grid = grid_for(d.N, kTokenThreads);
    route_kernel<TL><<<grid, kTokenThreads, 0, stream>>>(probs, experts, weights, static_cast<const TL*>(logits.data),
                                                         d.N, static_cast<int>(d.E), static_cast<int>(d.k));
    LOOM_CUDA_LAUNCH_CHECK("moe route_kernel", "N=", d.N, " E=", d.E, " k=", d.k, " logits ",
                           dtype_name(logits.dtype), " grid=", grid);
  });
}

int64_t moe_sort_scratch_elems(const MoeDims& d) {
  const int64_t chunks = (d.rows() + kMoeSortChunk - 1) / kMoeSortChunk;
  return d.E * (chunks < 1 ? 1 : chunks);
}

void moe_sort(int64_t* counts, int64_t* offsets, int32_t* perm, int32_t* row_of, const int32_t* experts,
              int32_t* scratch, int64_t scratch_elems, const MoeDims& d, cudaStream_t stream) {
  cpu::moe_check(d);
  const int64_t R = d.rows(), Rp = d.padded_rows(), E = d.E;
  // One counter per expert and chunk. A scratch smaller than
  // moe_sort_scratch_elems(d) (many experts and many tokens: E = 4096 with
  // over a million (token, slot) pairs outgrows the backend's 16 MiB) takes
  // longer chunks, still whole multiples of kMoeSortChunk: fewer warps, the
  // same stable order, so the same output.
  LOOM_CHECK(scratch_elems >= E, "moe_sort: scratch of ", scratch_elems, " int32 elements, at least ", E,
             " (one counter per expert) needed for ", R, " pairs and ", E, " experts (moe_sort_scratch_elems: ",
             moe_sort_scratch_elems(d), " for the fastest split)");
  const int64_t most_chunks = scratch_elems / E;
  const int64_t min_chunk = (R + most_chunks - 1) / most_chunks;
  const int64_t chunk = std::max<int64_t>(1, (min_chunk + kMoeSortChunk - 1) / kMoeSortChunk) * kMoeSortChunk;
  const int64_t nchunks = (R + chunk - 1) / chunk;
  check_ptr(counts, E, "moe_sort counts");
  check_ptr(offsets, E + 1, "moe_sort offsets");
  check_ptr(perm, Rp, "moe_sort perm");
  check_ptr(row_of, R, "moe_sort row_of");
  check_ptr(experts, R, "moe_sort experts");
  check_ptr(scratch, E * std::max<int64_t>(nchunks, 1), "moe_sort scratch");
  const int e32 = static_cast<int>(E);
  if (nchunks > 0) {
    const unsigned grid = static_cast<unsigned>((nchunks + kSortWarps - 1) / kSortWarps);
    sort_count_kernel<<<grid, 32 * kSortWarps, 0, stream>>>(scratch, experts, R, e32, chunk, nchunks);
    LOOM_CUDA_LAUNCH_CHECK("moe sort_count_kernel", "R=", R, " E=", E, " chunk=", chunk, " chunks=", nchunks,
                           " grid=", grid);
  }
  {
    const int warps = 8;
    const unsigned grid = static_cast<unsigned>((E + warps - 1) / warps);
    sort_scan_kernel<<<grid, 32 * warps, 0, stream>>>(scratch, counts, e32, nchunks);
    LOOM_CUDA_LAUNCH_CHECK("moe sort_scan_kernel", "R=", R, " E=", E, " chunks=", nchunks, " grid=", grid);
  }
  sort_offsets_kernel<<<1, 1, 0, stream>>>(offsets, counts, e32, d.row_align);
  LOOM_CUDA_LAUNCH_CHECK("moe sort_offsets_kernel", "E=", E, " row_align=", d.row_align);
  // Rows the placing leaves empty (the padding between runs, and the tail
  // left by pairs with an invalid expert) read -1: they hold no pair.
  if (Rp > 0)
    LOOM_CUDA_CHECK(cudaMemsetAsync(perm, 0xFF, static_cast<size_t>(Rp) * sizeof(int32_t), stream),
                    "moe_sort: cudaMemsetAsync(perm, -1, ", Rp, " rows)");
  if (nchunks > 0) {
    const unsigned grid = static_cast<unsigned>((nchunks + kSortWarps - 1) / kSortWarps);
    sort_place_kernel<<<grid, 32 * kSortWarps, 0, stream>>>(perm, row_of, scratch, experts, offsets, R, e32,
                                                             chunk, nchunks);
    LOOM_CUDA_LAUNCH_CHECK("moe sort_place_kernel", "R=", R, " E=", E, " chunk=", chunk, " chunks=", nchunks,
                           " grid=", grid);
  }
}

void moe_gather(Tensor& xs, const Tensor& x, const int32_t* perm, const MoeDims& d, cudaStream_t stream) {
  cpu::moe_check(d);
  const int64_t R = d.rows(), Rp = d.padded_rows(), h = d.h;
  check_rows(x, x.dtype, d.N, h, "moe_gather x");
  check_rows(xs, x.dtype, Rp, h, "moe_gather xs");
  check_ptr(perm, Rp, "moe_gather perm");
  if (Rp == 0) return;
  dispatch_float(x.dtype, "moe_gather", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const bool packed = rows_packable<T, K>(h, {xs.data, x.data});
    const int threads = row_threads(packed ? h / K : h, kRowThreads);
    const unsigned grid = row_grid(Rp);
    T* out = static_cast<T*>(xs.data);
    const T* in = static_cast<const T*>(x.data);
    if (packed) gather_kernel<K, T><<<grid, threads, 0, stream>>>(out, in, perm, R, Rp, h, static_cast<int>(d.k));
    else gather_kernel<1, T><<<grid, threads, 0, stream>>>(out, in, perm, R, Rp, h, static_cast<int>(d.k));
    LOOM_CUDA_LAUNCH_CHECK("moe gather_kernel", "R=", R, " padded to ", Rp, " h=", h, " ", dtype_name(x.dtype),
                           packed ? " packed" : " scalar", " grid=", grid, " threads=", threads);
  });
}

namespace {

// The combine and the scatter-add: per token, the sorted slots' rows of src
// summed into out (weighted when w is given).
void launch_token_sum(Tensor& out, const Tensor& src, const int32_t* row_of, const float* w, bool accumulate,
                      const MoeDims& d, cudaStream_t stream, const char* name) {
  const int64_t N = d.N, h = d.h;
  if (N == 0) return;
  dispatch_float(out.dtype, name, [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const bool packed = rows_packable<T, K>(h, {out.data, src.data});
    const int threads = row_threads(packed ? h / K : h, kRowThreads);
    const unsigned grid = row_grid(N);
    T* o = static_cast<T*>(out.data);
    const T* s = static_cast<const T*>(src.data);
    const int k = static_cast<int>(d.k);
    if (packed) token_sum_kernel<K, T><<<grid, threads, 0, stream>>>(o, s, row_of, w, N, h, k, accumulate);
    else token_sum_kernel<1, T><<<grid, threads, 0, stream>>>(o, s, row_of, w, N, h, k, accumulate);
    LOOM_CUDA_LAUNCH_CHECK(name, "N=", N, " h=", h, " k=", d.k, " ", dtype_name(out.dtype),
                           packed ? " packed" : " scalar", " grid=", grid, " threads=", threads);
  });
}

}  // namespace

void moe_combine(Tensor& y, const Tensor& eout, const float* weights, const int32_t* row_of, const MoeDims& d,
                 cudaStream_t stream) {
  cpu::moe_check(d);
  check_rows(eout, eout.dtype, d.padded_rows(), d.h, "moe_combine eout");
  check_rows(y, eout.dtype, d.N, d.h, "moe_combine y");
  check_ptr(weights, d.rows(), "moe_combine weights");
  check_ptr(row_of, d.rows(), "moe_combine row_of");
  launch_token_sum(y, eout, row_of, weights, false, d, stream, "moe combine (token_sum_kernel)");
}

void moe_scatter_add(Tensor& dx, const Tensor& d_xs, const int32_t* row_of, bool accumulate, const MoeDims& d,
                     cudaStream_t stream) {
  cpu::moe_check(d);
  check_rows(d_xs, d_xs.dtype, d.padded_rows(), d.h, "moe_scatter_add d_xs");
  check_rows(dx, d_xs.dtype, d.N, d.h, "moe_scatter_add dx");
  check_ptr(row_of, d.rows(), "moe_scatter_add row_of");
  launch_token_sum(dx, d_xs, row_of, nullptr, accumulate, d, stream, "moe scatter_add (token_sum_kernel)");
}

void moe_combine_backward(Tensor& d_eout, float* d_weights, const Tensor& dy, const Tensor& eout,
                          const float* weights, const int32_t* perm, const MoeDims& d, cudaStream_t stream) {
  cpu::moe_check(d);
  const int64_t R = d.rows(), Rp = d.padded_rows(), h = d.h;
  check_rows(eout, eout.dtype, Rp, h, "moe_combine_backward eout");
  check_rows(d_eout, eout.dtype, Rp, h, "moe_combine_backward d_eout");
  check_rows(dy, eout.dtype, d.N, h, "moe_combine_backward dy");
  check_ptr(d_weights, R, "moe_combine_backward d_weights");
  check_ptr(weights, R, "moe_combine_backward weights");
  check_ptr(perm, Rp, "moe_combine_backward perm");
  if (Rp == 0) return;
  dispatch_float(eout.dtype, "moe_combine_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const bool packed = rows_packable<T, K>(h, {d_eout.data, dy.data, eout.data});
    const int threads = row_threads(packed ? h / K : h, kRowThreads);
    const unsigned grid = row_grid(Rp);
    const int k = static_cast<int>(d.k);
    T* de = static_cast<T*>(d_eout.data);
    const T* g = static_cast<const T*>(dy.data);
    const T* o = static_cast<const T*>(eout.data);
    if (packed)
      combine_backward_kernel<K, T><<<grid, threads, 0, stream>>>(de, d_weights, g, o, weights, perm, R, Rp, h, k);
    else
      combine_backward_kernel<1, T><<<grid, threads, 0, stream>>>(de, d_weights, g, o, weights, perm, R, Rp, h, k);
    LOOM_CUDA_LAUNCH_CHECK("moe combine_backward_kernel", "R=", R, " padded to ", Rp, " h=", h, " ",
                           dtype_name(eout.dtype),
                           packed ? " packed" : " scalar", " grid=", grid, " threads=", threads);
  });
}

void moe_route_backward(float* d_logits, const float* d_weights, const float* probs, const int32_t* experts,
                        const float* weights, const float* aux_dprobs, const MoeDims& d, cudaStream_t stream) {
  cpu::moe_check(d);
  const int64_t N = d.N, E = d.E, k = d.k;
  check_ptr(d_logits, N * E, "moe_route_backward d_logits");
  check_ptr(d_weights, N * k, "moe_route_backward d_weights");
  check_ptr(probs, N * E, "moe_route_backward probs");
  check_ptr(experts, N * k, "moe_route_backward experts");
  check_ptr(weights, N * k, "moe_route_backward weights");
  if (N == 0) return;
  const unsigned grid = grid_for(N, kTokenThreads);
  route_backward_kernel<<<grid, kTokenThreads, 0, stream>>>(d_logits, d_weights, probs, experts, weights, aux_dprobs,
                                                            N, static_cast<int>(E), static_cast<int>(k));
  LOOM_CUDA_LAUNCH_CHECK("moe route_backward_kernel", "N=", N, " E=", E, " k=", k,
                         aux_dprobs ? " with aux" : " no aux", " grid=", grid);
}

void moe_aux_accumulate(int64_t* aux_counts, double* aux_prob_sum, const int64_t* counts, const float* probs,
                        const MoeDims& d, cudaStream_t stream) {
  cpu::moe_check(d);
  check_ptr(aux_counts, d.E, "moe_aux_accumulate aux_counts");
  check_ptr(aux_prob_sum, d.E, "moe_aux_accumulate aux_prob_sum");
  check_ptr(counts, d.E, "moe_aux_accumulate counts");
  check_ptr(probs, d.N * d.E, "moe_aux_accumulate probs");
  // Threads depend on N alone: the reduction order is a function of the shape.
  const int threads = row_threads(d.N, kRowThreads);
  const unsigned grid = row_grid(d.E);
  aux_accumulate_kernel<<<grid, threads, 0, stream>>>(aux_counts, aux_prob_sum, counts, probs, d.N,
                                                      static_cast<int>(d.E));
  LOOM_CUDA_LAUNCH_CHECK("moe aux_accumulate_kernel", "N=", d.N, " E=", d.E, " grid=", grid, " threads=", threads);
}

void moe_aux_finish(double* loss, float* grad, const int64_t* aux_counts, const double* aux_prob_sum,
                    int64_t rows, double coef, int64_t num_experts, cudaStream_t stream) {
  LOOM_CHECK(num_experts >= 1 && rows >= 0, "moe_aux_finish: num_experts = ", num_experts, ", rows = ", rows,
             " (need at least one expert and a non-negative row count)");
  check_ptr(grad, num_experts, "moe_aux_finish grad");
  check_ptr(aux_counts, num_experts, "moe_aux_finish aux_counts");
  check_ptr(aux_prob_sum, num_experts, "moe_aux_finish aux_prob_sum");
  aux_finish_kernel<<<1, 1, 0, stream>>>(loss, grad, aux_counts, aux_prob_sum, rows, coef, num_experts);
  LOOM_CUDA_LAUNCH_CHECK("moe aux_finish_kernel", "rows=", rows, " coef=", coef, " E=", num_experts);
}

// ---- router GEMM, jitter, aux statistics (the CUDA backend's moe_* steps) ---------------

namespace {

constexpr int kRouterWarps = 8;       // tokens per block of the router forward
constexpr int kRouterGroup = 8;       // experts per pass over a token's row (router forward)
constexpr int kRouterDwThreads = 256;  // threads (K hidden columns each) per block of the router's weight gradient
constexpr int kRouterDwGroup = 8;      // experts per pass (registers per thread)
constexpr int64_t kRouterDwMinChunk = 64;
constexpr int64_t kRouterDwSliceChunks = 16;  // token chunks of a pass over a slice of the experts

// logits[n, e] = x[n] . w[e]: a warp per token, K-wide loads (16 bytes when
// h and the bases allow, K = 1 otherwise), the experts kRouterGroup at a time
// so that a group reads the token's row once (w, E x h, stays in L1/L2). Each
// lane sums its columns in order, then the warp adds the lanes (a fixed
// order: the same bits on every run).
template <int K, typename T>
__global__ void __launch_bounds__(kRouterWarps * 32)
    router_forward_kernel(float* logits, const T* __restrict__ x, const T* __restrict__ w, int64_t N, int64_t h,
                          int E) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRouterWarps;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * kRouterWarps + threadIdx.x / 32; n < N; n += warps) {
    const T* xr = x + n * h;
    for (int e0 = 0; e0 < E; e0 += kRouterGroup) {
      float acc[kRouterGroup];
#pragma unroll
      for (int i = 0; i < kRouterGroup; ++i) acc[i] = 0.f;
      for (int64_t j = static_cast<int64_t>(lane) * K; j < h; j += 32 * K) {
        float xv[K];
        load_vec<K>(xr + j, xv);
#pragma unroll
        for (int i = 0; i < kRouterGroup; ++i) {
          if (e0 + i >= E) break;
          float wv[K];
          load_vec<K>(w + static_cast<int64_t>(e0 + i) * h + j, wv);
#pragma unroll
          for (int q = 0; q < K; ++q) acc[i] = fmaf(xv[q], wv[q], acc[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kRouterGroup; ++i) {
        const float s = warp_sum(acc[i]);  // every lane takes part (the shuffle needs all 32)
        if (lane == 0 && e0 + i < E) logits[n * E + e0 + i] = s;
      }
    }
  }
}

// dx[n, j..j+K) = sum over e of dl[n, e] w[e, j..j+K): a thread per K columns
// of a row, the experts in order.
template <int K, typename T>
__global__ void router_dx_kernel(T* __restrict__ dx, const float* __restrict__ dl, const T* __restrict__ w, int64_t N,
                                 int64_t h, int E) {
  const int64_t nvec = h / K, total = N * nvec, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t n = i / nvec, j = (i % nvec) * K;
    const float* dln = dl + n * E;
    float acc[K];
#pragma unroll
    for (int q = 0; q < K; ++q) acc[q] = 0.f;
    for (int e = 0; e < E; ++e) {
      const float g = dln[e];
      float wv[K];
      load_vec<K>(w + static_cast<int64_t>(e) * h + j, wv);
#pragma unroll
      for (int q = 0; q < K; ++q) acc[q] = fmaf(g, wv[q], acc[q]);
    }
    store_vec<K>(dx + n * h + j, acc);
  }
}

// partial[c, e - ebegin, j] = sum over the tokens of chunk c of dl[n, e] x[n, j],
// for the experts e of [ebegin, eend) (all E when the [E h] partials of every
// chunk fit the scratch; a slice of them otherwise, see router_dw_plan). A
// thread takes K consecutive columns (one K-wide load of x per token) and
// kRouterDwGroup experts at a time; the tokens of its chunk in order.
template <int K, typename T>
__global__ void __launch_bounds__(kRouterDwThreads)
    router_dw_partial_kernel(float* __restrict__ partial, const float* __restrict__ dl, const T* __restrict__ x,
                             int64_t N, int64_t h, int E, int ebegin, int eend, int64_t chunk) {
  const int64_t j = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * K;
  const int64_t c = blockIdx.y;
  if (j >= h) return;
  const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
  const int64_t ne = eend - ebegin;
  for (int e0 = ebegin; e0 < eend; e0 += kRouterDwGroup) {
    float acc[kRouterDwGroup][K];
#pragma unroll
    for (int i = 0; i < kRouterDwGroup; ++i)
#pragma unroll
      for (int q = 0; q < K; ++q) acc[i][q] = 0.f;
#pragma unroll 4
    for (int64_t n = n0; n < n1; ++n) {
      float xv[K];
      load_vec<K>(x + n * h + j, xv);
#pragma unroll
      for (int i = 0; i < kRouterDwGroup; ++i) {
        if (e0 + i >= eend) break;
        const float g = dl[n * E + e0 + i];
#pragma unroll
        for (int q = 0; q < K; ++q) acc[i][q] = fmaf(g, xv[q], acc[i][q]);
      }
    }
#pragma unroll
    for (int i = 0; i < kRouterDwGroup; ++i) {
      if (e0 + i >= eend) break;
      store_vec<K>(partial + (c * ne + (e0 - ebegin) + i) * h + j, acc[i]);
    }
  }
}

// dw[i] += sum over chunks, in chunk order, of partial[c, i]: Eh = the
// elements of one slice of experts (dw points at the slice's first row).
template <typename G>
__global__ void router_dw_reduce_kernel(G* dw, const float* partial, int64_t chunks, int64_t Eh) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < Eh; i += stride) {
    float acc = 0.f;
    for (int64_t c = 0; c < chunks; ++c) acc += partial[c * Eh + i];
    dw[i] = from_f32<G>(to_f32(dw[i]) + acc);
  }
}

__device__ __forceinline__ uint64_t splitmix64_dev(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t splitmix64_host(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
__device__ __forceinline__ T from_f64(double v);
template <>
__device__ __forceinline__ float from_f64<float>(double v) { return __double2float_rn(v); }
template <>
__device__ __forceinline__ bf16 from_f64<bf16>(double v) { return __float2bfloat16_rn(__double2float_rn(v)); }

template <typename T>
__global__ void jitter_kernel(T* xin, T* noise, const T* x, int64_t n, double eps, uint64_t base) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double u = static_cast<double>(splitmix64_dev(base + static_cast<uint64_t>(i)) >> 11) * 0x1.0p-53;
    const T nz = from_f64<T>(__dadd_rn(__dsub_rn(1.0, eps), __dmul_rn(__dmul_rn(2.0, eps), u)));
    noise[i] = nz;
    xin[i] = from_f32<T>(__fmul_rn(to_f32(x[i]), to_f32(nz)));
  }
}

template <typename T>
__global__ void scale_by_kernel(T* dx, const T* noise, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dx[i] = from_f32<T>(__fmul_rn(to_f32(dx[i]), to_f32(noise[i])));
}

__global__ void __launch_bounds__(kRowThreads)
    aux_accumulate_flat_kernel(double* stats, const int64_t* counts, const float* probs, int64_t N, int E) {
  __shared__ double red[32];
  for (int e = blockIdx.x; e < E; e += gridDim.x) {
    double acc = 0.0;
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) acc = __dadd_rn(acc, static_cast<double>(probs[n * E + e]));
    const double total = block_sum(acc, red);
    if (threadIdx.x == 0) {
      stats[E + e] = __dadd_rn(stats[E + e], total);
      stats[e] = __dadd_rn(stats[e], static_cast<double>(counts[e]));
      if (e == 0) stats[2 * E] = __dadd_rn(stats[2 * E], static_cast<double>(N));
    }
  }
}

__global__ void aux_finish_flat_kernel(float* aux, float* grad, const double* st, double coef, int64_t E) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const double R = st[2 * E];
  double acc = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    if (R == 0.0) {
      grad[e] = 0.f;
      continue;
    }
    acc = __dadd_rn(acc, __dmul_rn(__ddiv_rn(st[e], R), __ddiv_rn(st[E + e], R)));
    // CPU: coef * E * (stats[e] / R) / R, left to right.
    grad[e] = __double2float_rn(__ddiv_rn(__dmul_rn(__dmul_rn(coef, static_cast<double>(E)), __ddiv_rn(st[e], R)), R));
  }
  aux[0] = R == 0.0 ? 0.f : __double2float_rn(__dmul_rn(static_cast<double>(E), acc));
}

void check_same(const Tensor& a, const Tensor& b, const char* what) {
  LOOM_CHECK(a.dtype == b.dtype && a.numel() == b.numel(), what, ": ", a.shape_str(), " ", dtype_name(a.dtype),
             " and ", b.shape_str(), " ", dtype_name(b.dtype), " must have one dtype and size");
}

// How the router's weight gradient is reduced: token chunks of `chunk` rows
// (each at least kRouterDwMinChunk tokens, at most 1024 chunks) and experts
// taken `group` at a time, so that a group's [chunks, group, h] fp32 partials
// fit the scratch. All E experts are one group when the scratch holds a
// chunk's [E h] partials (E = 8, h = 4096: 128 KiB a chunk); a wide router
// (E = 4096, h = 4096: 64 MiB a chunk, four times the backend's 16 MiB
// scratch) is reduced in slices of experts, one pass each. A function of the
// shape and the scratch size: the summation order, and so the bits, are too.
struct RouterDwPlan {
  int64_t chunk = 0, chunks = 0, group = 0;
};

RouterDwPlan router_dw_plan(const MoeDims& d, size_t scratch_bytes) {
  const int64_t row = d.h * static_cast<int64_t>(sizeof(float));  // one expert's partial of one chunk
  const int64_t fit = static_cast<int64_t>(scratch_bytes) / row;  // such partials the scratch holds
  LOOM_CHECK(fit >= 1, "moe router backward: one expert's fp32 partial of hidden = ", d.h, " (", row,
             " bytes) does not fit the scratch of ", scratch_bytes, " bytes");
  RouterDwPlan p;
  // A slice of experts re-reads x once, so slices are as wide as the scratch
  // allows, less a factor of kRouterDwSliceChunks: enough token chunks that a
  // pass has more than a handful of blocks (one chunk of every token would
  // leave each thread a serial loop over all N tokens).
  p.group = fit >= d.E ? d.E : std::max<int64_t>(1, fit / kRouterDwSliceChunks);
  const int64_t cap = std::min<int64_t>(1024, fit / p.group);
  p.chunk = std::max<int64_t>(kRouterDwMinChunk, (d.N + cap - 1) / cap);
  p.chunks = d.N == 0 ? 0 : (d.N + p.chunk - 1) / p.chunk;
  return p;
}

}  // namespace

void moe_router_forward(float* logits, const Tensor& x, const Tensor& router, const MoeDims& d, cudaStream_t stream) {
  cpu::moe_check(d);
  check_rows(x, x.dtype, d.N, d.h, "moe_router_forward x");
  check_rows(router, x.dtype, d.E, d.h, "moe_router_forward router");
  check_ptr(logits, d.N * d.E, "moe_router_forward logits");
  if (d.N == 0) return;
  dispatch_float(x.dtype, "moe_router_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const bool packed = rows_packable<T, K>(d.h, {x.data, router.data});
    const unsigned grid = grid_for(d.N, kRouterWarps);
    const T* xp = static_cast<const T*>(x.data);
    const T* wp = static_cast<const T*>(router.data);
    if (packed)
      router_forward_kernel<K, T><<<grid, kRouterWarps * 32, 0, stream>>>(logits, xp, wp, d.N, d.h,
                                                                        static_cast<int>(d.E));
    else
      router_forward_kernel<1, T><<<grid, kRouterWarps * 32, 0, stream>>>(logits, xp, wp, d.N, d.h,
                                                                        static_cast<int>(d.E));
    LOOM_CUDA_LAUNCH_CHECK("moe router_forward_kernel", "N=", d.N, " h=", d.h, " E=", d.E, " ",
                           dtype_name(x.dtype), packed ? " packed" : " scalar", " grid=", grid);
  });
}

void moe_router_backward(Tensor& dx, Tensor& d_router, const float* d_logits, const Tensor& x, const Tensor& router,
                         void* scratch, size_t scratch_bytes, const MoeDims& d, cudaStream_t stream) {
  cpu::moe_check(d);
  check_rows(x, x.dtype, d.N, d.h, "moe_router_backward x");
  check_rows(dx, x.dtype, d.N, d.h, "moe_router_backward dx");
  check_rows(router, x.dtype, d.E, d.h, "moe_router_backward router");
  check_device(d_router, "moe_router_backward d_router");
  check_contiguous(d_router, "moe_router_backward d_router");
  LOOM_CHECK(d_router.numel() == d.E * d.h, "moe_router_backward d_router is ", d_router.shape_str(),
             ", expected [", d.E, ", ", d.h, "]");
  check_ptr(d_logits, d.N * d.E, "moe_router_backward d_logits");
  check_ptr(scratch, 1, "moe_router_backward scratch");
  if (d.N == 0) return;
  const RouterDwPlan plan = router_dw_plan(d, scratch_bytes);
  float* partial = static_cast<float*>(scratch);
  dispatch_float(x.dtype, "moe_router_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const bool packed = rows_packable<T, K>(d.h, {dx.data, router.data});
    const unsigned grid = grid_for(d.N * (packed ? d.h / K : d.h), kRowThreads);
    T* dxp = static_cast<T*>(dx.data);
    const T* wp = static_cast<const T*>(router.data);
    if (packed)
      router_dx_kernel<K, T><<<grid, kRowThreads, 0, stream>>>(dxp, d_logits, wp, d.N, d.h, static_cast<int>(d.E));
    else
      router_dx_kernel<1, T><<<grid, kRowThreads, 0, stream>>>(dxp, d_logits, wp, d.N, d.h, static_cast<int>(d.E));
    LOOM_CUDA_LAUNCH_CHECK("moe router_dx_kernel", "N=", d.N, " h=", d.h, " E=", d.E, " ", dtype_name(x.dtype),
                           packed ? " packed" : " scalar", " grid=", grid);
  });
  // One pass per slice of experts: its chunk partials, then their sum into
  // the slice's rows of d_router (the scratch is reused by the next slice;
  // both kernels run on `stream`, in order).
  for (int64_t e0 = 0; e0 < d.E; e0 += plan.group) {
    const int64_t e1 = std::min<int64_t>(d.E, e0 + plan.group);
    dispatch_float(x.dtype, "moe_router_backward", [&](auto tag) {
      using T = decltype(tag);
      constexpr int K = vec_width<T>();
      // Packed: K-wide loads of x and K-wide stores of the fp32 partials (16-byte chunks).
      const bool packed = rows_packable<T, K>(d.h, {x.data}) && aligned_bytes(partial, 16);
      const int64_t cols = packed ? d.h / K : d.h;  // threads per token chunk
      const dim3 pgrid(static_cast<unsigned>((cols + kRouterDwThreads - 1) / kRouterDwThreads),
                       static_cast<unsigned>(plan.chunks));
      const T* xp = static_cast<const T*>(x.data);
      if (packed)
        router_dw_partial_kernel<K, T><<<pgrid, kRouterDwThreads, 0, stream>>>(
            partial, d_logits, xp, d.N, d.h, static_cast<int>(d.E), static_cast<int>(e0), static_cast<int>(e1),
            plan.chunk);
      else
        router_dw_partial_kernel<1, T><<<pgrid, kRouterDwThreads, 0, stream>>>(
            partial, d_logits, xp, d.N, d.h, static_cast<int>(d.E), static_cast<int>(e0), static_cast<int>(e1),
            plan.chunk);
      LOOM_CUDA_LAUNCH_CHECK("moe router_dw_partial_kernel", "N=", d.N, " h=", d.h, " E=", d.E, " experts [", e0,
                             ", ", e1, ") chunk=", plan.chunk, " chunks=", plan.chunks,
                             packed ? " packed" : " scalar");
    });
    dispatch_float(d_router.dtype, "moe_router_backward d_router", [&](auto tag) {
      using G = decltype(tag);
      const int64_t eh = (e1 - e0) * d.h;
      const unsigned grid = grid_for(eh, kRowThreads);
      router_dw_reduce_kernel<G><<<grid, kRowThreads, 0, stream>>>(static_cast<G*>(d_router.data) + e0 * d.h,
                                                                    partial, plan.chunks, eh);
      LOOM_CUDA_LAUNCH_CHECK("moe router_dw_reduce_kernel", "E=", d.E, " h=", d.h, " experts [", e0, ", ", e1,
                             ") chunks=", plan.chunks, " ", dtype_name(d_router.dtype), " grid=", grid);
    });
  }
}

void moe_jitter(Tensor& xin, Tensor& noise, const Tensor& x, double eps, uint64_t seed, cudaStream_t stream) {
  LOOM_CHECK(eps >= 0.0 && eps < 1.0, "moe: router_jitter_noise = ", eps, " must be in [0, 1)");
  check_device(x, "moe_jitter x");
  check_device(xin, "moe_jitter xin");
  check_device(noise, "moe_jitter noise");
  check_contiguous(x, "moe_jitter x");
  check_contiguous(xin, "moe_jitter xin");
  check_contiguous(noise, "moe_jitter noise");
  check_same(xin, x, "moe_jitter xin, x");
  check_same(noise, x, "moe_jitter noise, x");
  const int64_t n = x.numel();
  if (n == 0) return;
  const uint64_t base = splitmix64_host(seed);
  dispatch_float(x.dtype, "moe_jitter", [&](auto tag) {
    using T = decltype(tag);
    const unsigned grid = grid_for(n, kRowThreads);
    jitter_kernel<T><<<grid, kRowThreads, 0, stream>>>(static_cast<T*>(xin.data), static_cast<T*>(noise.data),
                                                        static_cast<const T*>(x.data), n, eps, base);
    LOOM_CUDA_LAUNCH_CHECK("moe jitter_kernel", "n=", n, " eps=", eps, " seed=", seed, " ", dtype_name(x.dtype),
                           " grid=", grid);
  });
}

void moe_scale_by(Tensor& dx, const Tensor& noise, cudaStream_t stream) {
  check_device(dx, "moe_scale_by dx");
  check_device(noise, "moe_scale_by noise");
  check_contiguous(dx, "moe_scale_by dx");
  check_contiguous(noise, "moe_scale_by noise");
  check_same(dx, noise, "moe_scale_by dx, noise");
  const int64_t n = dx.numel();
  if (n == 0) return;
  dispatch_float(dx.dtype, "moe_scale_by", [&](auto tag) {
    using T = decltype(tag);
    const unsigned grid = grid_for(n, kRowThreads);
    scale_by_kernel<T><<<grid, kRowThreads, 0, stream>>>(static_cast<T*>(dx.data), static_cast<const T*>(noise.data),
                                                          n);
    LOOM_CUDA_LAUNCH_CHECK("moe scale_by_kernel", "n=", n, " ", dtype_name(dx.dtype), " grid=", grid);
  });
}

void moe_aux_accumulate_flat(double* stats, const int64_t* counts, const float* probs, const MoeDims& d,
                             cudaStream_t stream) {
  cpu::moe_check(d);
  check_ptr(stats, 2 * d.E + 1, "moe_aux_accumulate_flat stats");
  check_ptr(counts, d.E, "moe_aux_accumulate_flat counts");
  check_ptr(probs, d.N * d.E, "moe_aux_accumulate_flat probs");
  const int threads = row_threads(d.N, kRowThreads);  // a function of N: a fixed reduction order
  const unsigned grid = row_grid(d.E);
  aux_accumulate_flat_kernel<<<grid, threads, 0, stream>>>(stats, counts, probs, d.N, static_cast<int>(d.E));
  LOOM_CUDA_LAUNCH_CHECK("moe aux_accumulate_flat_kernel", "N=", d.N, " E=", d.E, " grid=", grid,
                         " threads=", threads);
}

void moe_aux_finish_flat(float* aux, float* dprobs, const double* stats, double coef, int64_t E,
                         cudaStream_t stream) {
  LOOM_CHECK(E >= 1, "moe_aux_finish_flat: num_experts = ", E, " must be at least 1");
  check_ptr(aux, 1, "moe_aux_finish_flat aux");
  check_ptr(dprobs, E, "moe_aux_finish_flat dprobs");
  check_ptr(stats, 2 * E + 1, "moe_aux_finish_flat stats");
  aux_finish_flat_kernel<<<1, 1, 0, stream>>>(aux, dprobs, stats, coef, E);
  LOOM_CUDA_LAUNCH_CHECK("moe aux_finish_flat_kernel", "coef=", coef, " E=", E);
}

}  // namespace loom::gpu
