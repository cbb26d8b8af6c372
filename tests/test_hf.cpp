// safetensors reader/writer, HF Llama config and weights import/export, and the
// HF-transformers golden data under tests/golden.
#include <gtest/gtest.h>

#include "hf_config.hpp"
#include "test_util.hpp"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/file_util.hpp"
#include "checkpoint/train_checkpoint.hpp"
#include "config/run_config.hpp"
#include "hf/hf_llama.hpp"
#include "hf/safetensors.hpp"
#include "loom/error.hpp"
#include "loom/model.hpp"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::hf;

namespace {

using loom::test::expect_error;
using loom::test::hf_config_json;

// Per-test scratch directory.
struct TmpDir : loom::test::TmpDir {
  TmpDir() : loom::test::TmpDir("loom_hf_") {}
};

// A safetensors file from a literal header and `data_bytes` data bytes.
void write_raw_st(const fs::path& p, const std::string& header, size_t data_bytes, uint64_t hlen_override = 0) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  uint64_t n = hlen_override ? hlen_override : header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << std::string(data_bytes, '\0');
}

std::vector<float> iota_f(size_t n, float scale, float shift = 0.f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = shift + scale * std::sin(0.37f * static_cast<float>(i) + 0.1f);
  return v;
}

ModelSpec tiny_spec(bool tied) {
  ModelSpec s;
  s.hidden = 32;
  s.num_layers = 2;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.ffn_hidden = 48;
  s.vocab_size = 50;
  s.max_seq_len = 128;
  s.rope_theta = 500000.0;
  s.norm_eps = 1e-6;
  s.tied_embeddings = tied;
  return s;
}

// All parameters of a spec, with distinct deterministic values.
std::map<std::string, std::vector<float>> make_params(const ModelSpec& s) {
  std::map<std::string, std::vector<float>> m;
  int k = 0;
  for (const auto& u : model_units(s))
    for (const auto& p : u.params) m[p.name] = iota_f(static_cast<size_t>(p.numel), 0.05f + 0.001f * k++, p.shape.size() == 1 ? 1.f : 0.f);
  return m;
}

const std::string kGolden = std::string(LOOM_SOURCE_DIR) + "/tests/golden";

}  // namespace

// ---------------------------------------------------------------------------
// Scalar conversions
// ---------------------------------------------------------------------------

TEST(HfConvert, Bf16AndF16) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xC000), -2.0f);
  // 1 + 2^-8 is halfway between two bf16 values: ties to even (down to 1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3 * 2^-8 is halfway too: ties to even (up).
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(INFINITY)), INFINITY);
  EXPECT_EQ(f16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xC000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x7C00), INFINITY);
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7E00)));
}

// ---------------------------------------------------------------------------
// safetensors
// ---------------------------------------------------------------------------

TEST(SafeTensors, RoundTripF32Bf16I32) {
  TmpDir tmp;
  auto a = iota_f(6 * 5, 3.0f);
  auto b = iota_f(7, 1.0f);
  std::vector<int32_t> ids = {0, 5, -7, 299, 123456};
  std::vector<uint16_t> bf = {0x3F80, 0xC000, 0x0000};
  std::string p = (tmp.path / "t.safetensors").string();
  write_safetensors(p,
                    {{"a", {6, 5}, a.data(), DType::f32, DType::f32},
                     {"b_bf16", {7}, b.data(), DType::f32, DType::bf16},
                     {"ids", {5}, ids.data(), DType::i32, DType::i32},
                     {"raw_bf16", {3}, bf.data(), DType::bf16, DType::bf16},
                     {"scalar_empty", {0}, nullptr, DType::f32, DType::f32}},
                    {{"format", "pt"}, {"note", "x"}});
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  // The data section starts 8-byte aligned, as the format requires.
  uint64_t hlen;
  std::ifstream(p, std::ios::binary).read(reinterpret_cast<char*>(&hlen), 8);
  EXPECT_EQ((8 + hlen) % 8, 0u);

  SafeTensorsFile f(p);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "b_bf16", "ids", "raw_bf16", "scalar_empty"}));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "x");
  EXPECT_EQ(f.info("a").dtype, "F32");
  EXPECT_EQ(f.info("a").shape, (std::vector<int64_t>{6, 5}));
  EXPECT_EQ(f.info("b_bf16").dtype, "BF16");
  EXPECT_EQ(f.read_f32("a"), a);
  auto b2 = f.read_f32("b_bf16");
  for (size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(b2[i], bf16_to_f32(f32_to_bf16(b[i])));
    EXPECT_NEAR(b2[i], b[i], std::abs(b[i]) * (1.0 / 256) + 1e-30);
  }
  auto ids2 = f.read_i64("ids");
  EXPECT_EQ(ids2, (std::vector<int64_t>{0, 5, -7, 299, 123456}));
  EXPECT_EQ(f.read_f32("raw_bf16"), (std::vector<float>{1.f, -2.f, 0.f}));
  EXPECT_EQ(f.raw("raw_bf16").size(), 6u);
  EXPECT_TRUE(f.read_f32("scalar_empty").empty());

  expect_error([&] { f.read_i64("a"); }, {"t.safetensors", "'a'", "F32", "integer"});
  expect_error([&] { f.read_f32("ids"); }, {"t.safetensors", "'ids'", "I32", "floating"});
  std::vector<float> small(3);
  expect_error([&] { f.read_f32("a", small.data(), 3); }, {"t.safetensors", "'a'", "30 elements", "expects 3"});
  expect_error([&] { f.info("zzz"); }, {"t.safetensors", "'zzz'", "5 tensors"});
}

TEST(SafeTensors, ReadsF16AndF64AndI64) {
  TmpDir tmp;
  fs::path p = tmp.path / "mixed.safetensors";
  std::string h = R"({"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},)"
                  R"("d":{"dtype":"F64","shape":[1],"data_offsets":[8,16]},)"
                  R"("l":{"dtype":"I64","shape":[1],"data_offsets":[16,24]}})";
  std::ofstream f(p, std::ios::binary);
  uint64_t n = h.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << h;
  uint16_t hv[2] = {0x3C00, 0xC400};  // 1, -4
  f.write(reinterpret_cast<const char*>(hv), 4);
  f.write("\0\0\0\0", 4);  // a hole: allowed
  double d = -0.125;
  f.write(reinterpret_cast<const char*>(&d), 8);
  int64_t l = -(int64_t{1} << 40);
  f.write(reinterpret_cast<const char*>(&l), 8);
  f.close();
  SafeTensorsFile st(p.string());
  EXPECT_EQ(st.read_f32("h"), (std::vector<float>{1.f, -4.f}));
  EXPECT_EQ(st.read_f32("d"), (std::vector<float>{-0.125f}));
  EXPECT_EQ(st.read_i64("l"), (std::vector<int64_t>{-(int64_t{1} << 40)}));
}

