// Attention plugins: causal GQA attention on BSHD tensors (docs/PLUGINS.md).
//
// q, out, dq, dout: [B, S, H, D];  k, v, dk, dv: [B, S, Hkv, D] with Hkv | H
// (query head h reads kv head h / (H / Hkv)). Strides may be non-contiguous
// (views into a fused QKV buffer); the innermost dimension is contiguous.
// stats: [B, H, S] fp32, the softmax log-sum-exp saved by forward for backward
// (its layout is the plugin's own: forward writes it, backward reads it).
//
// Document masking (since ABI 8.3, train.reset_attention_mask): each row packs
// several documents, and a query attends only to the keys of its own
// document at or before it — causal and block-diagonal. The shape says so
// (documents) and, in forward and backward, points at the micro-batch's
// document spans (spans, below): device tensors staged with the tokens, and
// two host counts known when the micro-batch was staged, so a plugin needs no
// device read to size its launch. A plugin that cannot do it says so in
// supports() (the core asks with documents = true at start-up and refuses the
// run with the plugin's reason). Plugins of an older ABI than 8.3 are refused
// by the ABI check (the major differs) before any of this.
#pragma once
#include <cstdint>
#include <string>

#include "loom/context.hpp"
#include "loom/plugin.hpp"
#include "loom/tensor.hpp"

namespace loom {

// The document spans of one micro-batch of B rows of S tokens. A span is a
// run of tokens of one document within one row: a row's first token always
// begins one, a document longer than a row is a span in each row it reaches,
// and spans never cross a row. Token t of the micro-batch is row t / S,
// position t % S (the order of the BSHD tensors' rows).
struct DocumentSpans {
  // int32 [B * S] on the device: each token's offset in its span (0 at the
  // span's first token). Key j of a row is visible to query i of that row
  // iff i - positions[i] <= j <= i. Also the RoPE positions when
  // train.reset_position_ids is on.
  Tensor positions;
  // int32 [B * S + 1] on the device, non-decreasing: span k holds tokens
  // [cu_seqlens[k], cu_seqlens[k + 1]), spans in token order; the entries
  // after `count` all equal B * S (empty spans), so any prefix of
  // n + 1 >= count + 1 entries describes the micro-batch with n spans.
  Tensor cu_seqlens;
  // int32 [B * S] on the device: cu_seqlens[k + 1] - cu_seqlens[k] (0 after `count`).
  Tensor lengths;
  int64_t count = 0;    // spans in use, 1..B*S (host: known when the micro-batch was staged)
  int64_t longest = 0;  // tokens of the longest span (host)
  // Changes whenever another micro-batch is staged: what a plugin derives
  // from the spans can be kept and reused while it stays the same (every
  // layer, the backward and a recompute of one micro-batch).
  uint64_t serial = 0;
};

struct AttentionShape {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool causal = true;
  float scale = 0.f;  // softmax scale, normally 1/sqrt(head_dim)
  // Since ABI 8.3: attention within document spans only (see above).
  bool documents = false;
  // With documents: the micro-batch's spans, to read in forward() and
  // backward(). supports() and workspace_bytes() answer for any spans (null
  // there, or not staged yet).
  const DocumentSpans* spans = nullptr;
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
