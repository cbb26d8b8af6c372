// Naive attention, forward and backward (see the header for layout and threading).
//
//   s_ij = scale * q_i . k_j          (j <= i when causal)
//   P_ij = exp(s_ij - lse_i),  lse_i = log sum_j exp(s_ij)
//   o_i  = sum_j P_ij v_j
// Backward, with dP_ij = do_i . v_j and D_i = sum_j P_ij dP_ij:
//   dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij do_i
// Document masking narrows j to the query's own span: j >= i - positions[i].
// D_i is summed from the recomputed P and dP rather than taken as do_i . o_i:
// the two agree mathematically, and this way backward depends only on q, k, v
// and the stats, not on the rounding of the stored output.
#include "attention/naive/attention_naive_cpu.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "loom/error.hpp"

namespace loom::naive {

void check_dims(const AttnDims& d) {
  LOOM_CHECK(d.B > 0 && d.S > 0 && d.H > 0 && d.Hkv > 0 && d.D > 0, "naive attention: dims must be positive, got B=",
             d.B, " S=", d.S, " H=", d.H, " Hkv=", d.Hkv, " D=", d.D);
  LOOM_CHECK(d.positions == nullptr || d.causal, "naive attention: document masking is causal within each document; ",
             "a non-causal shape with document positions is not supported");
  LOOM_CHECK(d.H % d.Hkv == 0, "naive attention: heads=", d.H, " is not a multiple of kv_heads=", d.Hkv,
             " (grouped-query attention shares each kv head among H/Hkv query heads)");
  LOOM_CHECK(std::isfinite(d.scale) && d.scale > 0, "naive attention: softmax scale must be finite and > 0, got ",
             d.scale, " (normally 1/sqrt(head_dim) = ", 1.0 / std::sqrt(static_cast<double>(d.D)), ")");
}

int64_t forward_scratch_doubles(const AttnDims& d) { return d.S + d.D; }
int64_t backward_scratch_doubles(const AttnDims& d) { return 2 * d.S + d.D + 2 * d.S * d.D; }

namespace {

// The first key query i of row b sees: its document span's first token.
int64_t first_key(const AttnDims& d, int64_t b, int64_t i) {
  if (!d.positions) return 0;
  const int64_t p = d.positions[b * d.S + i];
  LOOM_CHECK(p >= 0 && p <= i, "naive attention: document position ", p, " of token ", i, " of row ", b,
             " is outside [0, ", i, "]: positions count from each span's first token");
  return i - p;
}

template <typename T>
double dot(const T* a, const T* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

}  // namespace

template <typename T>
void attention_forward(const AttnDims& d, T* out, Bshd os, T* stats, const T* q, Bshd qs, const T* k, Bshd ks,
                       const T* v, Bshd vs, double* scratch, int workers) {
  check_dims(d);
  LOOM_CHECK(workers >= 1 && scratch != nullptr, "naive attention forward: needs scratch for workers>=1, got workers=",
             workers, " scratch=", static_cast<const void*>(scratch));
  const int64_t group = d.H / d.Hkv, D = d.D, S = d.S;
  const int64_t per_worker = forward_scratch_doubles(d);
  for (int64_t b = 0; d.positions && b < d.B; ++b)  // checked here: an exception cannot leave the OpenMP region
    for (int64_t i = 0; i < S; ++i) (void)first_key(d, b, i);
#pragma omp parallel num_threads(workers)
  {
    double* p = scratch + omp_get_thread_num() * per_worker;  // scores of one query row, [S]
    double* acc = p + S;                                      // output row accumulator, [D]
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < d.B * d.H; ++bh) {
      const int64_t b = bh / d.H, h = bh % d.H, hk = h / group;
      const T* kb = k + b * ks.b + hk * ks.h;
      const T* vb = v + b * vs.b + hk * vs.h;
      for (int64_t i = 0; i < S; ++i) {
        const T* qi = q + b * qs.b + i * qs.s + h * qs.h;
        const int64_t jend = d.causal ? i + 1 : S;  // keys after i are masked out
        const int64_t jbeg = first_key(d, b, i);    // and keys of earlier documents
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = jbeg; j < jend; ++j) {
          p[j] = d.scale * dot(qi, kb + j * ks.s, D);
          m = std::max(m, p[j]);
        }
        // Max-subtracted so that no exp overflows.
        double sum = 0.0;
        for (int64_t j = jbeg; j < jend; ++j) sum += std::exp(p[j] - m);
        const double lse = m + std::log(sum);
        std::fill(acc, acc + D, 0.0);
        for (int64_t j = jbeg; j < jend; ++j) {
          const double pij = std::exp(p[j] - lse);
          const T* vj = vb + j * vs.s;
          for (int64_t c = 0; c < D; ++c) acc[c] += pij * vj[c];
        }
        T* oi = out + b * os.b + i * os.s + h * os.h;
        for (int64_t c = 0; c < D; ++c) oi[c] = static_cast<T>(acc[c]);
        stats[(b * d.H + h) * S + i] = static_cast<T>(lse);
      }
    }
  }
}