TEST(SafeTensors, RejectsCorruptHeadersAndOffsets) {
  TmpDir tmp;
  fs::path p = tmp.path / "bad.safetensors";
  auto open = [&] { SafeTensorsFile f(p.string()); };
  auto entry = [](const std::string& dtype, const std::string& shape, const std::string& off) {
    return R"({"w":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + off + "}}";
  };

  std::ofstream(p, std::ios::binary) << "abc";
  expect_error(open, {"bad.safetensors", "shorter than the 8-byte header length"});

  write_raw_st(p, entry("F32", "[2]", "[0,8]"), 8, 1ull << 40);
  expect_error(open, {"bad.safetensors", "header length 1099511627776"});

  write_raw_st(p, "{\"w\": [1, 2", 0);
  expect_error(open, {"bad.safetensors", "does not parse"});

  write_raw_st(p, "[1, 2, 3]   ", 0);
  expect_error(open, {"bad.safetensors", "does not start with '{'"});

  write_raw_st(p, entry("F17", "[2]", "[0,8]"), 8);
  expect_error(open, {"bad.safetensors", "tensor 'w'", "unknown dtype \"F17\""});

  write_raw_st(p, entry("F32", "[2]", "[0,8]"), 4);  // data truncated
  expect_error(open, {"bad.safetensors", "tensor 'w'", "beyond the data section", "truncated"});

  write_raw_st(p, entry("F32", "[2]", "[8,0]"), 8);
  expect_error(open, {"bad.safetensors", "tensor 'w'", "begin > end"});

  write_raw_st(p, entry("F32", "[3]", "[0,8]"), 16);
  expect_error(open, {"bad.safetensors", "tensor 'w'", "span 8 bytes", "needs 12"});

  // Bytes beyond 64 bits: 2^62 F32 elements would wrap to 0 and pass as data_offsets [0, 0].
  write_raw_st(p, entry("F32", "[4611686018427387904]", "[0,0]"), 0);
  expect_error(open, {"bad.safetensors", "tensor 'w'", "[4611686018427387904]", "too large"});
  write_raw_st(p, entry("F64", "[1073741824,2147483648]", "[0,0]"), 0);
  expect_error(open, {"bad.safetensors", "tensor 'w'", "too large"});

  write_raw_st(p, entry("BF16", "[-2]", "[0,4]"), 4);
  expect_error(open, {"bad.safetensors", "tensor 'w'", "negative"});

  write_raw_st(p, R"({"w":{"dtype":"F32","shape":[2]}})", 8);
  expect_error(open, {"bad.safetensors", "tensor 'w'", "data_offsets"});

  write_raw_st(p, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  expect_error(open, {"bad.safetensors", "'a' and 'b' overlap"});

  // Bytes after the last tensor: a header length short by its padding shifts every tensor
  // (here one byte of the header's spaces would be read as data); bytes appended.
  const std::string padded = entry("F32", "[2]", "[0,8]") + "   ";
  write_raw_st(p, padded, 8, padded.size() - 1);
  expect_error(open, {"bad.safetensors", "end at byte 8 of the data section, which holds 9 bytes", "header length"});
  write_raw_st(p, entry("F32", "[2]", "[0,8]"), 12);
  expect_error(open, {"bad.safetensors", "end at byte 8", "holds 12 bytes"});

  // A name twice: the parser would keep one entry and leave the other's bytes unread.
  write_raw_st(p, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16);
  expect_error(open, {"bad.safetensors", "'a' twice"});

  write_raw_st(p, R"({"__metadata__":{"format":3}})", 0);
  expect_error(open, {"bad.safetensors", "__metadata__", "not a string"});

  expect_error([&] { SafeTensorsFile f((tmp.path / "absent.safetensors").string()); }, {"absent.safetensors", "cannot open"});

  // Writer refusals.
  float x = 1;
  expect_error([&] { write_safetensors(p.string(), {{"a", {1}, &x}, {"a", {1}, &x}}); }, {"'a'", "twice"});
  expect_error([&] { write_safetensors(p.string(), {{"a", {1}, &x, DType::f32, DType::e4m3}}); }, {"'a'", "fp8_e4m3"});
  expect_error([&] { write_safetensors(p.string(), {{"a", {1}, &x, DType::bf16, DType::f32}}); }, {"'a'", "bf16 to fp32"});
}

// ---------------------------------------------------------------------------
// HF config
// ---------------------------------------------------------------------------

TEST(HfConfig, ParsesTransformers4And5Spellings) {
  // transformers 4.x: rope_theta at top level, no num_key_value_heads (defaults to heads).
  auto s = parse_hf_llama_config(hf_config_json("llama", R"("max_position_embeddings":256,
      "rope_theta":500000.0,"rms_norm_eps":1e-5,"tie_word_embeddings":true,"rope_scaling":null,
      "hidden_act":"silu","attention_bias":false,"mlp_bias":false,"torch_dtype":"bfloat16")"),
                                 "v4.json");
  EXPECT_EQ(s.hidden, 64);
  EXPECT_EQ(s.num_layers, 2);
  EXPECT_EQ(s.num_heads, 4);
  EXPECT_EQ(s.num_kv_heads, 4);
  EXPECT_EQ(s.ffn_hidden, 100);
  EXPECT_EQ(s.vocab_size, 77);
  EXPECT_EQ(s.max_seq_len, 256);
  EXPECT_EQ(s.rope_theta, 500000.0);
  EXPECT_EQ(s.norm_eps, 1e-5);
  EXPECT_TRUE(s.tied_embeddings);

  // transformers 5.x: rope_parameters; minimal keys take LlamaConfig's defaults.
  s = parse_hf_llama_config(hf_config_json("llama", R"("num_key_value_heads":1,
      "head_dim":16,"rope_parameters":{"rope_type":"default","rope_theta":1234.0})"),
                            "v5.json");
  EXPECT_EQ(s.num_kv_heads, 1);
  EXPECT_EQ(s.rope_theta, 1234.0);
  EXPECT_EQ(s.max_seq_len, 2048);
  EXPECT_EQ(s.norm_eps, 1e-6);
  EXPECT_FALSE(s.tied_embeddings);
  s = parse_hf_llama_config(hf_config_json("llama"), "bare.json");
  EXPECT_EQ(s.rope_theta, 10000.0);
}

