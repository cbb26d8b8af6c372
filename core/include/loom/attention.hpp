// Attention plugins: causal GQA attention on BSHD tensors (docs/PLUGINS.md).
//
// q, out, dq, dout: [B, S, H, D];  k, v, dk, dv: [B, S, Hkv, D] with Hkv | H
// (query head h reads kv head h / (H / Hkv)). Strides may be non-contiguous
// (views into a fused QKV buffer); the innermost dimension is contiguous.
// stats: [B, H, S] fp32, the softmax log-sum-exp saved by forward for backward.
#pragma once
#include <cstdint>
#include <string>

#include "loom/context.hpp"
#include "loom/plugin.hpp"
#include "loom/tensor.hpp"

namespace loom {

struct AttentionShape {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool causal = true;
  float scale = 0.f;  // softmax scale, normally 1/sqrt(head_dim)
};

struct Support {
  bool ok = true;
  std::string reason;  // when !ok: the limit that was hit and the plugin to use instead
  static Support yes() { return {}; }
  static Support no(std::string why) { return {false, std::move(why)}; }
};

class Attention : public Plugin {
 public:
  virtual Support supports(const AttentionShape& shape, DType dtype, Device device) const = 0;
  virtual size_t workspace_bytes(const AttentionShape& /*shape*/, DType /*dtype*/, Device /*device*/) const { return 0; }
  virtual void forward(const ExecContext& ctx, const AttentionShape& shape, const Tensor& q, const Tensor& k,
                       const Tensor& v, Tensor& out, Tensor& stats, void* workspace) = 0;
  // Writes (not accumulates) dq, dk, dv.
  virtual void backward(const ExecContext& ctx, const AttentionShape& shape, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& stats, Tensor& dq,
                        Tensor& dk, Tensor& dv, void* workspace) = 0;
};

template <> struct PluginInterface<PluginKind::attention> { using type = Attention; };

}  // namespace loom
