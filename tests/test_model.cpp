// The model as blocks: the layout the blocks declare, the variants' factory,
// the LM head's chunking rule, and initialisation by parameter role.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "config/run_config.hpp"
#include "model/model.hpp"
#include "test_util.hpp"
#include "train/session_probe.hpp"

namespace {

loom::ModelSpec spec(int64_t heads, int64_t kv, bool tied) {
  loom::ModelSpec s;
  s.hidden = 96;
  s.num_layers = 3;
  s.num_heads = heads;
  s.num_kv_heads = kv;
  s.ffn_hidden = 200;
  s.vocab_size = 77;
  s.tied_embeddings = tied;
  return s;
}

// Every variant declares the same HF names, shapes, offsets and roles: the
// fused blocks' [q; k; v] and [gate; up] weights are the native layout.
TEST(ModelBlocks, FusedAndNativeDeclareTheSameLayout) {
  for (const auto& s : {spec(6, 6, false), spec(6, 2, false), spec(4, 1, true)}) {
    const auto native = loom::model_units(s, "native"), fused = loom::model_units(s, "fused");
    ASSERT_EQ(native.size(), fused.size());
    ASSERT_EQ(native.size(), static_cast<size_t>(s.num_layers) + 2);
    int64_t total = 0;
    for (size_t u = 0; u < native.size(); ++u) {
      EXPECT_EQ(native[u].name, fused[u].name);
      EXPECT_EQ(native[u].numel, fused[u].numel);
      EXPECT_EQ(native[u].uses_params_of, fused[u].uses_params_of);
      ASSERT_EQ(native[u].params.size(), fused[u].params.size());
      int64_t offset = 0;
      for (size_t i = 0; i < native[u].params.size(); ++i) {
        const auto &a = native[u].params[i], &b = fused[u].params[i];
        EXPECT_EQ(a.name, b.name);
        EXPECT_EQ(a.shape, b.shape);
        EXPECT_EQ(a.offset, b.offset);
        EXPECT_EQ(a.role, b.role);
        EXPECT_EQ(a.offset, offset) << a.name << ": parameters are packed in declaration order";
        offset += a.numel;
      }
      EXPECT_EQ(offset, native[u].numel);
      total += native[u].numel;
    }
    EXPECT_EQ(total, s.total_params());
    // Roles: what init and weight decay read.
    EXPECT_EQ(native[0].params[0].role, loom::ParamRole::embedding);
    EXPECT_EQ(native[1].params[0].name, "model.layers.0.input_layernorm.weight");
    EXPECT_EQ(native[1].params[0].role, loom::ParamRole::norm_gain);
    EXPECT_FALSE(native[1].params[0].weight_decay());
    EXPECT_EQ(native[1].params[4].name, "model.layers.0.self_attn.o_proj.weight");
    EXPECT_EQ(native[1].params[4].role, loom::ParamRole::output_projection);
    EXPECT_EQ(native[1].params[8].name, "model.layers.0.mlp.down_proj.weight");
    EXPECT_EQ(native[1].params[8].role, loom::ParamRole::output_projection);
    EXPECT_EQ(native[1].params[1].role, loom::ParamRole::matrix);
    EXPECT_EQ(native.back().uses_params_of, s.tied_embeddings ? 0 : -1);
  }
}

TEST(ModelBlocks, UnknownVariantIsRefusedNamingTheChoices) {
  loom::test::expect_error([] { loom::model_units(spec(4, 2, false), "mixture"); },
                           {"model.layers = \"mixture\"", "native, fused"});
}

// Native layers compute the whole micro-batch's logits; fused ones chunk them
// by the configured size, or by 1 GiB of logits (a multiple of 128).
TEST(ModelBlocks, HeadChunkRule) {
  using loom::head_chunk_tokens;
  EXPECT_EQ(head_chunk_tokens("native", 100, 16384, 32000, loom::DType::bf16), 16384);
  EXPECT_EQ(head_chunk_tokens("fused", 100, 16384, 32000, loom::DType::bf16), 100);
  EXPECT_EQ(head_chunk_tokens("fused", 1 << 20, 16384, 32000, loom::DType::bf16), 16384);
  // 1 GiB / (32000 x 2 bytes) = 16777 tokens: the whole micro-batch of 16384.
  EXPECT_EQ(head_chunk_tokens("fused", 0, 16384, 32000, loom::DType::bf16), 16384);
  EXPECT_EQ(head_chunk_tokens("fused", 0, 65536, 32000, loom::DType::bf16), 16768);
  // Llama 3's vocabulary: 1 GiB / (128256 x 2) = 4186 -> 4096.
  EXPECT_EQ(head_chunk_tokens("fused", 0, 16384, 128256, loom::DType::bf16), 4096);
  // fp32 logits: half the tokens.
  EXPECT_EQ(head_chunk_tokens("fused", 0, 16384, 128256, loom::DType::f32), 2048);
  EXPECT_EQ(head_chunk_tokens("fused", 0, 500, 32000, loom::DType::f32), 500);
}

// Random initialisation reads the role: matrices and the embedding ~ N(0,
// init_std), output projections ~ N(0, init_std / sqrt(2 L)), norm gains 1;
// model.embedding_init_std, when set, scales the (untied) embedding alone.
// A model of init_std 0.05 with `extra` model keys; the sample standard
// deviation of >= 18K draws is within 3% of its target (its relative
// standard error is 1/sqrt(2n) < 0.6%).
void expect_random_init(const std::string& extra, double embedding_std, const std::string& dir) {
  std::ostringstream c;
  c << "[run]\ndevice = \"cpu\"\nseed = 11\nthreads = 2\nout_dir = \"" << LOOM_BINARY_DIR << "/test_tmp/" << dir << "\"\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 96\nnum_layers = 8\nnum_heads = 6\nnum_kv_heads = 2\nffn_hidden = 200\nvocab_size = 200\n"
    << "max_seq_len = 16\ninit_std = 0.05\n" << extra << "[train]\nmicro_batch = 1\nseq_len = 16\n[checkpoint]\n"
    << "resume = \"none\"\n[precision]\nplugin = \"fp32\"\n[attention]\nplugin = \"naive\"\n[sharding]\n"
    << "plugin = \"none\"\n[data]\nplugin = \"synthetic\"\n";
  loom::Session s(loom::parse_config_string(c.str(), "init.toml", {}));
  s.initialise();
  auto stddev = [&](const std::string& name) {
    const std::vector<float> v = loom::probe(s).read_param(name);
    double ss = 0;
    for (float x : v) ss += static_cast<double>(x) * x;
    return std::sqrt(ss / static_cast<double>(v.size()));
  };
  const double out_std = 0.05 / std::sqrt(2.0 * 8);
  EXPECT_NEAR(stddev("model.embed_tokens.weight"), embedding_std, 0.03 * embedding_std);
  EXPECT_NEAR(stddev("lm_head.weight"), 0.05, 0.03 * 0.05);
  EXPECT_NEAR(stddev("model.layers.3.self_attn.q_proj.weight"), 0.05, 0.03 * 0.05);
  EXPECT_NEAR(stddev("model.layers.3.mlp.gate_proj.weight"), 0.05, 0.03 * 0.05);
  EXPECT_NEAR(stddev("model.layers.3.mlp.down_proj.weight"), out_std, 0.03 * out_std);
  EXPECT_NEAR(stddev("model.layers.5.self_attn.o_proj.weight"), out_std, 0.03 * out_std);
  for (float x : loom::probe(s).read_param("model.layers.2.post_attention_layernorm.weight")) EXPECT_EQ(x, 1.0f);
  for (float x : loom::probe(s).read_param("model.norm.weight")) EXPECT_EQ(x, 1.0f);
}

TEST(ModelBlocks, RandomInitFollowsTheRoles) { expect_random_init("", 0.05, "init"); }

TEST(ModelBlocks, EmbeddingInitStdScalesTheEmbeddingOnly) {
  expect_random_init("embedding_init_std = 0.7\n", 0.7, "init_emb");
}

}  // namespace
