// The trainer against HF transformers (tests/golden, made by make_golden.py
// with LlamaForCausalLM in fp32, eager attention), on every path:
//
//   cpu  fp32 + naive    logits/loss 1e-5, gradients 1e-4, AdamW losses 1e-5
//   cuda fp32 + naive    the same (cuBLASLt fp32 without TF32 is an fp32 GEMM)
//   cuda bf16 + cudnn    loss 1e-2, gradients 3e-2, AdamW losses 1e-2
//
// Tolerances are relative (‖a−b‖/‖b‖). fp32: both sides are fp32 with
// different summation orders, which leaves errors near 1e-6. bf16: inputs of
// every GEMM and attention are rounded to 8 bits of mantissa (2^-9 ≈ 2e-3
// relative per element), which accumulates through 3 layers to about 1e-2 on
// gradients. GPU cases skip where there is no GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <sstream>

#include "config/run_config.hpp"
#include "gpu_test_util.hpp"
#include "golden_grads.hpp"
#include "test_util.hpp"
#include "hf/safetensors.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;

namespace {

struct Path {
  const char* device;
  const char* precision;
  const char* attention;
  const char* layers;  // native, or fused (one QKV and one gate-up GEMM, residual in the epilogue, chunked head)
  double tol_logits, tol_grad, tol_adamw;
};

class Golden : public ::testing::TestWithParam<std::tuple<std::string, Path>> {};

TEST_P(Golden, MatchesHFTransformers) {
  const auto& [model, path] = GetParam();
  if (std::string(path.device) == "cuda") LOOM_REQUIRE_GPU();
  const fs::path dir = fs::path(LOOM_SOURCE_DIR) / "tests" / "golden" / model;
  loom::hf::SafeTensorsFile ref((dir / "reference.safetensors").string());
  const auto input_ids = ref.read_i64("input_ids");
  const auto targets = ref.read_i64("targets");
  const auto& shape = ref.info("input_ids").shape;
  ASSERT_EQ(shape.size(), 2u);
  const int64_t B = shape[0], S = shape[1];

  std::ostringstream cfg;
  cfg << "[run]\ndevice = \"" << path.device << "\"\nseed = 1\nthreads = 2\nout_dir = \"" << LOOM_BINARY_DIR
      << "/test_tmp/golden\"\n"
      << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
      << "[model]\ninit = \"hf:" << (dir / "hf").string() << "\"\nlayers = \"" << path.layers << "\"\n"
      // Fused: a head chunk that does not divide the batch's tokens, so the
      // chunked loss and gradient are checked across a ragged last chunk.
      << (std::string(path.layers) == "fused" ? "head_chunk = 7\n" : "")
      << "[train]\nsteps = 5\nmicro_batch = " << B << "\nseq_len = " << S << "\n"
      << "lr = 1e-3\nschedule = \"constant\"\nwarmup_steps = 0\ngrad_clip = 1.0\n"
      << "weight_decay = 0.1\nbeta1 = 0.9\nbeta2 = 0.95\neps = 1e-8\n"
      << "[checkpoint]\nresume = \"none\"\n"
      << "[precision]\nplugin = \"" << path.precision << "\"\n[attention]\nplugin = \"" << path.attention
      << "\"\n[sharding]\nplugin = \"none\"\n"
      << "[data]\nplugin = \"synthetic\"\n";
  loom::Session s(loom::parse_config_string(cfg.str(), "golden.toml", {}));
  s.initialise();
  std::vector<int32_t> in(input_ids.begin(), input_ids.end()), tg(targets.begin(), targets.end());
  loom::probe(s).load_batch(in.data(), tg.data());

  // Forward: logits and loss.
  loom::probe(s).forward(false, 0.f);
  const double loss = loom::probe(s).batch_loss();
  const std::vector<float> logits = loom::probe(s).logits();
  const std::vector<float> ref_logits = ref.read_f32("logits");
  ASSERT_EQ(logits.size(), ref_logits.size());
  const double e_logits = loom::test::rel_l2(logits, ref_logits);
  const double ref_loss = ref.read_f32("loss")[0];
  const double e_loss = std::abs(loss - ref_loss) / std::abs(ref_loss);
  EXPECT_LT(e_logits, path.tol_logits);
  EXPECT_LT(e_loss, path.tol_logits);

  // Backward: every parameter's gradient.
  const int64_t N = B * S;
  loom::probe(s).zero_grads();
  loom::probe(s).forward(true, 1.0f / static_cast<float>(N));
  loom::probe(s).backward();
  const auto [worst, worst_name, checked] =
      loom::test::compare_grads(loom::probe(s), ref, [&](const std::string&) { return path.tol_grad; });
  EXPECT_GE(checked, 3 * 9 + 2);

  // Five AdamW steps with clipping on the same batch.
  const std::vector<float> ref_losses = ref.read_f32("adamw_losses");
  const std::vector<float> ref_norms = ref.read_f32("adamw_grad_norms");
  double worst_step = 0, worst_norm = 0;
  for (int64_t i = 0; i < 5; ++i) {
    loom::probe(s).zero_grads();
    loom::probe(s).forward(true, 1.0f / static_cast<float>(N));
    loom::probe(s).backward();
    const double l = loom::probe(s).batch_loss();
    loom::StepResult r = loom::probe(s).optimizer_step(i);
    const double e = std::abs(l - ref_losses[static_cast<size_t>(i)]) / std::abs(ref_losses[static_cast<size_t>(i)]);
    const double en = std::abs(r.grad_norm - ref_norms[static_cast<size_t>(i)]) / ref_norms[static_cast<size_t>(i)];
    EXPECT_LT(e, path.tol_adamw) << "AdamW step " << i;
    EXPECT_LT(en, path.tol_grad) << "grad norm at step " << i;
    worst_step = std::max(worst_step, e);
    worst_norm = std::max(worst_norm, en);
  }
  std::printf("[golden %s %s %s+%s %s] logits %.2e  loss %.2e  worst grad %.2e (%s)  worst adamw loss %.2e  "
              "grad norm %.2e\n",
              model.c_str(), path.device, path.precision, path.attention, path.layers, e_logits, e_loss, worst,
              worst_name.c_str(), worst_step, worst_norm);
}

std::string name_of(const ::testing::TestParamInfo<Golden::ParamType>& info) {
  const auto& [model, p] = info.param;
  return model + "_" + p.device + "_" + p.precision + "_" + p.attention + "_" + p.layers;
}

INSTANTIATE_TEST_SUITE_P(HF, Golden,
                         ::testing::Combine(::testing::Values("mha", "gqa"),
                                            ::testing::Values(Path{"cpu", "fp32", "naive", "native", 1e-5, 1e-4, 1e-5},
                                                              Path{"cpu", "fp32", "naive", "fused", 1e-5, 1e-4, 1e-5},
                                                              Path{"cuda", "fp32", "naive", "native", 1e-5, 1e-4, 1e-5},
                                                              Path{"cuda", "fp32", "naive", "fused", 1e-5, 1e-4, 1e-5},
                                                              Path{"cuda", "bf16", "cudnn", "native", 1e-2, 3e-2, 1e-2},
                                                              Path{"cuda", "bf16", "cudnn", "fused", 1e-2, 3e-2, 1e-2})),
                         name_of);

// The whole Mixtral model against transformers' MixtralForCausalLM
// (tests/golden/mixtral, made by make_mixtral_model_golden.py: 4 experts,
// top-2, 2 layers, GQA 4/2, vocab 257, router_aux_loss_coef 0.02, fp32). The
// loss is HF's with output_router_logits: cross-entropy + 0.02 x the
// load-balancing loss over both layers' tokens; Loom's objective is the same
// sum (the LM loss from the head, the aux loss from the MoE blocks' shared
// statistics). Tolerance 1e-5 relative (‖a−b‖/‖b‖) on logits, both losses and
// every gradient: both sides are fp32 with different summation orders (Loom's
// router and routing sum in double, its GEMMs in fp32), which leaves ~1e-6;
// the routing itself is identical (the closest top-k choice is 8e-5 away from
// a tie, far above the 1e-7 differences of the probabilities), so nothing
// larger can appear unless the computation differs.
//
// On CUDA: fp32 + naive with the same 1e-5 on logits and losses (cuBLASLt fp32
// without TF32 and the router GEMM in fp32 are fp32 arithmetic; the routing is
// then the same) and 1e-4 on gradients, the dense CUDA fp32 path's bound. bf16
// + cuDNN: every GEMM input and the router's input and weights are rounded to
// bf16 (2^-9 relative), which moves the router logits by ~1e-2 and the
// probabilities by ~1e-3 — above the golden's smallest top-k margin (8e-5), so
// a few of the 68 (token, layer) choices may go to the other expert. Bounds:
// logits 5e-2 and losses 2e-2 (the dense bf16 golden's 1e-2 plus the flipped
// tokens: each moves one of 34 tokens' expert mix), aux loss 3e-2 (a flip moves
// one of 68 selections: E (P_a − P_b) / R ≈ 3e-3 relative each), gradients
// outside the experts 5e-2; an expert's gradient 0.5 (one flipped row of the
// ~10 an expert gets per layer changes its gradient by up to ~sqrt(2/10));
// a wrong expert, layout or transpose gives errors near or above 1.
struct MoePath {
  const char* device;
  const char* precision;
  const char* attention;
  double tol_logits, tol_loss, tol_aux, tol_grad, tol_expert_grad;
};

class MixtralGolden : public ::testing::TestWithParam<std::tuple<std::string, std::string, MoePath>> {};

TEST_P(MixtralGolden, MatchesHFTransformers) {
  const auto& [layers, recompute, path] = GetParam();
  if (std::string(path.device) == "cuda") LOOM_REQUIRE_GPU();
  const fs::path dir = fs::path(LOOM_SOURCE_DIR) / "tests" / "golden" / "mixtral";
  loom::hf::SafeTensorsFile ref((dir / "reference.safetensors").string());
  const auto input_ids = ref.read_i64("input_ids");
  const auto targets = ref.read_i64("targets");
  const auto& shape = ref.info("input_ids").shape;
  ASSERT_EQ(shape.size(), 2u);
  const int64_t B = shape[0], S = shape[1], N = B * S;
  std::ostringstream cfg;
  cfg << "[run]\ndevice = \"" << path.device << "\"\nseed = 1\nthreads = 2\nout_dir = \"" << LOOM_BINARY_DIR
      << "/test_tmp/golden_mixtral\"\nplugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
      << "[model]\ninit = \"hf:" << (dir / "hf").string() << "\"\nlayers = \"" << layers << "\"\nrecompute = \""
      << recompute << "\"\n" << (layers == "fused" ? "head_chunk = 7\n" : "")
      << "[train]\nsteps = 1\nmicro_batch = " << B << "\nseq_len = " << S << "\n"
      << "[checkpoint]\nresume = \"none\"\n[precision]\nplugin = \"" << path.precision
      << "\"\n[attention]\nplugin = \"" << path.attention << "\"\n"
      << "[sharding]\nplugin = \"none\"\n[data]\nplugin = \"synthetic\"\n";
  loom::Session s(loom::parse_config_string(cfg.str(), "golden_mixtral.toml", {}));
  s.initialise();
  ASSERT_TRUE(loom::probe(s).model().spec().moe());
  EXPECT_EQ(loom::probe(s).model().spec().num_experts, 4);
  EXPECT_EQ(loom::probe(s).model().spec().top_k, 2);
  EXPECT_DOUBLE_EQ(loom::probe(s).model().spec().router_aux_loss_coef, 0.02);
  std::vector<int32_t> in(input_ids.begin(), input_ids.end()), tg(targets.begin(), targets.end());
  loom::probe(s).load_batch(in.data(), tg.data());

  loom::probe(s).forward(false, 0.f);
  const std::vector<float> ref_logits = ref.read_f32("logits");
  const std::vector<float> logits = loom::probe(s).logits();
  ASSERT_EQ(logits.size(), ref_logits.size());
  const double e_logits = loom::test::rel_l2(logits, ref_logits);
  EXPECT_LT(e_logits, path.tol_logits);

  loom::probe(s).zero_grads();
  loom::probe(s).forward(true, 1.0f / static_cast<float>(N));
  loom::probe(s).backward();
  const double lm = loom::probe(s).batch_loss(), aux = loom::probe(s).batch_aux_loss();
  const double ref_lm = ref.read_f32("lm_loss")[0], ref_aux = ref.read_f32("aux_loss")[0],
               ref_loss = ref.read_f32("loss")[0];
  const double e_lm = std::abs(lm - ref_lm) / ref_lm, e_aux = std::abs(aux - ref_aux) / ref_aux;
  const double e_loss = std::abs(lm + 0.02 * aux - ref_loss) / ref_loss;
  EXPECT_LT(e_lm, path.tol_loss);
  EXPECT_LT(e_aux, path.tol_aux);
  EXPECT_LT(e_loss, path.tol_loss);

  const auto [worst, worst_name, checked] = loom::test::compare_grads(loom::probe(s), ref, [&](const std::string& p) {
    return p.find(".experts.") != std::string::npos ? path.tol_expert_grad : path.tol_grad;
  });
  // embedding, final norm, head; per layer 2 norms, q/k/v/o, the router and 4 x 3 expert matrices.
  EXPECT_EQ(checked, 3 + 2 * (2 + 4 + 1 + 12));
  std::printf("[golden mixtral %s %s+%s %s recompute=%s] logits %.2e  lm loss %.2e  aux %.2e  loss %.2e  worst grad "
              "%.2e (%s)\n",
              path.device, path.precision, path.attention, layers.c_str(), recompute.c_str(), e_logits, e_lm, e_aux,
              e_loss, worst, worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    HF, MixtralGolden,
    ::testing::Combine(::testing::Values("native", "fused"), ::testing::Values("none", "full"),
                       ::testing::Values(MoePath{"cpu", "fp32", "naive", 1e-5, 1e-5, 1e-5, 1e-5, 1e-5},
                                         MoePath{"cuda", "fp32", "naive", 1e-5, 1e-5, 1e-5, 1e-4, 1e-4},
                                         MoePath{"cuda", "bf16", "cudnn", 5e-2, 2e-2, 3e-2, 5e-2, 0.5})),
    [](const auto& info) {
      const MoePath& p = std::get<2>(info.param);
      return std::string(p.device) + "_" + p.precision + "_" + std::get<0>(info.param) + "_recompute_" +
             std::get<1>(info.param);
    });

}  // namespace
