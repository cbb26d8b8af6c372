// The naive attention plugin: materialised softmax, fp32 on the CPU and, in
// builds with the CUDA backend, fp32 or bf16 on a CUDA device (fp32 math).
// Slow (O(S^2) per head, no tiling) and exact: the reference for the fast
// plugins, document masking included (a query sees its own span's keys).
#include <omp.h>

#include <algorithm>
#include <exception>
#include <string>

#include "attention/naive/attention_naive_cpu.hpp"
#ifdef LOOM_HAVE_CUDA
#include "attention/naive/attention_naive_cuda.hpp"
#endif
#include "loom/attention.hpp"
#include "loom/error.hpp"

namespace loom::naive {
namespace {

AttnDims dims_of(const AttentionShape& s) {
  return {s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, static_cast<double>(s.scale), s.causal, nullptr};
}

// With document masking, the spans' positions (int32 [B * S] on the call's device).
const int32_t* document_positions(const AttentionShape& s, Device device) {
  if (!s.documents) return nullptr;
  LOOM_CHECK(s.spans != nullptr, "naive attention: the shape asks for document masking but carries no spans");
  const Tensor& p = s.spans->positions;
  LOOM_CHECK(p.data != nullptr && p.dtype == DType::i32 && p.device == device && p.numel() == s.batch * s.seq &&
                 p.is_contiguous(),
             "naive attention: the document positions must be a contiguous int32 ", device_name(device),
             " tensor of B * S = ", s.batch * s.seq, " entries, got ", dtype_name(p.dtype), " ", p.shape_str(),
             " on ", device_name(p.device));
  return p.ptr<const int32_t>();
}

// Checks one BSHD tensor against the shape, the dtype of the call and the
// device, and returns its strides.
Bshd bshd(const Tensor& t, const char* what, const AttentionShape& s, int64_t heads, DType dtype = DType::f32,
          Device device = Device::cpu) {
  LOOM_CHECK(t.data != nullptr, "naive attention: ", what, " has no data");
  LOOM_CHECK(t.dtype == dtype && t.device == device, "naive attention: ", what, " must be ", dtype_name(dtype), " on ",
             device_name(device), ", got ", dtype_name(t.dtype), " on ", device_name(t.device));
  LOOM_CHECK(t.ndim == 4 && t.shape[0] == s.batch && t.shape[1] == s.seq && t.shape[2] == heads &&
                 t.shape[3] == s.head_dim,
             "naive attention: ", what, " must have shape [B,S,heads,D] = [", s.batch, ",", s.seq, ",", heads, ",",
             s.head_dim, "], got ", t.shape_str());
  LOOM_CHECK(t.stride[3] == 1, "naive attention: ", what, " must be contiguous in head_dim, got stride ", t.stride[3]);
  return {t.stride[0], t.stride[1], t.stride[2]};
}

void check_stats(const Tensor& t, const AttentionShape& s, Device device = Device::cpu) {
  LOOM_CHECK(t.data != nullptr, "naive attention: stats has no data");
  LOOM_CHECK(t.dtype == DType::f32 && t.device == device, "naive attention: stats must be fp32 on ",
             device_name(device), ", got ", dtype_name(t.dtype), " on ", device_name(t.device));
  LOOM_CHECK(t.ndim == 3 && t.shape[0] == s.batch && t.shape[1] == s.heads && t.shape[2] == s.seq &&
                 t.is_contiguous(),
             "naive attention: stats must be a contiguous [B,H,S] = [", s.batch, ",", s.heads, ",", s.seq,
             "] tensor, got ", t.shape_str());
}

class NaiveAttention final : public Attention {
 public:
  explicit NaiveAttention(const PluginInit& init) : device_(init.device) {
    // No options; finish() rejects any key given.
    init.config.finish();
    // Scratch is sized for this many threads when the core plans the
    // workspace, and the kernels never use more (the thread count may change
    // later, the workspace does not).
    workers_ = std::max(1, omp_get_max_threads());
  }

  Support supports(const AttentionShape& shape, DType dtype, Device device) const override {
#ifdef LOOM_HAVE_CUDA
    if (device == Device::cuda && dtype != DType::f32 && dtype != DType::bf16)
      return Support::no(cat("naive attention on cuda takes fp32 or bf16 tensors (fp32 math), got ",
                             dtype_name(dtype)));
#else
    if (device != Device::cpu)
      return Support::no(cat("naive attention on ", device_name(device),
                             " comes with the CUDA backend (a build with LOOM_WITH_CUDA=ON); this build's naive "
                             "plugin runs on the CPU only"));
#endif
    if (device == Device::cpu && dtype != DType::f32)
      return Support::no(cat("naive attention on the CPU computes in fp32 only, got ", dtype_name(dtype),
                             "; use the fp32 precision recipe for CPU runs"));
    try {
      check_dims(dims_of(shape));
    } catch (const Error& e) {
      return Support::no(e.what());
    }
    if (shape.documents && !shape.causal)
      return Support::no("naive attention: document masking is causal within each document; a non-causal shape "
                         "with documents is not supported");
    return Support::yes();
  }

  size_t workspace_bytes(const AttentionShape& shape, DType /*dtype*/, Device device) const override {
    const AttnDims d = dims_of(shape);
#ifdef LOOM_HAVE_CUDA
    if (device == Device::cuda) return cuda::workspace_bytes(d);
#else
    (void)device;
#endif
    const int64_t per_worker = std::max(forward_scratch_doubles(d), backward_scratch_doubles(d));
    return static_cast<size_t>(per_worker) * static_cast<size_t>(workers_) * sizeof(double);
  }

