// The one cuBLASLt plan cache (loom/ops/gemm.hpp): bf16/fp16/fp32,
// per-tensor, outer-vector and block-scaled FP8 products.
//
// cuBLASLt is column-major. A row-major [r, c] matrix with row stride ld is,
// byte for byte, the column-major [c, r] one, so D[m, n] row-major is
// cuBLASLt's D'[n, m] (leading dimension ldd) = op(A') op(B') with A' = our
// B (M' = n) and B' = our A (N' = m), K' = k:
//   B k-major   [n, k] row-major = col-major k x n: op(A') = T
//   B otherwise [k, n] row-major = col-major n x k: op(A') = N
//   A k-major   [m, k] row-major = col-major k x m: op(B') = N
//   A otherwise [k, m] row-major = col-major m x k: op(B') = T
// and the scales and scale modes swap with the operands. FP8 products are
// then TN (both k-major), the only form of cuBLASLt's FP8 kernels on Hopper.
//
// The hot path (a plan built) allocates nothing and formats nothing: the
// key is a fixed-size array, messages are built only when a check fails.
// A plan is built on the first call of its key and never rebuilt, except
// once when cuBLASLt turns down the fused D amax at its first run (then the
// plan drops AMAX_D_POINTER and measures D with fp8_amax).
#include "loom/ops/gemm.hpp"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <string>

#include "loom/ops/cuda_check.hpp"
#include "loom/error.hpp"
#include "loom/fp8_block.hpp"
#include "loom/ops/fp8_cast.hpp"

// Throws a loom::Error naming `where`, the call and cuBLASLt's status.
#define LOOM_CUBLASLT_CHECK(call, where)                                                                        \
  do {                                                                                                          \
    const cublasStatus_t st_ = (call);                                                                          \
    LOOM_CHECK(st_ == CUBLAS_STATUS_SUCCESS, where, ": ", #call, " failed: ", cublasLtGetStatusName(st_), " (", \
               cublasLtGetStatusString(st_), ")");                                                              \
  } while (0)

namespace loom::ops {
namespace {

std::atomic<int64_t> g_plans_built{0};

bool is_fp8(DType t) { return t == DType::e4m3 || t == DType::e5m2; }

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::e4m3: return CUDA_R_8F_E4M3;
    case DType::e5m2: return CUDA_R_8F_E5M2;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    case DType::f32: return CUDA_R_32F;
    default: break;
  }
  throw Error(cat("gemm: dtype ", dtype_name(t), " has no cuBLASLt GEMM here (fp32, bf16, fp16, fp8_e4m3, fp8_e5m2)"));
}

int32_t lt_scale_mode(GemmScale s) {
  switch (s) {
    case GemmScale::outer: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case GemmScale::tile_1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case GemmScale::block_128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  }
}

bool is_block(GemmScale s) { return s == GemmScale::tile_1x128 || s == GemmScale::block_128x128; }

// Largest power of two (capped at 256, cuBLASLt's default assumption)
// dividing the address: what a plan records as an operand's alignment.
int64_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int64_t al = 256;
  while (al > 1 && (a % static_cast<uintptr_t>(al)) != 0) al /= 2;
  return al;
}

// Bytes [first, last) a row matrix touches.
struct Span {
  uintptr_t first, last;
};
Span span_of(const void* p, const RowMatrix& m, size_t elem) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return {a, a + static_cast<uintptr_t>(((m.rows - 1) * m.ld + m.cols) * static_cast<int64_t>(elem))};
}

// Key layout (every entry an int64).
// clang-format off
enum Key : int {
  kM, kN, kK, kLda, kLdb, kLdc, kLdd, kTypeA, kTypeB, kTypeD, kOrdA, kOrdB, kScaleA, kScaleB, kOwnC, kWantAmax, kFast,
  kAlA, kAlB, kAlC, kAlD, kVarying, kKeySize
};
// clang-format on
using KeyArr = std::array<int64_t, kKeySize>;

struct PrefGuard {
  cublasLtMatmulPreference_t p = nullptr;
  ~PrefGuard() {
    if (p) cublasLtMatmulPreferenceDestroy(p);
  }
};

}  // namespace

