// Parameter layout: one flat buffer per unit, tensors in HF order and HF shapes.
#include "loom/model.hpp"

#include "loom/error.hpp"

namespace loom {

std::vector<UnitInfo> model_units(const ModelSpec& s) {
  LOOM_CHECK(s.hidden % s.num_heads == 0, "hidden ", s.hidden, " not divisible by num_heads ", s.num_heads);
  LOOM_CHECK(s.num_heads % s.num_kv_heads == 0, "num_heads ", s.num_heads, " not divisible by num_kv_heads ",
             s.num_kv_heads);
  std::vector<UnitInfo> units;
  auto add = [](UnitInfo& u, std::string name, std::vector<int64_t> shape, bool decay) {
    ParamInfo p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.numel = 1;
    for (auto d : p.shape) p.numel *= d;
    p.offset = u.numel;
    p.weight_decay = decay;
    u.numel += p.numel;
    u.params.push_back(std::move(p));
  };
  UnitInfo emb{"embedding", {}, 0};
  add(emb, "model.embed_tokens.weight", {s.vocab_size, s.hidden}, true);
  units.push_back(std::move(emb));
  for (int64_t l = 0; l < s.num_layers; ++l) {
    UnitInfo u{"layer." + std::to_string(l), {}, 0};
    std::string p = "model.layers." + std::to_string(l) + ".";
    add(u, p + "input_layernorm.weight", {s.hidden}, false);
    add(u, p + "self_attn.q_proj.weight", {s.q_dim(), s.hidden}, true);
    add(u, p + "self_attn.k_proj.weight", {s.kv_dim(), s.hidden}, true);
    add(u, p + "self_attn.v_proj.weight", {s.kv_dim(), s.hidden}, true);
    add(u, p + "self_attn.o_proj.weight", {s.hidden, s.q_dim()}, true);
    add(u, p + "post_attention_layernorm.weight", {s.hidden}, false);
    add(u, p + "mlp.gate_proj.weight", {s.ffn_hidden, s.hidden}, true);
    add(u, p + "mlp.up_proj.weight", {s.ffn_hidden, s.hidden}, true);
    add(u, p + "mlp.down_proj.weight", {s.hidden, s.ffn_hidden}, true);
    units.push_back(std::move(u));
  }
  UnitInfo head{"head", {}, 0};
  add(head, "model.norm.weight", {s.hidden}, false);
  if (!s.tied_embeddings) add(head, "lm_head.weight", {s.vocab_size, s.hidden}, true);
  else head.uses_params_of = 0;
  units.push_back(std::move(head));
  return units;
}

}  // namespace loom