  void forward(const ExecContext& ctx, const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
               Tensor& out, Tensor& stats, void* workspace) override {
    const AttnDims d = prepare(ctx, shape, workspace);
#ifdef LOOM_HAVE_CUDA
    if (ctx.device == Device::cuda) {
      const DType t = cuda_dtype(q);
      const Bshd qs = bshd(q, "q", shape, shape.heads, t, Device::cuda),
                 ks = bshd(k, "k", shape, shape.kv_heads, t, Device::cuda),
                 vs = bshd(v, "v", shape, shape.kv_heads, t, Device::cuda),
                 os = bshd(out, "out", shape, shape.heads, t, Device::cuda);
      check_stats(stats, shape, Device::cuda);
      cuda::attention_forward(d, t == DType::bf16, out.data, os, stats.ptr<float>(), q.data, qs, k.data, ks, v.data,
                              vs, workspace, ctx.stream);
      return;
    }
#endif
    const Bshd qs = bshd(q, "q", shape, shape.heads), ks = bshd(k, "k", shape, shape.kv_heads),
               vs = bshd(v, "v", shape, shape.kv_heads), os = bshd(out, "out", shape, shape.heads);
    check_stats(stats, shape);
    attention_forward<float>(d, out.ptr<float>(), os, stats.ptr<float>(), q.ptr<const float>(), qs,
                             k.ptr<const float>(), ks, v.ptr<const float>(), vs, static_cast<double*>(workspace),
                             workers_);
  }

  void backward(const ExecContext& ctx, const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& out, const Tensor& dout, const Tensor& stats, Tensor& dq, Tensor& dk, Tensor& dv,
                void* workspace) override {
    const AttnDims d = prepare(ctx, shape, workspace);
#ifdef LOOM_HAVE_CUDA
    if (ctx.device == Device::cuda) {
      const DType t = cuda_dtype(q);
      const Device g = Device::cuda;
      const Bshd qs = bshd(q, "q", shape, shape.heads, t, g), ks = bshd(k, "k", shape, shape.kv_heads, t, g),
                 vs = bshd(v, "v", shape, shape.kv_heads, t, g), dos = bshd(dout, "dout", shape, shape.heads, t, g),
                 dqs = bshd(dq, "dq", shape, shape.heads, t, g), dks = bshd(dk, "dk", shape, shape.kv_heads, t, g),
                 dvs = bshd(dv, "dv", shape, shape.kv_heads, t, g);
      bshd(out, "out", shape, shape.heads, t, g);  // not read; checked as on the CPU path
      check_stats(stats, shape, g);
      cuda::attention_backward(d, t == DType::bf16, dq.data, dqs, dk.data, dks, dv.data, dvs, dout.data, dos, q.data,
                               qs, k.data, ks, v.data, vs, stats.ptr<const float>(), workspace, ctx.stream);
      return;
    }
#endif
    const Bshd qs = bshd(q, "q", shape, shape.heads), ks = bshd(k, "k", shape, shape.kv_heads),
               vs = bshd(v, "v", shape, shape.kv_heads), dos = bshd(dout, "dout", shape, shape.heads),
               dqs = bshd(dq, "dq", shape, shape.heads), dks = bshd(dk, "dk", shape, shape.kv_heads),
               dvs = bshd(dv, "dv", shape, shape.kv_heads);
    // out is not read (backward rebuilds P from stats), but a wrong one means
    // the caller mixed up buffers: check it all the same.
    bshd(out, "out", shape, shape.heads);
    check_stats(stats, shape);
    attention_backward<float>(d, dq.ptr<float>(), dqs, dk.ptr<float>(), dks, dv.ptr<float>(), dvs,
                              dout.ptr<const float>(), dos, q.ptr<const float>(), qs, k.ptr<const float>(), ks,
                              v.ptr<const float>(), vs, stats.ptr<const float>(), static_cast<double*>(workspace),
                              workers_);
  }

 private:
  AttnDims prepare(const ExecContext& ctx, const AttentionShape& shape, void* workspace) const {
#ifdef LOOM_HAVE_CUDA
    LOOM_CHECK(ctx.device == device_, "naive attention: called on ", device_name(ctx.device),
               " but the plugin was created for ", device_name(device_), " (PluginInit::device)");
#else
    LOOM_CHECK(ctx.device == Device::cpu && device_ == Device::cpu, "naive attention: called on ",
               device_name(ctx.device), " (plugin created for ", device_name(device_),
               "); this build's naive plugin runs on the CPU only, CUDA comes with the CUDA backend");
#endif
    AttnDims d = dims_of(shape);
    d.positions = document_positions(shape, ctx.device);
    check_dims(d);
    LOOM_CHECK(workspace != nullptr, "naive attention: needs a workspace of ",
               workspace_bytes(shape, DType::f32, ctx.device), " bytes (workspace_bytes()), got none");
    return d;
  }

  // The tensors' dtype on cuda: q decides, every other tensor is checked against it.
  static DType cuda_dtype(const Tensor& q) {
    LOOM_CHECK(q.dtype == DType::f32 || q.dtype == DType::bf16,
               "naive attention on cuda takes fp32 or bf16 tensors, got q in ", dtype_name(q.dtype));
    return q.dtype;
  }

  Device device_;
  int workers_ = 1;
};

}  // namespace
}  // namespace loom::naive

using loom::naive::NaiveAttention;
LOOM_PLUGIN(attention, NaiveAttention, "naive", "1.2.0",
            "causal GQA attention with a materialised softmax: the exact reference (fp32 on the CPU; fp32 or bf16 "
            "with fp32 math on CUDA), document masking included")
