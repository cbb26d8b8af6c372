// Builds the config.json of an HF folder (a Llama, a Mixtral) for the suites
// that read one: the sizes of a small model, the model_type, and any other
// key as the test writes it (the text is kept as written, so a value such as
// 5e-324 reaches the reader, and its messages, unchanged).
#pragma once
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace loom::test {

// The sizes a config.json gives; the default is the HF suites' small model.
struct HfSizes {
  int64_t hidden = 64, layers = 2, heads = 4, ffn = 100, vocab = 77;
};

// {"model_type":"<model_type>",<the sizes>,<extra>}: `extra` is JSON members
// without braces ("" for none); an empty model_type leaves that key out.
inline std::string hf_config_json(const std::string& model_type, const std::string& extra = "",
                                  const HfSizes& s = {}) {
  std::string j = "{";
  if (!model_type.empty()) j += "\"model_type\":\"" + model_type + "\",";
  j += "\"hidden_size\":" + std::to_string(s.hidden) + ",\"num_hidden_layers\":" + std::to_string(s.layers) +
       ",\"num_attention_heads\":" + std::to_string(s.heads) + ",\"intermediate_size\":" + std::to_string(s.ffn) +
       ",\"vocab_size\":" + std::to_string(s.vocab);
  if (!extra.empty()) j += "," + extra;
  return j + "}";
}

// Writes `json` as dir/config.json (dir made first); returns dir.
inline std::filesystem::path write_hf_config(const std::filesystem::path& dir, const std::string& json) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json", std::ios::trunc) << json;
  return dir;
}

}  // namespace loom::test