int64_t row_bucket(int64_t rows, int64_t most) {
  int64_t p = 1;
  while (p <= rows / 2) p *= 2;
  const int64_t q = p / 8 > 256 ? p / 8 : 256;
  const int64_t b = (rows + q - 1) / q * q;
  return b < most ? b : most;
}

const char* gemm_scale_name(GemmScale s) {
  switch (s) {
    case GemmScale::none: return "none";
    case GemmScale::tensor: return "tensor";
    case GemmScale::outer: return "outer";
    case GemmScale::tile_1x128: return "tile_1x128";
    case GemmScale::block_128x128: return "block_128x128";
  }
  return "?";
}

int64_t gemm_plans_built_total() { return g_plans_built.load(); }

// The matmul descriptor and the A', B', C', D' layouts of one plan (C' null:
// C uses D's layout), destroyed with it.
struct GemmPlans::Plan {
  KeyArr key{};
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_needed = 0;
  bool amax_fused = false;  // AMAX_D_POINTER set on op
  bool ran = false;         // a cublasLtMatmul succeeded with this plan
  // A bucket plan: the call dims its layouts hold and its algorithm passed
  // cublasLtMatmulAlgoCheck for (now_m -1: none yet, or the last check failed).
  int64_t now_m = -1, now_k = -1, now_lda = -1, now_ldb = -1;
  // The pointers last set on `op` (set again only when a call brings others).
  const void* lt_a_scale = nullptr;
  const void* lt_b_scale = nullptr;
  void* amax = nullptr;

  cublasLtMatrixLayout_t c_layout() const { return c ? c : d; }
  void destroy_op() {
    if (op) cublasLtMatmulDescDestroy(op);
    op = nullptr;
  }
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (d) cublasLtMatrixLayoutDestroy(d);
    destroy_op();
  }
};

GemmPlans::GemmPlans(void* cublaslt_handle, void* workspace, size_t workspace_bytes, GemmAlgo algo)
    : handle_(cublaslt_handle), algo_(algo) {
  set_workspace(workspace, workspace_bytes);
}

GemmPlans::~GemmPlans() = default;

void GemmPlans::set_workspace(void* workspace, size_t bytes) {
  LOOM_CHECK(bytes == 0 || workspace != nullptr, "gemm: a workspace of ", bytes, " bytes at a null pointer");
  LOOM_CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0,
             "gemm: the cuBLASLt workspace must be 256-byte aligned, got address ", workspace);
  workspace_ = workspace;
  if (bytes > kScaleSlotBytes) {
    scale_slots_ = reinterpret_cast<float*>(static_cast<char*>(workspace) + bytes - kScaleSlotBytes);
    workspace_bytes_ = bytes - kScaleSlotBytes;
  } else {
    scale_slots_ = nullptr;
    workspace_bytes_ = 0;
  }
}

namespace {

RowMatrix matrix_of(const Tensor& t, const char* what, bool fp8_rules) {
  LOOM_CHECK(t.device == Device::cuda, "gemm: ", what, " ", t.shape_str(), " is on ", device_name(t.device),
             "; cuBLASLt GEMMs run on cuda tensors");
  LOOM_CHECK(t.data != nullptr, "gemm: ", what, " ", t.shape_str(), " has no data");
  const RowMatrix m = fold_rows(t, "gemm: ", what);
  if (fp8_rules) {
    LOOM_CHECK(alignment_of(t.data) >= 16, "gemm: ", what, " at ", t.data,
               " is not 16-byte aligned; cuBLASLt FP8 kernels need 16-byte aligned operands and outputs",
               " (allocate it at a 16-byte boundary or copy it)");
    LOOM_CHECK((m.ld * static_cast<int64_t>(dtype_size(t.dtype))) % 16 == 0, "gemm: ", what, " ", t.shape_str(),
               " (", dtype_name(t.dtype), ") has a row stride of ", m.ld,
               " elements, not a multiple of 16 bytes, which cuBLASLt FP8 kernels need");
  }
  return m;
}

void check_dim(int64_t v, int64_t multiple, const char* name, const char* hint) {
  LOOM_CHECK(v > 0 && v % multiple == 0, "gemm: ", name, " = ", v, " is not a positive multiple of ", multiple,
             ", which cuBLASLt ", multiple == 16 ? "FP8" : "block-scaled FP8", " GEMMs need (", hint, ")");
}

}  // namespace

