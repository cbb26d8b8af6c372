// Block variants by name. Adding a variant: its own file in blocks/, and one
// line in each table below that it provides.
#include "loom/error.hpp"
#include "model/blocks/blocks.hpp"

namespace loom {
namespace {

struct AttentionVariant {
  const char* name;
  std::unique_ptr<AttentionBlock> (*make)(const ModelSpec&, int64_t);
};
struct FfnVariant {
  const char* name;
  std::unique_ptr<FfnBlock> (*make)(const ModelSpec&, int64_t);
};

constexpr AttentionVariant kAttention[] = {
    {"native", make_native_attention},
    {"fused", make_fused_attention},
};
constexpr FfnVariant kFfn[] = {
    {"native", make_native_ffn},
    {"fused", make_fused_ffn},
    {"moe", make_moe_ffn},  // model.ffn = "moe": with either attention variant
};

}  // namespace

std::string layer_variants() {
  std::string s;
  for (const auto& v : kAttention) s += (s.empty() ? "" : ", ") + std::string(v.name);
  return s;
}

bool is_layer_variant(const std::string& variant) {
  for (const auto& v : kAttention)
    if (variant == v.name) return true;
  return false;
}

std::unique_ptr<AttentionBlock> make_attention_block(const std::string& variant, const ModelSpec& spec, int64_t layer) {
  for (const auto& v : kAttention)
    if (variant == v.name) return v.make(spec, layer);
  throw Error(cat("model.layers = \"", variant, "\" is not one of: ", layer_variants()));
}

std::unique_ptr<FfnBlock> make_ffn_block(const std::string& variant, const ModelSpec& spec, int64_t layer) {
  for (const auto& v : kFfn)
    if (variant == v.name) return v.make(spec, layer);
  throw Error(cat("model.layers = \"", variant, "\" has no feed-forward block; one of: ", layer_variants()));
}

}  // namespace loom
