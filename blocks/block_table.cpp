// Block variants by name: the table (what loom/block.hpp's attention_variant
// and ffn_variant look up). Adding a variant is its own file in this folder,
// which defines its descriptor (an AttentionVariant or FfnVariant of external
// linkage, named like the row), and one row below; no file under core/ names
// a variant.
#include "loom/block.hpp"
#include "loom/config.hpp"
#include "loom/error.hpp"

// One row per variant, in the order messages list them.
#define LOOM_ATTENTION_VARIANTS(X) \
  X(attention_native)              \
  X(attention_fused)               \
  /* end of the attention variants */
#define LOOM_FFN_VARIANTS(X) \
  X(ffn_native)              \
  X(ffn_fused)               \
  X(ffn_moe)                 \
  X(ffn_geglu)               \
  X(ffn_reglu)               \
  /* end of the feed-forward variants */

namespace loom {

#define LOOM_DECLARE_ATTENTION(v) extern const AttentionVariant v;
#define LOOM_DECLARE_FFN(v) extern const FfnVariant v;
LOOM_ATTENTION_VARIANTS(LOOM_DECLARE_ATTENTION)
LOOM_FFN_VARIANTS(LOOM_DECLARE_FFN)
#undef LOOM_DECLARE_ATTENTION
#undef LOOM_DECLARE_FFN

namespace {

#define LOOM_ADDRESS_OF(v) &v,
const AttentionVariant* const kAttention[] = {LOOM_ATTENTION_VARIANTS(LOOM_ADDRESS_OF)};
const FfnVariant* const kFfn[] = {LOOM_FFN_VARIANTS(LOOM_ADDRESS_OF)};
#undef LOOM_ADDRESS_OF

// The message for a name that is no variant: the key, the registered ones, the nearest.
[[noreturn]] void unknown_variant(const char* key, const std::string& name, const std::vector<std::string>& names) {
  std::string list;
  for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
  const std::string hint = did_you_mean(name, names);
  throw Error(cat(key, " = \"", name, "\" is not a registered block variant; registered: ", list,
                  hint.empty() ? std::string() : cat(" (did you mean \"", hint, "\"?)")));
}

}  // namespace

std::vector<std::string> attention_variant_names() {
  std::vector<std::string> out;
  for (const AttentionVariant* v : kAttention) out.emplace_back(v->name);
  return out;
}

std::vector<std::string> ffn_variant_names() {
  std::vector<std::string> out{"dense"};
  for (const FfnVariant* v : kFfn) out.emplace_back(v->name);
  return out;
}

const AttentionVariant& attention_variant(const std::string& layers) {
  for (const AttentionVariant* v : kAttention)
    if (layers == v->name) return *v;
  unknown_variant("model.layers", layers, attention_variant_names());
}

const FfnVariant& ffn_variant(const std::string& ffn, const std::string& layers, const ModelSpec& spec) {
  std::string name = ffn;
  if (ffn == "dense") name = spec.moe() ? "moe" : layers;
  for (const FfnVariant* v : kFfn)
    if (name == v->name) return *v;
  if (ffn == "dense")  // an attention variant without a feed-forward block of its name: the canonical one
    for (const FfnVariant* v : kFfn)
      if (std::string(v->name) == "native") return *v;
  unknown_variant("model.ffn", ffn, ffn_variant_names());
}

std::string layer_variants() {
  std::string s;
  for (const std::string& n : attention_variant_names()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

bool is_layer_variant(const std::string& variant) {
  for (const AttentionVariant* v : kAttention)
    if (variant == v->name) return true;
  return false;
}

}  // namespace loom
