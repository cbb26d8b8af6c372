// Hugging Face Llama interop: config.json <-> ModelSpec and safetensors
// weights (single file or sharded with model.safetensors.index.json) in HF
// names and shapes, the same ones loom::model_units uses.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "loom/dtype.hpp"
#include "loom/model.hpp"

namespace loom::hf {

// Reads <dir>/config.json. Refuses (loom::Error naming the file and key) what
// Loom's Llama does not implement: model_type other than "llama", hidden_act
// other than "silu", attention/MLP biases, RoPE scaling, a head_dim other than
// hidden/heads. rope_theta is read from "rope_theta" or (transformers >= 5)
// "rope_parameters".
ModelSpec read_hf_llama_config(const std::string& dir);
// The same from the text of a config.json; `origin` names it in errors.
ModelSpec parse_hf_llama_config(const std::string& json_text, const std::string& origin);

// Loads every parameter of `spec` (names from loom::model_units) from <dir>.
// `dst(hf_name, numel)` returns where to put that tensor's numel fp32 values,
// or nullptr to skip it (e.g. a tensor this rank does not hold). Every expected
// tensor must exist with the expected shape; tensors the model does not have
// are an error, except rotary inv_freq buffers and lm_head.weight of a tied
// model (HF may store it; the embedding is used). Sources may be F32/BF16/F16/F64.
void load_hf_llama_weights(const std::string& dir, const ModelSpec& spec,
                           const std::function<float*(const std::string& hf_name, int64_t numel)>& dst);

struct HfExportOptions {
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> eos_token_id;
};

// Writes <dir>/model.safetensors then <dir>/config.json (each crash-safe; the
// directory is created if needed) such that
// transformers.LlamaForCausalLM.from_pretrained(dir) loads it. `src(hf_name)`
// returns that tensor's fp32 values (numel from the spec). `out` is f32 or
// bf16. A tied model stores no lm_head.weight.
void save_hf_llama(const std::string& dir, const ModelSpec& spec,
                   const std::function<const float*(const std::string& hf_name)>& src, DType out,
                   const HfExportOptions& options = {});

}  // namespace loom::hf