void GemmPlans::gemm(const GemmArgs& args, void* stream_p) {
  const auto stream = static_cast<cudaStream_t>(stream_p);
  // ---- arguments, all checked before anything runs ----
  LOOM_CHECK(args.struct_size == sizeof(GemmArgs), "gemm: GemmArgs of ", args.struct_size, " bytes, libloom's are ",
             sizeof(GemmArgs), " (ops API ", kGemmApiVersion,
             "): the caller was built against another Loom SDK; rebuild it against this one");
  const char* what = args.what != nullptr ? args.what : "";
  LOOM_CHECK(args.a.t != nullptr && args.b.t != nullptr && args.d != nullptr, what, ": gemm: A, B and D are required");
  const Tensor& a = *args.a.t;
  const Tensor& b = *args.b.t;
  Tensor& d = *args.d;
  const bool fp8 = is_fp8(a.dtype) || is_fp8(b.dtype);
  const GemmScale sa = args.a.scale, sb = args.b.scale;
  const bool block = is_block(sa) || is_block(sb);
  if (fp8) {
    LOOM_CHECK(is_fp8(a.dtype) && is_fp8(b.dtype), "gemm: A and B must be fp8_e4m3 or fp8_e5m2, got A ",
               dtype_name(a.dtype), " ", a.shape_str(), " and B ", dtype_name(b.dtype), " ", b.shape_str(),
               " (cast them with fp8_cast)");
    LOOM_CHECK(!(a.dtype == DType::e5m2 && b.dtype == DType::e5m2), "gemm: A ", a.shape_str(), " and B ",
               b.shape_str(), " are both fp8_e5m2; cuBLASLt has no E5M2 x E5M2 kernel. Cast one of them (the weight ",
               "or the activation) to E4M3, as the hybrid recipe does: only gradients are E5M2");
    LOOM_CHECK(d.dtype == DType::bf16 || d.dtype == DType::f32, "gemm: D must be bf16 or fp32, got ",
               dtype_name(d.dtype), " ", d.shape_str());
    LOOM_CHECK(args.a.k_major && args.b.k_major, "gemm: FP8 operands must be k-major ([m, k] and [n, k]); ",
               "cuBLASLt's FP8 kernels are TN only: cast the transposed copy (q_t)");
    LOOM_CHECK(sa != GemmScale::none && sb != GemmScale::none, "gemm: FP8 operands need a scale, got A ",
               gemm_scale_name(sa), " and B ", gemm_scale_name(sb));
    const bool pair_ok = (sa == GemmScale::tensor && sb == GemmScale::tensor) ||
                         (sa == GemmScale::outer && sb == GemmScale::outer) ||
                         (is_block(sa) && is_block(sb) && !(sa == GemmScale::block_128x128 && sb == sa));
    LOOM_CHECK(pair_ok, "gemm: scale modes A ", gemm_scale_name(sa), " and B ", gemm_scale_name(sb),
               " are not a pair cuBLASLt (13.1, Hopper) runs: tensor x tensor, outer x outer, or 1x128 tiles with ",
               "1x128 tiles or 128x128 blocks (not blocks on both)");
    LOOM_CHECK(!block || (a.dtype == DType::e4m3 && b.dtype == DType::e4m3),
               "gemm: block-scaled FP8 operands must be fp8_e4m3, got A ", dtype_name(a.dtype), " and B ",
               dtype_name(b.dtype));
    LOOM_CHECK(args.a.scale_inv != nullptr && args.b.scale_inv != nullptr,
               "gemm: the inverse scales must be device floats, got a_inv_scale ",
               static_cast<const void*>(args.a.scale_inv), " and b_inv_scale ",
               static_cast<const void*>(args.b.scale_inv));
    const int64_t need = sa == GemmScale::tensor ? 4 : 16;
    LOOM_CHECK(alignment_of(args.a.scale_inv) >= need && alignment_of(args.b.scale_inv) >= need &&
                   alignment_of(args.d_amax) >= 4,
               "gemm: scale pointers must be ", need, "-byte aligned device floats (amax 4), got a_inv_scale ",
               static_cast<const void*>(args.a.scale_inv), " b_inv_scale ",
               static_cast<const void*>(args.b.scale_inv), " d_amax ", static_cast<const void*>(args.d_amax));
  } else {
    LOOM_CHECK(a.dtype == b.dtype, "gemm: A is ", dtype_name(a.dtype), " but B is ", dtype_name(b.dtype),
               "; a non-FP8 product takes one dtype");
    cuda_type(a.dtype);
    LOOM_CHECK(sa == GemmScale::none && sb == GemmScale::none, "gemm: ", dtype_name(a.dtype),
               " operands take no scale, got A ", gemm_scale_name(sa), " and B ", gemm_scale_name(sb));
    LOOM_CHECK(args.d_amax == nullptr && !args.fast_accum, "gemm: D amax and fast accumulation are for FP8 products");
    LOOM_CHECK(d.dtype == a.dtype || d.dtype == DType::f32, "gemm: D is ", dtype_name(d.dtype), " but A and B are ",
               dtype_name(a.dtype), "; D takes their dtype or fp32");
  }
  const RowMatrix ma = matrix_of(a, "A", fp8);
  const RowMatrix mb = matrix_of(b, "B", fp8);
  const RowMatrix md = matrix_of(d, "D", fp8);
  const int64_t m = args.a.k_major ? ma.rows : ma.cols, k = args.a.k_major ? ma.cols : ma.rows;
  const int64_t n = args.b.k_major ? mb.rows : mb.cols, kb = args.b.k_major ? mb.cols : mb.rows;
  LOOM_CHECK(kb == k, "gemm: A is [", ma.rows, ", ", ma.cols, "] but B is [", mb.rows, ", ", mb.cols,
             "]: D = A B^T contracts the last dim of both (k = ", k, ")");
  LOOM_CHECK(md.rows == m && md.cols == n, "gemm: D is [", md.rows, ", ", md.cols, "] but A B^T is [", m, ", ", n,
             "] (A ", a.shape_str(), ", B ", b.shape_str(), ")");
  if (fp8) {
    const int64_t mult = block ? fp8::block::kBlock : 16;
    check_dim(m, mult, "m (rows of A and D)", "pad the token count, or the output features");
    check_dim(n, mult, "n (rows of B, columns of D)", "the linear's output or input features");
    check_dim(k, mult, "k (columns of A and B)", "the contracted features or tokens");
  }
  RowMatrix mc = md;
  if (args.c != nullptr) {
    const Tensor& c = *args.c;
    LOOM_CHECK(c.dtype == d.dtype, "gemm: C is ", dtype_name(c.dtype), " but D is ", dtype_name(d.dtype),
               "; cuBLASLt takes C in D's dtype when D is not FP8");
    mc = matrix_of(c, "C", fp8);
    LOOM_CHECK(mc.rows == m && mc.cols == n, "gemm: C is [", mc.rows, ", ", mc.cols, "] but D is [", m, ", ", n,
               "]; C must have D's shape");
    const size_t es = dtype_size(d.dtype);
    if (c.data == d.data) {
      // One row: fold_rows may report different strides for the same layout.
      LOOM_CHECK(mc.ld == md.ld || m == 1, "gemm: C is D's buffer with another row stride (", mc.ld, " vs ", md.ld,
                 "); an in-place GEMM needs one layout");
      mc.ld = md.ld;
    } else {
      const Span sc = span_of(c.data, mc, es), sd = span_of(d.data, md, es);
      LOOM_CHECK(sc.last <= sd.first || sd.last <= sc.first, "gemm: C at ", c.data, " (row stride ", mc.ld,
                 ") overlaps D at ", d.data, " (row stride ", md.ld,
                 ") without being D; it must be D itself or share no byte with it");
    }
  }
  LOOM_CHECK(handle_ != nullptr, "gemm: no cuBLASLt handle (the GemmPlans was made with a null handle)");
  LOOM_CHECK(workspace_bytes_ > 0, "gemm: no workspace; call set_workspace() with ", kWorkspaceBytes,
             " bytes of device memory (Hopper's kernels need one)");

  // cuBLASLt reads per-tensor scales 16-byte aligned: copy one that is not
  // into its slot, in stream order before the GEMM (one object per stream).
  const float* a_scale = args.a.scale_inv;
  const float* b_scale = args.b.scale_inv;
  if (sa == GemmScale::tensor && alignment_of(a_scale) < 16) {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(scale_slots_, a_scale, sizeof(float), cudaMemcpyDeviceToDevice, stream),
                    "gemm: copy of the A inverse scale at ", static_cast<const void*>(a_scale),
                    " to its 16-byte aligned slot");
    a_scale = scale_slots_;
  }
  if (sb == GemmScale::tensor && alignment_of(b_scale) < 16) {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(scale_slots_ + 4, b_scale, sizeof(float), cudaMemcpyDeviceToDevice, stream),
                    "gemm: copy of the B inverse scale at ", static_cast<const void*>(b_scale),
                    " to its 16-byte aligned slot");
    b_scale = scale_slots_ + 4;
  }
  auto handle = static_cast<cublasLtHandle_t>(handle_);
  const bool want_amax = args.d_amax != nullptr;
  const bool own_c = args.c != nullptr && mc.ld != md.ld;
  const void* c_ptr = args.c != nullptr ? args.c->data : d.data;
  // clang-format off
  KeyArr key{
      m, n, k, ma.ld, mb.ld, mc.ld, md.ld,
      static_cast<int64_t>(a.dtype), static_cast<int64_t>(b.dtype), static_cast<int64_t>(d.dtype),
      args.a.k_major, args.b.k_major, static_cast<int64_t>(sa), static_cast<int64_t>(sb),
      own_c, want_amax, args.fast_accum,
      alignment_of(a.data), alignment_of(b.data), alignment_of(c_ptr), alignment_of(d.data), 0};
  // clang-format on
  // A varying dim within its bound: the bucket's plan. For k, the leading
  // dimension of a k-major operand is k or more: the plan's layouts hold
  // k = bucket rows, so a leading dimension below it would be invalid.
  KeyArr exact = key;  // a varying call's fallback (below)
  exact[kVarying] = 3;
  const bool vary_m = args.varying == GemmVarying::m && m <= args.varying_max;
  const bool vary_k = args.varying == GemmVarying::k && k <= args.varying_max;
  auto bucket_key = [&](int64_t bucket) {
    KeyArr bk = key;
    bk[vary_m ? kM : kK] = bucket;
    if (vary_k) {
      if (args.a.k_major) bk[kLda] = ma.ld == k ? bucket : std::max(ma.ld, bucket);
      if (args.b.k_major) bk[kLdb] = mb.ld == k ? bucket : std::max(mb.ld, bucket);
    }
    // Row views start wherever the previous expert's rows end: the plan
    // assumes at most 16 bytes (what the vectorised kernels need).
    for (int i : {kAlA, kAlB, kAlC, kAlD}) bk[i] = std::min<int64_t>(bk[i], 16);
    bk[kVarying] = vary_m ? 1 : 2;
    return bk;
  };
  if (block && (vary_m || vary_k)) {
    // Block scales: an exact plan per count, untimed, at most 16-byte alignments.
    for (int i : {kAlA, kAlB, kAlC, kAlD}) key[i] = std::min<int64_t>(key[i], 16);
    key[kVarying] = 4;
  } else if (vary_m || vary_k) {
    key = bucket_key(row_bucket(vary_m ? m : k, args.varying_max));
  }

  const cublasOperation_t op_lt_a = args.b.k_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_lt_b = args.a.k_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  auto where = [&] {
    return cat(what, what[0] ? ": " : "", "gemm D[", m, ",", n, "] (", dtype_name(d.dtype), ", ldd ", md.ld,
               ") = A[", m, ",", k, "] (", dtype_name(a.dtype), args.a.k_major ? "" : " stored [k, m]", ", lda ",
               ma.ld, ", scale ", gemm_scale_name(sa), ") B[", n, ",", k, "]^T (", dtype_name(b.dtype),
               args.b.k_major ? "" : " stored [k, n]", ", ldb ", mb.ld, ", scale ", gemm_scale_name(sb), ")",
               args.c != nullptr ? cat(" + C (ldc ", mc.ld, ")") : std::string(), want_amax ? ", D amax" : "",
               args.fast_accum ? ", fast accumulation" : "", "; as cuBLASLt ", op_lt_a == CUBLAS_OP_T ? "T" : "N",
               op_lt_b == CUBLAS_OP_T ? "T" : "N", ": M'=", n, " N'=", m, " K'=", k, ", alignments A/B/C/D ",
               key[kAlA], "/", key[kAlB], "/", key[kAlC], "/", key[kAlD], " bytes");
  };
  auto find = [&](const KeyArr& k_) -> Plan* {
    for (auto& p : plans_)
      if (p->key == k_) return p.get();
    return nullptr;
  };

  // (Re)creates the matmul descriptor and picks the algorithm; with_amax asks
  // cuBLASLt for D's amax. Returns false when with_amax finds no algorithm.
  auto configure = [&](Plan& p, bool with_amax) -> bool {
    p.destroy_op();
    // fp32 accumulation and scaling; CUBLAS_COMPUTE_32F never uses TF32.
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a, sizeof(op_lt_a)),
                        where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b, sizeof(op_lt_b)),
                        where());
    if (fp8) {
      const int8_t fast = args.fast_accum ? 1 : 0;
      LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
                          where());
      // cuBLASLt's A is our B and its B our A: modes and scales swap too.
      if (sa != GemmScale::tensor) {
        const int32_t mode_lt_a = lt_scale_mode(sb), mode_lt_b = lt_scale_mode(sa);
        LOOM_CUBLASLT_CHECK(
            cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_lt_a, sizeof(mode_lt_a)),
            where());
        LOOM_CUBLASLT_CHECK(
            cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_lt_b, sizeof(mode_lt_b)),
            where());
      }
      p.lt_a_scale = b_scale;
      p.lt_b_scale = a_scale;
      LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.lt_a_scale,
                                                         sizeof(p.lt_a_scale)),
                          where());
      LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.lt_b_scale,
                                                         sizeof(p.lt_b_scale)),
                          where());
    }
    p.amax = with_amax ? args.d_amax : nullptr;
    p.amax_fused = with_amax;
    if (with_amax)
      LOOM_CUBLASLT_CHECK(
          cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &p.amax, sizeof(p.amax)), where());

    PrefGuard pref;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref.p), where());
    const uint64_t ws = workspace_bytes_;
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
        where());
    // Views into wider buffers need not be 256-byte aligned (cuBLASLt's
    // default assumption): tell the heuristic what the pointers are. Its A is our B.
    const uint32_t al_lt_a = static_cast<uint32_t>(p.key[kAlB]), al_lt_b = static_cast<uint32_t>(p.key[kAlA]),
                   al_c = static_cast<uint32_t>(p.key[kAlC]), al_d = static_cast<uint32_t>(p.key[kAlD]);
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                             &al_lt_a, sizeof(al_lt_a)),
                        where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                             &al_lt_b, sizeof(al_lt_b)),
                        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)),
        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)),
        where());
    std::array<cublasLtMatmulHeuristicResult_t, kGemmAlgoCandidates> cand{};
    // Bucket and exact fallback plans of a varying dim keep the heuristic's
    // answer: a pick timed at one count may not run at another, and a timing
    // would run mid-training.
    const bool timed = algo_ == GemmAlgo::fastest && p.key[kVarying] == 0;
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, p.op, p.a, p.b, p.c_layout(), p.d, pref.p,
                                                             timed ? kGemmAlgoCandidates : 1, cand.data(), &found);
    const bool ok = st == CUBLAS_STATUS_SUCCESS && found > 0 && cand[0].state == CUBLAS_STATUS_SUCCESS;
    if (with_amax && !ok) return false;
    if (!ok) {
      int dev = -1, major = 0, minor = 0;
      // For the message only: a failure here leaves the -1/0 placeholders in it.
      (void)cudaGetDevice(&dev);
      (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
      (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
      throw Error(cat(where(), ": cuBLASLt has no algorithm for this problem (heuristic status ",
                      cublasLtGetStatusName(st), ", ", found, " found, cuBLASLt ", cublasLtGetVersion(), ") with a ",
                      workspace_bytes_, "-byte workspace on a compute capability ", major, ".", minor, " GPU",
                      fp8 ? (block || sa == GemmScale::outer
                                 ? "; block and outer-vector scaled FP8 need Hopper (9.0) and cuBLASLt 12.9 or newer"
                                 : "; FP8 GEMMs need 8.9 or newer")
                          : ""));
    }
    int pick = 0;
    if (timed) {
      // D (and C where it has a layout of its own) in a scratch; cuBLASLt's D is n x m, leading dimension ldd.
      const size_t es = dtype_size(d.dtype);
      const size_t d_bytes = static_cast<size_t>(md.ld * m) * es, c_bytes = p.c ? static_cast<size_t>(mc.ld * m) * es : 0;
      const float alpha = args.alpha, beta = args.beta;
      pick = time_gemm_candidates(
          stream, found, d_bytes + c_bytes,
          [&](int i, void* scratch) {
            const cublasLtMatmulHeuristicResult_t& r = cand[static_cast<size_t>(i)];
            if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > workspace_bytes_) return false;
            const void* sc = p.c ? static_cast<const char*>(scratch) + d_bytes : scratch;
            return cublasLtMatmul(handle, p.op, &alpha, b.data, p.a, a.data, p.b, &beta, sc, p.c_layout(), scratch,
                                  p.d, &r.algo, workspace_, workspace_bytes_, stream) == CUBLAS_STATUS_SUCCESS;
          },
          where());
      ++plans_timed_;
      if (pick != 0) ++plans_switched_;
    }
    p.algo = cand[static_cast<size_t>(pick)].algo;
    p.workspace_needed = cand[static_cast<size_t>(pick)].workspaceSize;
    return true;
  };

  // Builds the plan of `pkey`, whose m, k and leading dimensions of A and B
  // it takes from the key (a bucket's plan: the bucket's values).
  auto build = [&](const KeyArr& pkey) {
    auto p = std::make_unique<Plan>();
    p->key = pkey;
    const uint64_t pm = static_cast<uint64_t>(pkey[kM]), pk = static_cast<uint64_t>(pkey[kK]),
                   un = static_cast<uint64_t>(n);
    // Stored (column-major) shapes of A' = our B and B' = our A (file comment).
    if (args.b.k_major)
      LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->a, cuda_type(b.dtype), pk, un, pkey[kLdb]), where());
    else
      LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->a, cuda_type(b.dtype), un, pk, pkey[kLdb]), where());
    if (args.a.k_major)
      LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->b, cuda_type(a.dtype), pk, pm, pkey[kLda]), where());
    else
      LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->b, cuda_type(a.dtype), pm, pk, pkey[kLda]), where());
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->d, cuda_type(d.dtype), un, pm, md.ld), where());
    // C gets its own layout only where its leading dimension differs: an
    // in-place product (C == D) must pass one layout for both.
    if (own_c) LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->c, cuda_type(d.dtype), un, pm, mc.ld), where());
    if (!configure(*p, want_amax)) configure(*p, false);
    Plan* raw = p.get();
    plans_.push_back(std::move(p));
    ++plans_built_;
    ++g_plans_built;
    return raw;
  };

  const bool bucketed = key[kVarying] == 1 || key[kVarying] == 2;
  Plan* plan = find(key);
  if (plan == nullptr && bucketed) {
    // The first call of a varying problem: every bucket's plan up to
    // varying_max now, so that later steps' counts find theirs built.
    for (int64_t bk = row_bucket(1, args.varying_max);; bk = row_bucket(bk + 1, args.varying_max)) {
      const KeyArr kk = bucket_key(bk);
      if (find(kk) == nullptr) build(kk);
      if (bk >= args.varying_max) break;
    }
    plan = find(key);
  }
  if (plan == nullptr) plan = build(key);
  if (bucketed && (plan->now_m != m || plan->now_k != k || plan->now_lda != ma.ld || plan->now_ldb != mb.ld)) {
    // This call's m or k (and leading dimensions) in the bucket plan's layouts.
    auto set = [&](cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr, int64_t v) {
      if (l == nullptr) return;
      const uint64_t u = static_cast<uint64_t>(v);
      LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(l, attr, &u, sizeof(u)), where());
    };
    plan->now_m = -1;
    // A' (our B): k x n (k-major) or n x k.
    set(plan->a, args.b.k_major ? CUBLASLT_MATRIX_LAYOUT_ROWS : CUBLASLT_MATRIX_LAYOUT_COLS, k);
    set(plan->a, CUBLASLT_MATRIX_LAYOUT_LD, mb.ld);
    // B' (our A): k x m (k-major) or m x k.
    set(plan->b, args.a.k_major ? CUBLASLT_MATRIX_LAYOUT_ROWS : CUBLASLT_MATRIX_LAYOUT_COLS, k);
    set(plan->b, args.a.k_major ? CUBLASLT_MATRIX_LAYOUT_COLS : CUBLASLT_MATRIX_LAYOUT_ROWS, m);
    set(plan->b, CUBLASLT_MATRIX_LAYOUT_LD, ma.ld);
    set(plan->d, CUBLASLT_MATRIX_LAYOUT_COLS, m);
    set(plan->c, CUBLASLT_MATRIX_LAYOUT_COLS, m);
    cublasLtMatmulHeuristicResult_t chk{};
    const cublasStatus_t st =
        cublasLtMatmulAlgoCheck(handle, plan->op, plan->a, plan->b, plan->c_layout(), plan->d, &plan->algo, &chk);
    if (st == CUBLAS_STATUS_SUCCESS && chk.state == CUBLAS_STATUS_SUCCESS && chk.workspaceSize <= workspace_bytes_) {
      plan->now_m = m;
      plan->now_k = k;
      plan->now_lda = ma.ld;
      plan->now_ldb = mb.ld;
      plan->workspace_needed = chk.workspaceSize;
    } else {
      // The bucket's algorithm does not run this count: an exact plan for it
      // (the heuristic's answer; kVarying 3 keeps it apart from other calls' keys).
      plan = find(exact);
      if (plan == nullptr) plan = build(exact);
    }
  }
  LOOM_CHECK(plan->workspace_needed <= workspace_bytes_, where(), ": the plan needs ", plan->workspace_needed,
             " workspace bytes but set_workspace() now gives ", workspace_bytes_);

  // Per-call pointers on the cached descriptor, set only when they change.
  if (fp8 && plan->lt_a_scale != b_scale) {
    plan->lt_a_scale = b_scale;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                       &plan->lt_a_scale, sizeof(plan->lt_a_scale)),
                        where());
  }
  if (fp8 && plan->lt_b_scale != a_scale) {
    plan->lt_b_scale = a_scale;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                       &plan->lt_b_scale, sizeof(plan->lt_b_scale)),
                        where());
  }
  if (plan->amax_fused && plan->amax != args.d_amax) {
    plan->amax = args.d_amax;
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &plan->amax, sizeof(plan->amax)),
        where());
  }

  // Host scalars (cuBLASLt's default pointer mode).
  const float alpha = args.alpha, beta = args.beta;
  auto run = [&] {
    return cublasLtMatmul(handle, plan->op, &alpha, b.data, plan->a, a.data, plan->b, &beta, c_ptr, plan->c_layout(),
                          d.data, plan->d, &plan->algo, workspace_, workspace_bytes_, stream);
  };
  // The amax slot starts at 0 either way: cuBLASLt's documentation says it
  // sets the value, but a max-accumulating implementation must not keep an
  // older, larger one, and the fp8_amax fallback max-accumulates.
  if (want_amax)
    LOOM_CUDA_CHECK(cudaMemsetAsync(args.d_amax, 0, sizeof(float), stream), "gemm: zero the D amax slot at ",
                    static_cast<const void*>(args.d_amax));
  cublasStatus_t st = run();
  if (st != CUBLAS_STATUS_SUCCESS && plan->amax_fused && !plan->ran &&
      (st == CUBLAS_STATUS_INVALID_VALUE || st == CUBLAS_STATUS_NOT_SUPPORTED)) {
    // cuBLASLt turned the fused amax down at run time (the heuristic does not
    // always check it): measure D after the GEMM instead.
    configure(*plan, false);
    LOOM_CHECK(plan->workspace_needed <= workspace_bytes_, where(), ": the plan needs ", plan->workspace_needed,
               " workspace bytes but set_workspace() now gives ", workspace_bytes_);
    st = run();
  }
  LOOM_CHECK(st == CUBLAS_STATUS_SUCCESS, where(), ": cublasLtMatmul failed: ", cublasLtGetStatusName(st), " (",
             cublasLtGetStatusString(st), ")");
  plan->ran = true;
  if (want_amax && !plan->amax_fused) gpu::fp8_amax(d, args.d_amax, stream);
  last_amax_fused_ = want_amax && plan->amax_fused;
  last_workspace_needed_ = plan->workspace_needed;
}

}  // namespace loom::ops