TEST(HfConfig, RefusesWhatLoomDoesNotImplement) {
  auto cfg = [](const std::string& extra) { return hf_config_json("", extra); };
  auto parse = [&](const std::string& extra) { return [=] { parse_hf_llama_config(cfg(extra), "cfg.json"); }; };
  expect_error(parse(""), {"cfg.json", "model_type", "missing", "llama"});
  expect_error(parse(R"("model_type":"mistral")"), {"cfg.json", "\"mistral\"", "expected \"llama\""});
  expect_error(parse(R"("model_type":"llama","hidden_act":"gelu")"), {"cfg.json", "hidden_act", "gelu", "silu"});
  expect_error(parse(R"("model_type":"llama","attention_bias":true)"), {"cfg.json", "attention_bias", "bias"});
  expect_error(parse(R"("model_type":"llama","mlp_bias":true)"), {"cfg.json", "mlp_bias"});
  expect_error(parse(R"("model_type":"llama","rope_scaling":{"rope_type":"llama3","factor":8.0})"),
               {"cfg.json", "rope_scaling", "llama3"});
  expect_error(parse(R"("model_type":"llama","rope_parameters":{"rope_type":"yarn","rope_theta":1e4})"),
               {"cfg.json", "rope_parameters", "yarn"});
  // A rope_type that is no string is refused as a RoPE Loom does not implement, not a JSON type error.
  expect_error(parse(R"("model_type":"llama","rope_scaling":{"type":3})"), {"cfg.json", "rope_scaling", "{\"type\":3}"});
  expect_error(parse(R"("model_type":"llama","rope_scaling":{"rope_type":null})"), {"cfg.json", "rope_scaling", "null"});
  expect_error(parse(R"("model_type":"llama","rope_parameters":{"rope_type":5,"rope_theta":1e4})"),
               {"cfg.json", "rope_parameters", "\"rope_type\":5"});
  expect_error(parse(R"("model_type":"llama","head_dim":32)"), {"cfg.json", "head_dim is 32", "= 16"});
  expect_error(parse(R"("model_type":"llama","num_key_value_heads":3)"), {"cfg.json", "not divisible by num_key_value_heads 3"});
  expect_error(parse(R"("model_type":"llama","rms_norm_eps":"small")"), {"cfg.json", "rms_norm_eps", "\"small\""});
  // The ranges of model.norm_eps and model.rope_theta hold for config.json too:
  // an epsilon that is 0 in fp32, a RoPE base below 1.
  for (const char* eps : {"5e-324", "1e-39", "2.0"})
    expect_error(parse(std::string(R"("model_type":"llama","rms_norm_eps":)") + eps),
                 {"cfg.json", "rms_norm_eps", eps, "[1.17549435e-38, 1]"});
  for (const char* theta : {"0.5", "1e-300"})
    expect_error(parse(std::string(R"("model_type":"llama","rope_theta":)") + theta), {"cfg.json", "rope_theta", ">= 1"});
  EXPECT_NO_THROW(parse_hf_llama_config(cfg(R"("model_type":"llama","rms_norm_eps":1.17549435e-38,"rope_theta":1e300)"),
                                        "ok.json"));
  expect_error([&] { parse_hf_llama_config(R"({"model_type":"llama","hidden_size":64})", "cfg.json"); },
               {"cfg.json", "num_hidden_layers", "missing"});
  expect_error([&] { parse_hf_llama_config(R"({"model_type":"llama","hidden_size":-64})", "cfg.json"); },
               {"cfg.json", "hidden_size", "positive integer", "-64"});
  // Sizes beyond the ranges of the model.* keys they become are refused naming the key and the limit, not
  // left to the memory plan or to a huge allocation ("out of memory", naming no file).
  const std::map<std::string, std::pair<std::string, std::string>> too_large = {
      {"hidden_size", {"1000000000000", "at most 1048576, the range of model.hidden"}},
      {"num_hidden_layers", {"1000000000", "at most 4096, the range of model.num_layers"}},
      {"num_attention_heads", {"8192", "at most 4096"}},
      {"num_key_value_heads", {"8192", "at most 4096"}},
      {"intermediate_size", {"18446744073709551615", "at most 1048576"}},
      {"vocab_size", {"2147483648", "at most 2147483647"}}};
  for (const auto& [key, v] : too_large) {
    nlohmann::json j = nlohmann::json::parse(hf_config_json("llama"));
    j[key] = nlohmann::json::parse(v.first);
    expect_error([&] { parse_hf_llama_config(j.dump(), "cfg.json"); }, {"cfg.json", key, v.first, v.second});
  }
  expect_error([&] { parse_hf_llama_config("{nope", "cfg.json"); }, {"cfg.json", "not valid JSON"});
  // A default (no-op) rope_scaling block is fine.
  EXPECT_NO_THROW(parse_hf_llama_config(cfg(R"("model_type":"llama","rope_scaling":{"rope_type":"default"})"), "ok.json"));
  TmpDir tmp;
  expect_error([&] { read_hf_llama_config(tmp.str()); }, {"no config.json", tmp.str()});
}

// ---------------------------------------------------------------------------
// HF weights
// ---------------------------------------------------------------------------

TEST(HfLlama, SaveThenLoadRoundTripF32AndBf16) {
  for (bool tied : {false, true}) {
    for (DType out : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(tied ? "tied " : "untied ") + std::string(dtype_name(out)));
      TmpDir tmp;
      const ModelSpec spec = tiny_spec(tied);
      auto params = make_params(spec);
      std::string dir = (tmp.path / "export").string();  // created by save_hf_llama
      save_hf_llama(dir, spec, [&](const std::string& n) { return params.at(n).data(); }, out,
                    HfExportOptions{1, 2});

      ModelSpec back = read_hf_llama_config(dir);
      EXPECT_EQ(back.hidden, spec.hidden);
      EXPECT_EQ(back.num_layers, spec.num_layers);
      EXPECT_EQ(back.num_heads, spec.num_heads);
      EXPECT_EQ(back.num_kv_heads, spec.num_kv_heads);
      EXPECT_EQ(back.ffn_hidden, spec.ffn_hidden);
      EXPECT_EQ(back.vocab_size, spec.vocab_size);
      EXPECT_EQ(back.max_seq_len, spec.max_seq_len);
      EXPECT_EQ(back.rope_theta, spec.rope_theta);
      EXPECT_EQ(back.norm_eps, spec.norm_eps);
      EXPECT_EQ(back.tied_embeddings, spec.tied_embeddings);
      auto cfg = nlohmann::json::parse(ckpt::read_file(dir + "/config.json", "config"));
      EXPECT_EQ(cfg["architectures"][0], "LlamaForCausalLM");
      EXPECT_EQ(cfg["torch_dtype"], out == DType::bf16 ? "bfloat16" : "float32");
      EXPECT_EQ(cfg["bos_token_id"], 1);
      EXPECT_EQ(cfg["eos_token_id"], 2);

      SafeTensorsFile st(dir + "/model.safetensors");
      EXPECT_EQ(st.metadata().at("format"), "pt");
      EXPECT_EQ(st.has("lm_head.weight"), !tied);
      EXPECT_EQ(st.info("model.norm.weight").dtype, out == DType::bf16 ? "BF16" : "F32");

      std::map<std::string, std::vector<float>> loaded;
      load_hf_llama_weights(dir, back, [&](const std::string& n, int64_t numel) {
        auto& v = loaded[n];
        v.assign(static_cast<size_t>(numel), NAN);
        return v.data();
      });
      ASSERT_EQ(loaded.size(), params.size());
      for (const auto& [n, v] : params) {
        const auto& w = loaded.at(n);
        ASSERT_EQ(w.size(), v.size()) << n;
        for (size_t i = 0; i < v.size(); ++i) {
          float expect = out == DType::bf16 ? bf16_to_f32(f32_to_bf16(v[i])) : v[i];
          ASSERT_EQ(w[i], expect) << n << "[" << i << "]";
        }
      }
    }
  }
}

