// Token embedding: a row gather forward, a row scatter-add backward.
#include <algorithm>

#include "kernels/cpu/cpu_kernels.hpp"
#include "loom/error.hpp"

namespace loom::cpu {
namespace {

template <typename T>
void embedding_forward_t(T* out, const int32_t* tokens, const T* wte, int64_t N, int64_t h) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* src = wte + static_cast<int64_t>(tokens[n]) * h;
    std::copy(src, src + h, out + n * h);
  }
}

// Several rows n may hit the same token, so parallelising over n would race
// (or need atomics, whose order varies). Instead each thread owns a block of
// columns and walks all n in order: every dwte element receives its additions
// in increasing n, whatever the thread count.
template <typename T>
void embedding_backward_t(T* dwte, const T* dout, const int32_t* tokens, int64_t N, int64_t h) {
  constexpr int64_t kCols = 64;
  const int64_t nblocks = (h + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t j0 = blk * kCols, j1 = std::min(h, j0 + kCols);
    for (int64_t n = 0; n < N; ++n) {
      T* dst = dwte + static_cast<int64_t>(tokens[n]) * h;
      const T* src = dout + n * h;
      for (int64_t j = j0; j < j1; ++j) dst[j] += src[j];
    }
  }
}

}  // namespace

void check_tokens(const int32_t* tokens, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n)
    LOOM_CHECK(tokens[n] >= 0 && tokens[n] < V, "token id ", tokens[n], " at position ", n,
               " is outside the vocabulary [0, ", V, "): the data does not match model.vocab_size");
}

void embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t h) {
  embedding_forward_t(out, tokens, wte, N, h);
}
void embedding_forward(double* out, const int32_t* tokens, const double* wte, int64_t N, int64_t h) {
  embedding_forward_t(out, tokens, wte, N, h);
}
void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t h) {
  embedding_backward_t(dwte, dout, tokens, N, h);
}
void embedding_backward(double* dwte, const double* dout, const int32_t* tokens, int64_t N, int64_t h) {
  embedding_backward_t(dwte, dout, tokens, N, h);
}

}  // namespace loom::cpu
