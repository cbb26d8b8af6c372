// The Llama decoder (native layers): forward and backward of each unit, on
// the Backend's ops plus the precision plugin's GEMMs and the attention
// plugin. Activations live in the arena; nothing is allocated per step.
//
//   embedding:  x0 = wte[tokens]
//   layer l:    h = rmsnorm(x) ; q,k,v = h Wq^T, h Wk^T, h Wv^T ; rope(q, k)
//               a = attention(q, k, v) ; x' = x + a Wo^T
//               h2 = rmsnorm(x') ; m = silu(h2 Wg^T) * (h2 Wu^T) ; x'' = x' + m Wd^T
//   head:       logits = rmsnorm(x_L) Wlm^T ; loss = cross_entropy(logits, targets)
#pragma once
#include <string>
#include <vector>

#include "loom/arena.hpp"
#include "loom/attention.hpp"
#include "loom/model.hpp"
#include "loom/precision.hpp"
#include "loom/sharding.hpp"
#include "model/backend.hpp"

namespace loom {

enum class Recompute { none, attention, full };
Recompute parse_recompute(const std::string& s);

class LlamaModel {
 public:
  LlamaModel(const ModelSpec& spec, int64_t batch, int64_t seq, Recompute recompute, DType act_dtype,
             Precision& precision, Attention& attention, Backend& backend);

  // Adds activation and scratch blocks to the plan; registers every linear with the precision plugin.
  void plan(ArenaPlan& plan);
  void bind(const Arena& arena);

  // Token buffers for the current micro-batch ([B, S] int32 on the backend).
  Tensor& inputs() { return inputs_; }
  Tensor& targets() { return targets_; }
  // Logits of the last forward ([B*S, V]; the logits gradient after a training forward).
  Tensor logits() const { return act(logits_, {N_, spec_.vocab_size}); }
  // Per-token losses of the last forward ([B*S] fp32).
  const Tensor& losses() const { return losses_; }

  int num_units() const { return static_cast<int>(spec_.num_layers) + 2; }
  // training: save what backward needs and write dlogits (scaled by dloss_scale) in place.
  void forward_unit(int unit, std::vector<UnitState>& units, bool training, float dloss_scale);
  // Adds this micro-batch's gradients into each unit's grads.
  void backward_unit(int unit, std::vector<UnitState>& units);

  const ModelSpec& spec() const { return spec_; }
  AttentionShape attention_shape() const;
  int64_t tokens_per_micro() const { return B_ * S_; }

 private:
  struct LayerActs {  // one layer's saved activations
    size_t ln1, rstd1, q, k, v, att, stats, res_mid, ln2, rstd2, gate, up, swi;
  };
  struct LayerLinears { int q, k, v, o, gate, up, down; };
  Tensor param(std::vector<UnitState>& units, int unit, int index, bool grad) const;
  Tensor act(size_t block, std::initializer_list<int64_t> dims) const { return arena_->tensor(block, act_dtype_, dims); }
  Tensor f32(size_t block, std::initializer_list<int64_t> dims) const { return arena_->tensor(block, DType::f32, dims); }
  const LayerActs& acts_for(int64_t layer) const;
  void layer_forward(int64_t l, std::vector<UnitState>& units, bool training);
  void attention_forward(int64_t l);
  void layer_backward(int64_t l, std::vector<UnitState>& units);

  ModelSpec spec_;
  int64_t B_, S_, N_;
  Recompute recompute_;
  DType act_dtype_;
  Precision& precision_;
  Attention& attention_;
  Backend& backend_;
  const Arena* arena_ = nullptr;

  // Blocks: residual stream res[0..L] (res[0] = embedding out), per-layer acts, head, scratch.
  std::vector<size_t> res_;
  std::vector<LayerActs> layer_acts_;  // L entries, or 1 shared entry under recompute = full
  size_t att_shared_ = 0, stats_shared_ = 0;  // recompute = attention
  size_t lnf_, rstdf_, logits_, losses_blk_, inputs_blk_, targets_blk_;
  size_t d_res_, d_ln_, d_ln_tmp_, d_q_, d_k_, d_v_, d_att_, d_gate_, d_up_, d_swi_, attn_ws_;
  size_t attn_ws_bytes_ = 0;
  std::vector<LayerLinears> linears_;
  int lm_head_linear_ = -1;
  Tensor inputs_, targets_, losses_;
};

}  // namespace loom