TEST(HfLlama, LoadSkipsTensorsTheCallerDoesNotHold) {
  TmpDir tmp;
  const ModelSpec spec = tiny_spec(false);
  auto params = make_params(spec);
  save_hf_llama(tmp.str(), spec, [&](const std::string& n) { return params.at(n).data(); }, DType::f32);
  std::vector<float> norm(static_cast<size_t>(spec.hidden));
  int calls = 0;
  load_hf_llama_weights(tmp.str(), spec, [&](const std::string& n, int64_t numel) -> float* {
    ++calls;
    if (n != "model.norm.weight") return nullptr;
    EXPECT_EQ(numel, spec.hidden);
    return norm.data();
  });
  EXPECT_EQ(calls, static_cast<int>(params.size()));
  EXPECT_EQ(norm, params.at("model.norm.weight"));
}

// Writes `names` of `params` to a single model.safetensors in `dir`, plus config.json for `spec`.
static void write_model_dir(const fs::path& dir, const ModelSpec& spec,
                            const std::map<std::string, std::vector<float>>& params,
                            std::vector<SafeTensorsEntry> extra = {}, const std::string& skip = "") {
  save_hf_llama(dir.string(), spec, [&](const std::string& n) { return params.at(n).data(); }, DType::f32);
  std::vector<SafeTensorsEntry> e;
  for (const auto& u : model_units(spec))
    for (const auto& p : u.params)
      if (p.name != skip) e.push_back({p.name, p.shape, params.at(p.name).data()});
  for (auto& x : extra) e.push_back(x);
  write_safetensors((dir / "model.safetensors").string(), e, {{"format", "pt"}});
}

TEST(HfLlama, LoadRefusesMissingWrongShapeAndUnexpectedTensors) {
  TmpDir tmp;
  const ModelSpec spec = tiny_spec(false);
  auto params = make_params(spec);
  auto sink = [&](const std::string&, int64_t numel) {
    static std::vector<float> buf;
    buf.resize(static_cast<size_t>(numel));
    return buf.data();
  };
  std::vector<float> inv(8, 1.f), big(1000, 0.f);

  write_model_dir(tmp.path, spec, params, {}, "model.layers.1.mlp.up_proj.weight");
  expect_error([&] { load_hf_llama_weights(tmp.str(), spec, sink); },
               {tmp.str(), "'model.layers.1.mlp.up_proj.weight' is missing", "do not match"});

  write_model_dir(tmp.path, spec, params, {{"model.layers.1.mlp.up_proj.weight", {32, 48}, big.data()}},
                  "model.layers.1.mlp.up_proj.weight");
  expect_error([&] { load_hf_llama_weights(tmp.str(), spec, sink); },
               {"model.safetensors", "'model.layers.1.mlp.up_proj.weight'", "[32, 48]", "expected [48, 32]"});

  write_model_dir(tmp.path, spec, params, {{"model.layers.2.self_attn.q_proj.weight", {4, 8}, big.data()}});
  expect_error([&] { load_hf_llama_weights(tmp.str(), spec, sink); },
               {"model.safetensors", "unexpected tensor 'model.layers.2.self_attn.q_proj.weight'"});

  // Rotary buffers are ignored; so is a stored lm_head of a tied model, but not of an untied one's extra copy.
  write_model_dir(tmp.path, spec, params, {{"model.layers.0.self_attn.rotary_emb.inv_freq", {8}, inv.data()}});
  EXPECT_NO_THROW(load_hf_llama_weights(tmp.str(), spec, sink));
  const ModelSpec tied = tiny_spec(true);
  auto tparams = make_params(tied);
  std::vector<float> head(static_cast<size_t>(tied.vocab_size * tied.hidden), 0.5f);
  write_model_dir(tmp.path, tied, tparams, {{"lm_head.weight", {tied.vocab_size, tied.hidden}, head.data()}});
  EXPECT_NO_THROW(load_hf_llama_weights(tmp.str(), tied, sink));
  // The untied spec against the tied files: lm_head is missing.
  fs::remove(tmp.path / "model.safetensors");
  write_model_dir(tmp.path, tied, tparams);
  expect_error([&] { load_hf_llama_weights(tmp.str(), spec, sink); }, {"'lm_head.weight' is missing"});

  TmpDir empty;
  std::ofstream(empty.path / "pytorch_model.bin") << "x";
  expect_error([&] { load_hf_llama_weights(empty.str(), spec, sink); },
               {"no model.safetensors", "pytorch_model.bin", "safe_serialization"});

  // A link whose target is gone (a cleaned download cache) or a link loop is
  // listed as one that cannot be followed, not as if the file were there.
  TmpDir links;
  fs::create_symlink(links.path / "blobs" / "gone", links.path / "model.safetensors");
  fs::create_symlink(links.path / "loop_b", links.path / "loop_a");
  fs::create_symlink(links.path / "loop_a", links.path / "loop_b");
  expect_error([&] { load_hf_llama_weights(links.str(), spec, sink); },
               {"no model.safetensors", "model.safetensors (a link to " + (links.path / "blobs" / "gone").string() +
                                            ", which cannot be followed",
                "loop_a (a link to"});
  expect_error([&] { read_hf_llama_config(links.str()); },
               {"no config.json", "model.safetensors (a link to", "which cannot be followed"});
  // The same when the link loop has the very name looked for.
  fs::remove(links.path / "model.safetensors");
  fs::create_symlink(links.path / "model.safetensors", links.path / "model.safetensors");
  expect_error([&] { load_hf_llama_weights(links.str(), spec, sink); },
               {"no model.safetensors", "model.safetensors (a link to", "which cannot be followed"});
}