template <typename T>
void attention_backward(const AttnDims& d, T* dq, Bshd dqs, T* dk, Bshd dks, T* dv, Bshd dvs, const T* dout, Bshd dos,
                        const T* q, Bshd qs, const T* k, Bshd ks, const T* v, Bshd vs, const T* stats,
                        double* scratch, int workers) {
  check_dims(d);
  LOOM_CHECK(workers >= 1 && scratch != nullptr, "naive attention backward: needs scratch for workers>=1, got workers=",
             workers, " scratch=", static_cast<const void*>(scratch));
  const int64_t group = d.H / d.Hkv, D = d.D, S = d.S;
  const int64_t per_worker = backward_scratch_doubles(d);
  for (int64_t b = 0; d.positions && b < d.B; ++b)  // checked here: an exception cannot leave the OpenMP region
    for (int64_t i = 0; i < S; ++i) (void)first_key(d, b, i);
#pragma omp parallel num_threads(workers)
  {
    double* p = scratch + omp_get_thread_num() * per_worker;  // P row, [S]
    double* ds = p + S;                                       // dS row, [S]
    double* dqa = ds + S;                                     // dq row accumulator, [D]
    double* dka = dqa + D;                                    // dk of this kv head, [S, D]
    double* dva = dka + S * D;                                // dv of this kv head, [S, D]
#pragma omp for schedule(static)
    for (int64_t bg = 0; bg < d.B * d.Hkv; ++bg) {
      const int64_t b = bg / d.Hkv, hk = bg % d.Hkv;
      const T* kb = k + b * ks.b + hk * ks.h;
      const T* vb = v + b * vs.b + hk * vs.h;
      std::fill(dka, dka + 2 * S * D, 0.0);
      // The query heads sharing kv head hk, in order.
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i = 0; i < S; ++i) {
          const T* qi = q + b * qs.b + i * qs.s + h * qs.h;
          const T* doi = dout + b * dos.b + i * dos.s + h * dos.h;
          const double lse = stats[(b * d.H + h) * S + i];
          const int64_t jend = d.causal ? i + 1 : S;
          const int64_t jbeg = first_key(d, b, i);
          double Di = 0.0;
          for (int64_t j = jbeg; j < jend; ++j) {
            p[j] = std::exp(d.scale * dot(qi, kb + j * ks.s, D) - lse);  // P rebuilt from the saved lse
            ds[j] = dot(doi, vb + j * vs.s, D);                           // dP for now
            Di += p[j] * ds[j];
          }
          std::fill(dqa, dqa + D, 0.0);
          for (int64_t j = jbeg; j < jend; ++j) {
            const double dsij = p[j] * (ds[j] - Di);
            const T* kj = kb + j * ks.s;
            double* dkj = dka + j * D;
            double* dvj = dva + j * D;
            for (int64_t c = 0; c < D; ++c) {
              dqa[c] += dsij * kj[c];
              dkj[c] += d.scale * dsij * qi[c];
              dvj[c] += p[j] * doi[c];
            }
          }
          T* dqi = dq + b * dqs.b + i * dqs.s + h * dqs.h;
          for (int64_t c = 0; c < D; ++c) dqi[c] = static_cast<T>(d.scale * dqa[c]);
        }
      }
      for (int64_t j = 0; j < S; ++j) {
        T* dkj = dk + b * dks.b + j * dks.s + hk * dks.h;
        T* dvj = dv + b * dvs.b + j * dvs.s + hk * dvs.h;
        for (int64_t c = 0; c < D; ++c) {
          dkj[c] = static_cast<T>(dka[j * D + c]);
          dvj[c] = static_cast<T>(dva[j * D + c]);
        }
      }
    }
  }
}

template void attention_forward<float>(const AttnDims&, float*, Bshd, float*, const float*, Bshd, const float*, Bshd,
                                       const float*, Bshd, double*, int);
template void attention_forward<double>(const AttnDims&, double*, Bshd, double*, const double*, Bshd, const double*,
                                        Bshd, const double*, Bshd, double*, int);
template void attention_backward<float>(const AttnDims&, float*, Bshd, float*, Bshd, float*, Bshd, const float*, Bshd,
                                        const float*, Bshd, const float*, Bshd, const float*, Bshd, const float*,
                                        double*, int);
template void attention_backward<double>(const AttnDims&, double*, Bshd, double*, Bshd, double*, Bshd, const double*,
                                         Bshd, const double*, Bshd, const double*, Bshd, const double*, Bshd,
                                         const double*, double*, int);

}  // namespace loom::naive
