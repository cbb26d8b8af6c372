// The Llama model description and its parameter accounting.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

struct ModelSpec {
  int64_t hidden = 768;
  int64_t num_layers = 12;
  int64_t num_heads = 12;
  int64_t num_kv_heads = 12;
  int64_t ffn_hidden = 2048;
  int64_t vocab_size = 32000;
  int64_t max_seq_len = 2048;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tied_embeddings = false;
  // Mixture of experts (model.ffn = "moe", HF Mixtral's sparse MoE block):
  // num_experts > 0 replaces every layer's feed-forward block with a router
  // and num_experts SwiGLU experts of ffn_hidden each, top_k of them per token.
  int64_t num_experts = 0;             // 0: dense feed-forward (Llama)
  int64_t top_k = 2;
  double router_aux_loss_coef = 0.02;  // weight of the load-balancing loss in the objective
  double router_jitter_noise = 0.0;    // multiplicative input jitter in training (0: off)

  bool moe() const { return num_experts > 0; }
  int64_t head_dim() const { return hidden / num_heads; }
  int64_t q_dim() const { return num_heads * head_dim(); }
  int64_t kv_dim() const { return num_kv_heads * head_dim(); }
  // Feed-forward parameters of one layer, all of them or those one token uses
  // (MoE: the router and top_k experts).
  int64_t ffn_params() const {
    return moe() ? num_experts * hidden + num_experts * 3 * hidden * ffn_hidden : 3 * hidden * ffn_hidden;
  }
  int64_t active_ffn_params() const {
    return moe() ? num_experts * hidden + top_k * 3 * hidden * ffn_hidden : 3 * hidden * ffn_hidden;
  }
  // Parameters of one decoder layer (two norms, q/k/v/o, the feed-forward block).
  int64_t layer_params() const { return attention_layer_params() + ffn_params(); }
  int64_t total_params() const {
    return vocab_size * hidden * (tied_embeddings ? 1 : 2) + num_layers * layer_params() + hidden;
  }
  // The parameters one token's forward uses (total_params() for dense models).
  int64_t active_params() const {
    return vocab_size * hidden * (tied_embeddings ? 1 : 2) +
           num_layers * (attention_layer_params() + active_ffn_params()) + hidden;
  }
  // N of the MFU formula (docs/ARCHITECTURE.md "MFU"): the matmul weights one token's forward uses,
  // all but the input embedding (the lm head counts even when tied, since it
  // is a GEMM). MoE: the router and top_k experts per layer (active).
  int64_t matmul_params() const {
    return num_layers * (attention_layer_params() - 2 * hidden + active_ffn_params()) + vocab_size * hidden;
  }
  // The same with every expert (what a dense model of the same weights would compute).
  int64_t total_matmul_params() const {
    return num_layers * (layer_params() - 2 * hidden) + vocab_size * hidden;
  }
  // flops per token = 6 N + 12 L h S (N = matmul_params(): active)
  double flops_per_token(int64_t seq) const {
    return 6.0 * static_cast<double>(matmul_params()) + 12.0 * num_layers * hidden * static_cast<double>(seq);
  }
  // NeMo / Megatron's "model TFLOP/s" count causal attention as half of the
  // full S x S product: 6 N + 6 L h S (docs/ARCHITECTURE.md "MFU").
  double causal_flops_per_token(int64_t seq) const {
    return 6.0 * static_cast<double>(matmul_params()) + 6.0 * num_layers * hidden * static_cast<double>(seq);
  }
  double total_flops_per_token(int64_t seq) const {
    return 6.0 * static_cast<double>(total_matmul_params()) + 12.0 * num_layers * hidden * static_cast<double>(seq);
  }
  // The attention half of a layer with both norms.
  int64_t attention_layer_params() const {
    return 2 * hidden + hidden * q_dim() + 2 * hidden * kv_dim() + q_dim() * hidden;
  }
  // total_params() in long double: it never overflows (each size is at most
  // 2^31, so no product exceeds 2^80) and is exact up to 2^64. The counts
  // above are int64 and overflow for sizes the keys' ranges allow (4096
  // layers of 4096 experts of 2^20 x 2^20 are ~2^76 parameters): a spec is
  // held to kMaxParams (config/run_config.hpp) with this before they are used.
  long double total_params_ld() const {
    using LD = long double;
    const LD h = static_cast<LD>(hidden), hd = static_cast<LD>(head_dim());
    const LD q = static_cast<LD>(num_heads) * hd, kv = static_cast<LD>(num_kv_heads) * hd;
    const LD ffn = moe() ? static_cast<LD>(num_experts) * (h + 3 * h * static_cast<LD>(ffn_hidden))
                         : 3 * h * static_cast<LD>(ffn_hidden);
    const LD layer = 2 * h + h * q + 2 * h * kv + q * h + ffn;
    return static_cast<LD>(vocab_size) * h * (tied_embeddings ? 1 : 2) + static_cast<LD>(num_layers) * layer + h;
  }
};

// What a parameter is for. Initialisation and weight decay read the role,
// never the name (a block variant declares the role of each of its tensors).
enum class ParamRole : uint8_t {
  matrix,             // a projection: N(0, init_std), decays
  output_projection,  // a projection that writes into the residual stream (o_proj, down_proj):
                      // N(0, init_std / sqrt(2 L)), decays
  norm_gain,          // an RMSNorm gain: ones, no decay
  embedding,          // the token embedding: N(0, init_std), decays. Its block's backward reads no
                      // parameter (the table's gradient is a scatter-add of the output's): a sharding
                      // strategy need not gather a unit of embeddings alone for its backward
};
const char* param_role_name(ParamRole r);

// One parameter tensor inside a unit's flat buffer.
struct ParamInfo {
  std::string name;          // HF name, e.g. "model.layers.3.self_attn.q_proj.weight"
  std::vector<int64_t> shape;
  int64_t offset = 0;        // elements from the start of the unit's flat buffer
  int64_t numel = 0;
  ParamRole role = ParamRole::matrix;
  bool weight_decay() const { return role != ParamRole::norm_gain; }
};

// A unit (docs/ARCHITECTURE.md "The model as blocks"): the embedding, each
// decoder layer, the final norm + head.
struct UnitInfo {
  std::string name;          // "embedding", "layer.3", "head"
  std::vector<ParamInfo> params;
  int64_t numel = 0;         // sum of params, unpadded
  // Another unit whose params this unit's forward reads and whose grads its
  // backward accumulates into (the head of a tied-embedding model: unit 0), or -1.
  int uses_params_of = -1;
  // Expert parallelism (sharding.expert_parallel = P > 1): a layer's experts
  // unit ("layer.N.experts", every expert under its global name) has P here.
  // Rank r holds only its experts' part, [(r mod P)·numel/P, …), whole, never
  // gathered; the ranks holding the same part (world / P of them) add their
  // gradients. 1 for every other unit.
  int expert_group = 1;
};

// The units and their parameter layout for a spec (HF names, HF shapes [out, in]),
// as the blocks of `layers` (an attention variant: "native" or "fused") and
// the dense feed-forward block (a spec with experts: the "moe" one) declare them. Every layer
// variant keeps the canonical HF names, shapes and order, so checkpoints of one
// load into the other.
std::vector<UnitInfo> model_units(const ModelSpec& spec, const std::string& layers = "native");

}  // namespace loom