TEST(HfLlama, LoadsShardedCheckpointThroughIndex) {
  TmpDir tmp;
  const ModelSpec spec = tiny_spec(false);
  auto params = make_params(spec);
  // Shard 1: embedding and layer 0 (as bf16); shard 2: the rest (f32), as HF's sharded save does.
  std::vector<SafeTensorsEntry> s1, s2;
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  for (const auto& u : model_units(spec))
    for (const auto& p : u.params) {
      bool first = u.name == "embedding" || u.name == "layer.0";
      (first ? s1 : s2).push_back({p.name, p.shape, params.at(p.name).data(), DType::f32, first ? DType::bf16 : DType::f32});
      index["weight_map"][p.name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    }
  write_safetensors((tmp.path / "model-00001-of-00002.safetensors").string(), s1, {{"format", "pt"}});
  write_safetensors((tmp.path / "model-00002-of-00002.safetensors").string(), s2, {{"format", "pt"}});
  ckpt::write_file_atomic((tmp.path / "model.safetensors.index.json").string(), index.dump());

  std::map<std::string, std::vector<float>> loaded;
  auto into = [&](const std::string& n, int64_t numel) {
    loaded[n].assign(static_cast<size_t>(numel), NAN);
    return loaded[n].data();
  };
  load_hf_llama_weights(tmp.str(), spec, into);
  ASSERT_EQ(loaded.size(), params.size());
  for (const auto& [n, v] : params) {
    bool bf = n.find("embed") != std::string::npos || n.find("layers.0.") != std::string::npos;
    for (size_t i = 0; i < v.size(); ++i)
      ASSERT_EQ(loaded[n][i], bf ? bf16_to_f32(f32_to_bf16(v[i])) : v[i]) << n;
  }

  // An index naming a shard that is not there.
  index["weight_map"]["model.norm.weight"] = "model-00003-of-00002.safetensors";
  ckpt::write_file_atomic((tmp.path / "model.safetensors.index.json").string(), index.dump());
  expect_error([&] { load_hf_llama_weights(tmp.str(), spec, into); },
               {"model.safetensors.index.json", "'model.norm.weight'", "model-00003-of-00002.safetensors", "does not exist"});
  // An index that lists a tensor in the wrong shard.
  index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors";
  ckpt::write_file_atomic((tmp.path / "model.safetensors.index.json").string(), index.dump());
  expect_error([&] { load_hf_llama_weights(tmp.str(), spec, into); },
               {"model-00001-of-00002.safetensors", "'model.norm.weight'", "not present"});
  // A shard tensor the index does not list.
  index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors";
  index["weight_map"].erase("model.layers.1.mlp.down_proj.weight");
  ckpt::write_file_atomic((tmp.path / "model.safetensors.index.json").string(), index.dump());
  expect_error([&] { load_hf_llama_weights(tmp.str(), spec, into); },
               {"model-00002-of-00002.safetensors", "'model.layers.1.mlp.down_proj.weight'", "not listed"});
  ckpt::write_file_atomic((tmp.path / "model.safetensors.index.json").string(), "{\"weight_map\": 3}");
  expect_error([&] { load_hf_llama_weights(tmp.str(), spec, into); }, {"model.safetensors.index.json", "weight_map"});
}

// ---------------------------------------------------------------------------
// Goldens made by tests/golden/make_golden.py with HF transformers
// ---------------------------------------------------------------------------

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, HfFolderLoadsAndMatchesReference) {
  const std::string model = GetParam();
  const std::string dir = kGolden + "/" + model;
  auto ref_json = nlohmann::json::parse(ckpt::read_file(dir + "/reference.json", "golden reference"));
  const auto& c = ref_json["config"];

  ModelSpec spec = read_hf_llama_config(dir + "/hf");
  EXPECT_EQ(spec.hidden, c["hidden_size"].get<int64_t>());
  EXPECT_EQ(spec.num_layers, c["num_hidden_layers"].get<int64_t>());
  EXPECT_EQ(spec.num_heads, c["num_attention_heads"].get<int64_t>());
  EXPECT_EQ(spec.num_kv_heads, c["num_key_value_heads"].get<int64_t>());
  EXPECT_EQ(spec.ffn_hidden, c["intermediate_size"].get<int64_t>());
  EXPECT_EQ(spec.vocab_size, c["vocab_size"].get<int64_t>());
  EXPECT_EQ(spec.max_seq_len, c["max_position_embeddings"].get<int64_t>());
  EXPECT_EQ(spec.rope_theta, c["rope_theta"].get<double>());
  EXPECT_EQ(spec.norm_eps, c["rms_norm_eps"].get<double>());
  EXPECT_EQ(spec.tied_embeddings, c["tie_word_embeddings"].get<bool>());
  EXPECT_EQ(spec.tied_embeddings, model == "mha");
  EXPECT_EQ(spec.num_kv_heads, model == "mha" ? 6 : 2);

  std::map<std::string, std::vector<float>> w;
  load_hf_llama_weights(dir + "/hf", spec, [&](const std::string& n, int64_t numel) {
    w[n].assign(static_cast<size_t>(numel), NAN);
    return w[n].data();
  });
  SafeTensorsFile hf(dir + "/hf/model.safetensors");
  SafeTensorsFile ref(dir + "/reference.safetensors");
  // The reference has one gradient per trainable parameter, in the same names
  // and shapes: the loaded layout is the one the integrator compares against.
  size_t grads = 0;
  for (const auto& n : ref.names()) grads += n.rfind("grad.", 0) == 0;
  size_t expected = 0;
  for (const auto& u : model_units(spec))
    for (const auto& p : u.params) {
      ++expected;
      ASSERT_TRUE(w.count(p.name)) << p.name;
      ASSERT_TRUE(ref.has("grad." + p.name)) << p.name;
      EXPECT_EQ(ref.info("grad." + p.name).shape, p.shape) << p.name;
      EXPECT_EQ(hf.info(p.name).dtype, "F32");
      EXPECT_EQ(w[p.name], hf.read_f32(p.name)) << p.name;
      // Initialisation as documented: matrices N(0, 0.02), norm gains 1 + 0.1 N(0, 1).
      double sum = 0, sq = 0;
      for (float x : w[p.name]) {
        sum += x;
        sq += static_cast<double>(x) * x;
      }
      double mean = sum / p.numel, sd = std::sqrt(sq / p.numel - mean * mean);
      if (p.shape.size() == 2) {
        EXPECT_NEAR(mean, 0.0, 0.01) << p.name;
        EXPECT_NEAR(sd, 0.02, 0.004) << p.name;
      } else {
        EXPECT_NEAR(mean, 1.0, 0.05) << p.name;
        EXPECT_NEAR(sd, 0.1, 0.04) << p.name;
      }
    }
  EXPECT_EQ(grads, expected);
  // Tied: the head is the embedding, so neither the HF file nor the gradients carry lm_head.
  EXPECT_EQ(hf.has("lm_head.weight"), model == "gqa");
  EXPECT_EQ(ref.has("grad.lm_head.weight"), model == "gqa");

  // The batch: targets are the inputs shifted by one token.
  ASSERT_EQ(ref.info("input_ids").dtype, "I32");
  EXPECT_EQ(ref.info("input_ids").shape, (std::vector<int64_t>{2, 33}));
  EXPECT_EQ(ref.info("targets").shape, (std::vector<int64_t>{2, 33}));
  auto ids = ref.read_i64("input_ids"), tgt = ref.read_i64("targets");
  for (int b = 0; b < 2; ++b)
    for (int s = 0; s + 1 < 33; ++s) EXPECT_EQ(tgt[b * 33 + s], ids[b * 33 + s + 1]);
  for (auto t : ids) EXPECT_TRUE(t >= 0 && t < spec.vocab_size);
  EXPECT_EQ(ref.info("logits").shape, (std::vector<int64_t>{2, 33, spec.vocab_size}));

  // Loss of a near-uniform prediction is about ln(vocab); the AdamW run starts
  // from the same loss and goes down.
  float loss = ref.read_f32("loss").at(0);
  EXPECT_NEAR(loss, std::log(static_cast<double>(spec.vocab_size)), 0.3);
  auto losses = ref.read_f32("adamw_losses");
  auto norms = ref.read_f32("adamw_grad_norms");
  ASSERT_EQ(losses.size(), 5u);
  ASSERT_EQ(norms.size(), 5u);
  EXPECT_EQ(losses[0], loss);
  for (int i = 1; i < 5; ++i) EXPECT_LT(losses[i], losses[i - 1]);
  for (float n : norms) EXPECT_GT(n, 0.f);
  EXPECT_NEAR(losses[0], ref_json["values"]["adamw_losses"][0].get<double>(), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Models, Golden, ::testing::Values("mha", "gqa"));

// Golden weights -> save_hf_llama -> load again: bit-identical in fp32. The
// export is kept under the build tree so that tests/golden/check_export.py can
// load it with transformers and compare logits with the reference.
TEST_P(Golden, ExportRoundTripIsExact) {
  const std::string model = GetParam();
  const std::string src = kGolden + "/" + model + "/hf";
  ModelSpec spec = read_hf_llama_config(src);
  std::map<std::string, std::vector<float>> w;
  load_hf_llama_weights(src, spec, [&](const std::string& n, int64_t numel) {
    w[n].resize(static_cast<size_t>(numel));
    return w[n].data();
  });
  const std::string out = std::string(LOOM_BINARY_DIR) + "/golden_export/" + model;
  save_hf_llama(out, spec, [&](const std::string& n) { return w.at(n).data(); }, DType::f32, HfExportOptions{1, 2});
  ModelSpec back = read_hf_llama_config(out);
  EXPECT_EQ(back.tied_embeddings, spec.tied_embeddings);
  EXPECT_EQ(back.num_kv_heads, spec.num_kv_heads);
  EXPECT_EQ(back.rope_theta, spec.rope_theta);
  SafeTensorsFile a(src + "/model.safetensors"), b(out + "/model.safetensors");
  EXPECT_EQ(b.names().size(), a.names().size());
  for (const auto& n : a.names()) {
    ASSERT_TRUE(b.has(n)) << n;
    EXPECT_EQ(b.info(n).shape, a.info(n).shape) << n;
    auto ra = a.raw(n), rb = b.raw(n);
    ASSERT_EQ(ra.size(), rb.size()) << n;
    EXPECT_EQ(std::memcmp(ra.data(), rb.data(), ra.size()), 0) << n;
  }
  // A bf16 export of the same weights (check_export.py --tol 2e-2 loads it).
  save_hf_llama(out + "_bf16", spec, [&](const std::string& n) { return w.at(n).data(); }, DType::bf16);
  SafeTensorsFile c(out + "_bf16/model.safetensors");
  for (const auto& n : a.names()) {
    ASSERT_EQ(c.info(n).dtype, "BF16") << n;
    auto x = c.read_f32(n);
    const auto& ref = w.at(n);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], bf16_to_f32(f32_to_bf16(ref[i]))) << n;
  }
}

// ---------------------------------------------------------------------------
// Mixtral (tests/golden/mixtral, made by make_mixtral_model_golden.py)
// ---------------------------------------------------------------------------

TEST(MixtralHf, ConfigReadsTheMixtureOfExperts) {
  const std::string dir = kGolden + "/mixtral/hf";
  const ModelSpec spec = read_hf_llama_config(dir);
  EXPECT_TRUE(spec.moe());
  EXPECT_EQ(spec.num_experts, 4);
  EXPECT_EQ(spec.top_k, 2);
  EXPECT_EQ(spec.router_aux_loss_coef, 0.02);
  EXPECT_EQ(spec.router_jitter_noise, 0.0);
  EXPECT_EQ(spec.hidden, 64);
  EXPECT_EQ(spec.num_kv_heads, 2);
  EXPECT_EQ(spec.ffn_hidden, 48);
  EXPECT_EQ(spec.rope_theta, 1e6);
  // The layout: HF Mixtral's checkpoint names, router then per expert w1, w3, w2
  // ([w1; w3] one contiguous [2f, h] matrix: the experts' gate-and-up GEMM).
  const auto units = model_units(spec);
  ASSERT_EQ(units.size(), 4u);
  const auto& l0 = units[1].params;
  ASSERT_EQ(l0.size(), 5u + 2u + 12u);
  EXPECT_EQ(l0[5].name, "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(l0[6].name, "model.layers.0.block_sparse_moe.gate.weight");
  EXPECT_EQ(l0[6].shape, (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(l0[7].name, "model.layers.0.block_sparse_moe.experts.0.w1.weight");
  EXPECT_EQ(l0[7].shape, (std::vector<int64_t>{48, 64}));
  EXPECT_EQ(l0[8].name, "model.layers.0.block_sparse_moe.experts.0.w3.weight");
  EXPECT_EQ(l0[8].shape, (std::vector<int64_t>{48, 64}));
  EXPECT_EQ(l0[8].offset, l0[7].offset + 48 * 64);
  EXPECT_EQ(l0[8].role, ParamRole::matrix);
  EXPECT_EQ(l0[9].name, "model.layers.0.block_sparse_moe.experts.0.w2.weight");
  EXPECT_EQ(l0[9].shape, (std::vector<int64_t>{64, 48}));
  EXPECT_EQ(l0[9].role, ParamRole::output_projection);
  EXPECT_EQ(l0[18].name, "model.layers.0.block_sparse_moe.experts.3.w2.weight");
  // Accounting: every expert in the total, top_k of them active.
  const int64_t attn = 2 * 64 + 64 * 64 + 2 * 64 * 32 + 64 * 64, expert = 3 * 64 * 48;
  EXPECT_EQ(spec.total_params(), 2 * 257 * 64 + 2 * (attn + 4 * 64 + 4 * expert) + 64);
  EXPECT_EQ(spec.active_params(), 2 * 257 * 64 + 2 * (attn + 4 * 64 + 2 * expert) + 64);
  int64_t declared = 0;
  for (const auto& u : units) declared += u.numel;
  EXPECT_EQ(declared, spec.total_params());
}

TEST(MixtralHf, RefusesWhatLoomDoesNotImplement) {
  auto parse = [](const std::string& extra) {
    return [=] { parse_hf_llama_config(hf_config_json("mixtral", extra), "cfg.json"); };
  };
  expect_error(parse(R"("sliding_window":4096)"), {"cfg.json", "sliding_window", "4096", "full causal"});
  expect_error(parse(R"("num_local_experts":2,"num_experts_per_tok":3)"),
               {"cfg.json", "num_experts_per_tok 3", "num_local_experts 2"});
  expect_error(parse(R"("num_local_experts":0)"), {"cfg.json", "num_local_experts", "positive integer"});
  expect_error(parse(R"("num_local_experts":1000000000)"), {"cfg.json", "num_local_experts", "at most 4096"});
  expect_error(parse(R"("num_local_experts":128,"num_experts_per_tok":65)"), {"cfg.json", "num_experts_per_tok", "at most 64"});
  expect_error(parse(R"("router_jitter_noise":1.5)"), {"cfg.json", "router_jitter_noise", "[0, 0.999]"});
  expect_error(parse(R"("router_aux_loss_coef":-0.1)"), {"cfg.json", "router_aux_loss_coef", "[0, 1000000]"});
  expect_error([] { parse_hf_llama_config(R"({"model_type":"qwen2_moe"})", "cfg.json"); },
               {"cfg.json", "\"qwen2_moe\"", "\"mixtral\""});
  // MixtralConfig's defaults for what a config.json omits.
  const ModelSpec d = parse_hf_llama_config(hf_config_json("mixtral"), "cfg.json");
  EXPECT_EQ(d.num_experts, 8);
  EXPECT_EQ(d.top_k, 2);
  EXPECT_EQ(d.router_aux_loss_coef, 0.001);
  EXPECT_EQ(d.router_jitter_noise, 0.0);
  EXPECT_NO_THROW(parse_hf_llama_config(hf_config_json("mixtral", R"("sliding_window":null,"router_aux_loss_coef":0)"), "ok"));
}

// transformers' folder -> Loom (import) -> Loom's folder (export): every
// tensor byte-equal in fp32, the config keys that define the model equal; and
// the export is a fixed point (importing and exporting it again writes the
// same bytes). The export stays under the build tree for check_export.py.
TEST(MixtralHf, ImportExportRoundTripIsByteEqual) {
  const std::string src = kGolden + "/mixtral/hf";
  const ModelSpec spec = read_hf_llama_config(src);
  auto load = [&](const std::string& dir, std::map<std::string, std::vector<float>>& w) {
    load_hf_llama_weights(dir, spec, [&](const std::string& n, int64_t numel) {
      w[n].resize(static_cast<size_t>(numel));
      return w[n].data();
    });
  };
  std::map<std::string, std::vector<float>> w;
  load(src, w);
  const std::string out = std::string(LOOM_BINARY_DIR) + "/golden_export/mixtral";
  save_hf_llama(out, spec, [&](const std::string& n) { return w.at(n).data(); }, DType::f32, HfExportOptions{1, 2});
  SafeTensorsFile a(src + "/model.safetensors"), b(out + "/model.safetensors");
  EXPECT_EQ(b.names().size(), a.names().size());
  for (const auto& n : a.names()) {
    ASSERT_TRUE(b.has(n)) << n;
    EXPECT_EQ(b.info(n).shape, a.info(n).shape) << n;
    EXPECT_EQ(b.info(n).dtype, "F32") << n;
    auto ra = a.raw(n), rb = b.raw(n);
    ASSERT_EQ(ra.size(), rb.size()) << n;
    EXPECT_EQ(std::memcmp(ra.data(), rb.data(), ra.size()), 0) << n;
  }
  const auto ca = nlohmann::json::parse(ckpt::read_file(src + "/config.json", "config"));
  const auto cb = nlohmann::json::parse(ckpt::read_file(out + "/config.json", "config"));
  for (const char* k : {"model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings",
                        "rms_norm_eps", "rope_theta", "tie_word_embeddings", "hidden_act", "num_local_experts",
                        "num_experts_per_tok", "router_aux_loss_coef", "router_jitter_noise", "sliding_window"}) {
    ASSERT_TRUE(cb.contains(k)) << k;
    EXPECT_EQ(cb[k], ca[k]) << k;
  }
  EXPECT_EQ(read_hf_llama_config(out).num_experts, spec.num_experts);
  // Export -> import -> export: the same bytes, file for file.
  std::map<std::string, std::vector<float>> w2;
  load(out, w2);
  const std::string again = out + "_again";
  save_hf_llama(again, spec, [&](const std::string& n) { return w2.at(n).data(); }, DType::f32, HfExportOptions{1, 2});
  for (const char* f : {"model.safetensors", "config.json"})
    EXPECT_EQ(ckpt::read_file(out + "/" + f, "export"), ckpt::read_file(again + "/" + f, "export")) << f;
}

// ---------------------------------------------------------------------------
// Every value config.json sets is held to the range of the model.* key it
// becomes (config/run_config.hpp): a wrong JSON type, a fraction for a size,
// a number written as a string ("NaN", "1e300"), NaN/Infinity literals
// (Python's json writes them), 1e300, a negative, zero, one past the range —
// each refused naming the file, the JSON key, the value, the range and the
// model.* key. The edges of each range are accepted.
// ---------------------------------------------------------------------------

namespace {

struct MappedKey {
  const char* json;       // the config.json key ("rope_parameters.rope_theta": nested)
  const char* model_key;  // the model.* key it sets
  const char* range;      // as the message states it
  bool mixtral;           // read for model_type "mixtral" only
  std::vector<std::string> bad, good;  // JSON texts
};

// Every key parse_hf_llama_config maps onto a model.* key.
std::vector<MappedKey> mapped_keys() {
  const std::vector<std::string> not_ints = {"\"64\"", "true", "[64]", "{\"v\":64}", "64.5", "64.0", "\"NaN\"", "1e300",
                                             "-64", "0", "-1e300"};
  auto ints = [&](std::vector<std::string> more) {
    std::vector<std::string> v = not_ints;
    v.insert(v.end(), more.begin(), more.end());
    return v;
  };
  const std::vector<std::string> not_numbers = {"\"1e-5\"", "\"NaN\"", "\"inf\"", "false", "[1]", "{}", "-1e300"};
  auto numbers = [&](std::vector<std::string> more) {
    std::vector<std::string> v = not_numbers;
    v.insert(v.end(), more.begin(), more.end());
    return v;
  };
  return {
      {"hidden_size", "hidden", "a positive integer, at most 1048576", false, ints({"1048577"}), {"64"}},
      {"num_hidden_layers", "num_layers", "a positive integer, at most 4096", false, ints({"4097"}), {"1", "4096"}},
      {"num_attention_heads", "num_heads", "a positive integer, at most 4096", false, ints({"4097"}), {"4"}},
      {"num_key_value_heads", "num_kv_heads", "a positive integer, at most 4096", false, ints({"4097"}), {"1", "4"}},
      {"intermediate_size", "ffn_hidden", "a positive integer, at most 1048576", false, ints({"1048577"}),
       {"1", "1048576"}},
      {"vocab_size", "vocab_size", "a positive integer, at most 2147483647", false,
       ints({"2147483648", "18446744073709551615"}), {"1", "2147483647"}},
      {"max_position_embeddings", "max_seq_len", "a positive integer, at most 1048576", false,
       ints({"1048577", "9223372036854775807"}), {"1", "1048576"}},
      {"rms_norm_eps", "norm_eps", "a number in [1.17549435e-38, 1]", false,
       numbers({"0", "-1e-6", "5e-324", "1.0000001", "1e300"}), {"1.17549435e-38", "1", "1e-5"}},
      {"rope_theta", "rope_theta", "a finite number >= 1", false, numbers({"0.999", "0", "-10000"}),
       {"1", "1e300", "500000"}},
      {"rope_parameters.rope_theta", "rope_theta", "a finite number >= 1", false, numbers({"0.5"}), {"1", "1e300"}},
      {"tie_word_embeddings", "tied_embeddings", "true or false", false, {"1", "0", "\"true\"", "[true]"},
       {"true", "false"}},
      {"num_local_experts", "num_experts", "a positive integer, at most 4096", true, ints({"4097"}), {"2", "4096"}},
      {"num_experts_per_tok", "top_k", "a positive integer, at most 64", true, ints({"65"}), {"1", "2"}},
      {"router_aux_loss_coef", "router_aux_loss_coef", "a number in [0, 1000000]", true,
       numbers({"-0.001", "1000000.0001", "1e7", "1e300"}), {"0", "1000000", "0.02"}},
      {"router_jitter_noise", "router_jitter_noise", "a number in [0, 0.999]", true,
       numbers({"-0.01", "0.9991", "1", "1.5", "1e300"}), {"0", "0.999"}},
  };
}

// config.json with `key` (dotted: nested) set to the JSON text `value`.
std::string with_value(const MappedKey& k, const std::string& value) {
  nlohmann::json j = nlohmann::json::parse(hf_config_json(k.mixtral ? "mixtral" : "llama"));
  const std::string key = k.json;
  const size_t dot = key.find('.');
  nlohmann::json v = nlohmann::json::parse(value);
  if (dot == std::string::npos) j[key] = v;
  else j[key.substr(0, dot)] = {{"rope_type", "default"}, {key.substr(dot + 1), v}};
  // num_experts_per_tok must stay within num_local_experts (8 by default).
  return j.dump();
}

}  // namespace

TEST(HfConfig, EveryValueIsHeldToTheRangeOfTheModelKeyItSets) {
  int refused = 0, accepted = 0;
  for (const MappedKey& k : mapped_keys()) {
    for (const std::string& bad : k.bad) {
      SCOPED_TRACE(std::string(k.json) + " = " + bad);
      const std::string text = with_value(k, bad);
      const std::string shown = nlohmann::json::parse(bad).dump();
      expect_error([&] { parse_hf_llama_config(text, "/models/x/config.json"); },
                   {"/models/x/config.json", "\"" + std::string(k.json) + "\" is " + shown, k.range,
                    "model." + std::string(k.model_key)});
      ++refused;
    }
    for (const std::string& good : k.good) {
      SCOPED_TRACE(std::string(k.json) + " = " + good);
      EXPECT_NO_THROW(parse_hf_llama_config(with_value(k, good), "ok.json"));
      ++accepted;
    }
  }
  EXPECT_GT(refused, 120);
  EXPECT_GT(accepted, 25);
  // NaN and Infinity as Python's json module writes them (not JSON): refused
  // as not valid JSON, naming the key they stand for.
  for (const char* lit : {"NaN", "Infinity", "-Infinity"})
    for (const char* key : {"rope_theta", "rms_norm_eps", "router_aux_loss_coef"}) {
      SCOPED_TRACE(std::string(key) + " " + lit);
      std::string text = hf_config_json("mixtral", std::string("\"") + key + "\": " + lit);
      expect_error([&] { parse_hf_llama_config(text, "cfg.json"); },
                   {"cfg.json", "not valid JSON", std::string("\"") + key + "\" is NaN or Infinity", "finite"});
    }
}

// A run never trains with a value its own written config.toml would refuse:
// for config.json files drawn at random from every key's accepted edges, each
// one the reader and the config accept gives an effective config (what a run
// writes as config.toml) that parses again to the same model. Then `loom
// check` itself, on folders with weights, at the edges of the float keys.
TEST(HfConfig, AnyAcceptedConfigJsonRoundTripsThroughLoomCheck) {
  TmpDir tmp;
  std::mt19937 rng(30);
  const std::vector<MappedKey> keys = mapped_keys();
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const bool mixtral = trial % 2 == 1;
    nlohmann::json j = nlohmann::json::parse(hf_config_json(mixtral ? "mixtral" : "llama", "", {.hidden = 64}));
    for (const MappedKey& k : keys) {
      if (k.mixtral && !mixtral) continue;
      if (rng() % 2) continue;  // left out: the reader's default
      const std::string v = k.good[rng() % k.good.size()];
      const std::string key = k.json;
      if (key.find('.') != std::string::npos) {
        if (!j.contains("rope_theta")) j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", nlohmann::json::parse(v)}};
      } else if (key != "hidden_size" && key != "num_attention_heads") {  // kept: they must divide
        j[key] = nlohmann::json::parse(v);
      }
    }
    if (j.contains("rope_theta")) j.erase("rope_parameters");
    const fs::path dir = tmp.path / ("m" + std::to_string(trial));
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << j.dump();
    loom::Config c;
    try {
      c = loom::parse_config_string("[model]\ninit = \"hf:" + dir.string() + "\"\n[train]\nseq_len = 16\n", "rt.toml", {});
    } catch (const loom::Error&) {
      continue;  // refused as a whole (a model too large, heads that do not divide): nothing is trained
    }
    SCOPED_TRACE(j.dump());
    loom::Config again;
    ASSERT_NO_THROW(again = loom::parse_config_string(c.effective_toml, "config.toml", {})) << c.effective_toml;
    EXPECT_EQ(loom::ckpt::model_json(again.model.spec), loom::ckpt::model_json(c.model.spec));
    EXPECT_EQ(again.model.spec.max_seq_len, c.model.spec.max_seq_len);
    ++checked;
  }
  EXPECT_GT(checked, 100);

  // `loom check` on the config.toml a run would write, folders with weights.
  for (const std::string& extra :
       {std::string(R"("rms_norm_eps": 1.17549435e-38, "rope_theta": 1e300, "max_position_embeddings": 1048576)"),
        std::string(R"("num_local_experts": 4, "num_experts_per_tok": 4, "router_aux_loss_coef": 1000000,
                       "router_jitter_noise": 0.999, "rope_parameters": {"rope_type": "default", "rope_theta": 1})")}) {
    SCOPED_TRACE(extra);
    const bool moe = extra.find("experts") != std::string::npos;
    const fs::path dir = tmp.path / (moe ? "cli_moe" : "cli_llama");
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << hf_config_json(moe ? "mixtral" : "llama", extra, {.hidden = 32, .ffn = 48, .vocab = 50});
    const ModelSpec spec = read_hf_llama_config(dir.string());
    std::map<std::string, std::vector<float>> w;
    for (const UnitInfo& u : model_units(spec))
      for (const ParamInfo& p : u.params) w[p.name] = iota_f(static_cast<size_t>(p.numel), 0.02f);
    save_hf_llama(dir.string(), spec, [&](const std::string& n) { return w.at(n).data(); }, DType::f32);
    const std::string toml = "[run]\nout_dir = \"" + (tmp.path / "run").string() + "\"\ndevice = \"cpu\"\nplugin_path = [\"" +
                             LOOM_TEST_PLUGIN_DIR + "\"]\n[model]\ninit = \"hf:" + dir.string() +
                             "\"\n[train]\nsteps = 1\nmicro_batch = 1\nseq_len = 16\n[data]\nplugin = \"synthetic\"\n";
    const loom::Config c = loom::parse_config_string(toml, "run.toml", {});
    std::ofstream(tmp.path / "config.toml") << c.effective_toml;
    const std::string out = (tmp.path / "check.txt").string();
    const int rc = std::system(("'" + std::string(LOOM_CLI) + "' check '" + (tmp.path / "config.toml").string() + "' > '" +
                                out + "' 2>&1").c_str());
    std::ifstream f(out);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_EQ(rc, 0) << text;
  }
}
