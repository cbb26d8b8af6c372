// Packed documents (train.reset_attention_mask, reset_position_ids,
// eod_mask_loss; docs/CONFIG.md): documents packed into one sequence with
// all three switches on give the per-token losses and parameter gradients of
// the same documents run as separate sequences from position 0 — on the CPU
// in fp32 (both layer variants), with an FP8 recipe, with MoE, on CUDA with
// the naive plugin in fp32 and with cuDNN in bf16 — and the edge cases:
// documents of one token, a document ending exactly at a row's end, a row
// that is one document, a row of 1000 one-token documents; and against HF
// transformers' packed golden (tests/golden/docmask, below). Also: the host
// derives the spans and the loss mask from the starts as promised
// (loom/attention.hpp's DocumentSpans), and a run whose data or attention
// plugin cannot honour the switches is refused at start-up, saying why.
//
// Tolerances. The reference runs the documents as rows of one batch, padded
// to the longest with tokens that carry no loss; the packed run has the same
// tokens in one row. Every per-token computation is the same function of the
// same inputs (attention over the same keys, RoPE at the same positions), but
// the CPU GEMMs (OpenBLAS) may sum in another order for another row count,
// and the weight gradients sum the tokens in another order: fp32 rounding,
// ~1e-7 relative per operation over a few layers. 1e-5 of the largest
// magnitude of each compared tensor bounds that with room and is far below
// any masking error (a token seeing one key of another document moves its
// loss by ~1e-2). Cases whose documents have equal lengths need no padding:
// both runs hold the same [N, h] matrices row for row, which is what the FP8
// (per-tensor amax) and MoE (load-balancing statistics over all tokens) cases
// use, so their scales and routing are the same too. On CUDA bf16 + cuDNN the
// tolerance is the bf16 golden's (tests/test_golden.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "golden_grads.hpp"
#include "gpu_test_util.hpp"
#include "hf/safetensors.hpp"
#include "loom/error.hpp"
#include "loom/ops/backend.hpp"
#include "test_util.hpp"
#include "train/session_probe.hpp"
#include "train/token_stager.hpp"

namespace {

using loom::Session;

struct Path {
  std::string device = "cpu", precision = "fp32", attention = "naive", layers = "native";
  bool moe = false;
};

// A small model; `docs`: all three switches on.
std::string config_text(const Path& r, int64_t B, int64_t S, bool docs, bool eod = true) {
  std::ostringstream c;
  c << "[run]\ndevice = \"" << r.device << "\"\nseed = 7\nthreads = 2\nlog_level = \"warn\"\nout_dir = \""
    << LOOM_BINARY_DIR << "/test_tmp/docmask\"\nplugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nlayers = \"" << r.layers << "\"\nhidden = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\n"
    << "ffn_hidden = 96\nvocab_size = 80\nmax_seq_len = 1024\n"
    << (r.moe ? "ffn = \"moe\"\nnum_experts = 4\ntop_k = 2\n" : "")
    << "[train]\nsteps = 1\nmicro_batch = " << B << "\nseq_len = " << S << "\n"
    << (docs ? "reset_attention_mask = true\nreset_position_ids = true\n" : "")
    << (docs && eod ? "eod_mask_loss = true\n" : "")
    << "[checkpoint]\nresume = \"none\"\n"
    << "[precision]\nplugin = \"" << r.precision << "\"\n[attention]\nplugin = \"" << r.attention
    << "\"\n[sharding]\nplugin = \"none\"\n[data]\nplugin = \"synthetic\"\ndocument_length = 50\n";
  return c.str();
}

std::unique_ptr<Session> session(const Path& r, int64_t B, int64_t S, bool docs, bool eod = true) {
  auto s = std::make_unique<Session>(loom::parse_config_string(config_text(r, B, S, docs, eod), "docmask.toml", {}));
  s->initialise();
  return s;
}

// Every parameter (HF name) of a session's model.
std::vector<std::string> param_names(Session& s) {
  std::vector<std::string> out;
  for (const loom::UnitInfo& u : loom::probe(s).model().units())
    for (const loom::ParamInfo& p : u.params) out.push_back(p.name);
  return out;
}

// Copies every parameter of `from` into `to` (the same model, other batch shapes).
void copy_params(Session& from, Session& to) {
  for (const std::string& n : param_names(from)) {
    const std::vector<float> v = loom::probe(from).read_param(n);
    loom::probe(to).write_param(n, v.data());
  }
}

// max |a - b| / max(max |b|, tiny): the error relative to the tensor's scale.
double scaled_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

// One training forward and backward of a staged batch: the loss is the mean
// over `loss_count` tokens (0: the session's own weighting). Either way the
// scale is 1 / N and the model's loss weight N / count, as the session sets it
// under eod_mask_loss: the MoE load-balancing loss is scaled by the scale
// times N, not by the loss weight, so a reference run that put 1 / count in
// the scale instead would weight it N / count times more.
struct Result {
  std::vector<float> losses;                // per token, [N]
  std::vector<std::vector<float>> grads;    // per parameter, param_names order
};
Result train_once(Session& s, int64_t N, int64_t loss_count = 0) {
  if (loss_count > 0) loom::probe(s).model().set_loss_weight(static_cast<float>(static_cast<double>(N) / loss_count));
  loom::probe(s).zero_grads();
  loom::probe(s).forward(true, 1.0f / static_cast<float>(N));
  loom::probe(s).backward();
  Result r;
  r.losses = loom::probe(s).read_tensor(loom::probe(s).model().losses());
  for (const std::string& n : param_names(s)) r.grads.push_back(loom::probe(s).read_param(n, true));
  return r;
}

// Documents of the given lengths, random tokens < vocab; each followed (in
// the packing) by the next, and the last by one more document's first token.
std::vector<std::vector<int32_t>> make_documents(const std::vector<int64_t>& lengths, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, 79);
  std::vector<std::vector<int32_t>> docs;
  for (int64_t n : lengths) {
    docs.emplace_back();
    for (int64_t i = 0; i < n; ++i) docs.back().push_back(tok(rng));
  }
  return docs;
}

// The documents packed into rows of S tokens (their total must be rows * S),
// in order, with the starts DocumentStarts would give; the token after the
// last is `next`, the first token of a following document.
struct Packed {
  std::vector<int32_t> inputs, targets;
  std::vector<uint8_t> starts;
};
Packed pack(const std::vector<std::vector<int32_t>>& docs, int64_t rows, int64_t S, int32_t next) {
  std::vector<int32_t> stream;
  std::vector<uint8_t> begins;
  for (const auto& d : docs)
    for (size_t i = 0; i < d.size(); ++i) stream.push_back(d[i]), begins.push_back(i == 0);
  EXPECT_EQ(static_cast<int64_t>(stream.size()), rows * S);
  stream.push_back(next);
  begins.push_back(1);
  Packed p;
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 0; i < S; ++i) {
      p.inputs.push_back(stream[static_cast<size_t>(b * S + i)]);
      p.targets.push_back(stream[static_cast<size_t>(b * S + i + 1)]);
    }
    for (int64_t i = 0; i <= S; ++i) p.starts.push_back(begins[static_cast<size_t>(b * S + i)]);
  }
  return p;
}

// Packs `lengths` into `rows` rows of S, runs it with the switches on, and
// runs each document alone in a row of its own (padded to the longest, no
// loss after its last token, no switches); the per-token losses of every
// document and every gradient must agree within `tol` (see the top).
void expect_packed_equals_separate(const Path& run, const std::vector<int64_t>& lengths, int64_t rows, int64_t S,
                                   double tol) {
  const auto docs = make_documents(lengths, 11);
  const Packed p = pack(docs, rows, S, 3);
  const int64_t D = static_cast<int64_t>(docs.size());
  const int64_t L = *std::max_element(lengths.begin(), lengths.end());
  // cuDNN's SDPA has no graph for sequences of one token (s_q = s_kv = 1):
  // separate one-token documents are the naive plugin's, at the same precision.
  Path ref_run = run;
  if (run.attention == "cudnn" && L < 2) ref_run.attention = "naive";
  auto ref = session(ref_run, D, L, false);
  auto packed = session(run, rows, S, true);
  copy_params(*ref, *packed);
  // Reference: document d in row d, tokens after it padding (token 0) with no loss.
  std::vector<int32_t> in(static_cast<size_t>(D * L), 0), tg(static_cast<size_t>(D * L), -1);
  int64_t counted = 0;
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = 0; i < lengths[static_cast<size_t>(d)]; ++i) {
      in[static_cast<size_t>(d * L + i)] = docs[static_cast<size_t>(d)][static_cast<size_t>(i)];
      if (i + 1 < lengths[static_cast<size_t>(d)]) {  // the last token's target is another document's
        tg[static_cast<size_t>(d * L + i)] = docs[static_cast<size_t>(d)][static_cast<size_t>(i + 1)];
        ++counted;
      }
    }
  loom::probe(*ref).load_batch(in.data(), tg.data());
  const Result want = train_once(*ref, D * L, counted);
  loom::probe(*packed).load_batch(p.inputs.data(), p.targets.data(), p.starts.data());
  const Result got = train_once(*packed, rows * S);
  // Per-token losses: packed token of document d, position i <-> reference (d, i).
  std::vector<float> a, b;
  int64_t at = 0;
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = 0; i < lengths[static_cast<size_t>(d)]; ++i, ++at) {
      a.push_back(got.losses[static_cast<size_t>(at)]);
      b.push_back(want.losses[static_cast<size_t>(d * L + i)]);
    }
  const double el = scaled_err(a, b);
  EXPECT_LT(el, tol) << "per-token losses";
  double worst = 0;
  const std::vector<std::string> names = param_names(*ref);
  for (size_t k = 0; k < names.size(); ++k) {
    const double e = scaled_err(got.grads[k], want.grads[k]);
    EXPECT_LT(e, tol) << names[k];
    worst = std::max(worst, e);
  }
  // A masked-out comparison would pass trivially: the losses are not all zero
  // (unless every document is one token: then no target is its own document's
  // and the case checks that nothing leaks, with every loss and gradient 0).
  if (L > 1) EXPECT_GT(*std::max_element(b.begin(), b.end()), 1.0f);
  std::printf("[docmask %s %s %s %s%s] %zu documents in %lld x %lld: losses %.2e, worst gradient %.2e\n",
              run.device.c_str(), run.precision.c_str(), run.attention.c_str(), run.layers.c_str(),
              run.moe ? " moe" : "", docs.size(), static_cast<long long>(rows), static_cast<long long>(S), el, worst);
}

}  // namespace

// The staged spans and loss mask are what loom/attention.hpp promises, for
// random starts (a row's first token always begins a span; a flag on the
// token after the row masks the row's last target).
TEST(DocMaskStaging, DerivesSpansPositionsAndLossMask) {
  auto be = loom::make_cpu_backend(1, true);
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t B = 1 + trial % 3, S = 1 + static_cast<int64_t>(rng() % 40), N = B * S;
    loom::TokenStager st(*be, B, S, 2, {true, true});
    std::vector<int32_t> in(static_cast<size_t>(N)), tg(static_cast<size_t>(N));
    std::iota(in.begin(), in.end(), 0);
    std::iota(tg.begin(), tg.end(), 1000);
    std::vector<uint8_t> starts(static_cast<size_t>(B * (S + 1)));
    const int density = 1 + static_cast<int>(rng() % 4);  // from few to many documents
    for (auto& f : starts) f = rng() % 5 < static_cast<unsigned>(density) ? 1 : 0;
    std::vector<int32_t> buf(static_cast<size_t>(5 * N + 1), -7);
    loom::Tensor dst(buf.data(), loom::DType::i32, loom::Device::cpu, {5 * N + 1});
    const loom::StagedBatch r = st.stage(in.data(), tg.data(), dst, starts.data());
    // The reference, straight from the definition.
    std::vector<int32_t> cu, lengths, positions;
    int64_t masked = 0, longest = 0;
    for (int64_t b = 0; b < B; ++b) {
      int64_t start = 0;
      for (int64_t p = 0; p < S; ++p) {
        if (p == 0 || starts[static_cast<size_t>(b * (S + 1) + p)]) {
          if (p > 0) lengths.push_back(static_cast<int32_t>(p - start));
          start = p;
          cu.push_back(static_cast<int32_t>(b * S + p));
        }
        positions.push_back(static_cast<int32_t>(p - start));
        const bool mask = starts[static_cast<size_t>(b * (S + 1) + p + 1)] != 0;
        EXPECT_EQ(buf[static_cast<size_t>(N + b * S + p)], mask ? -1 : tg[static_cast<size_t>(b * S + p)]);
        masked += mask;
      }
      lengths.push_back(static_cast<int32_t>(S - start));
    }
    for (int32_t l : lengths) longest = std::max<int64_t>(longest, l);
    ASSERT_EQ(r.spans, static_cast<int64_t>(cu.size()));
    EXPECT_EQ(r.longest, longest);
    EXPECT_EQ(r.loss_tokens, N - masked);
    for (int64_t i = 0; i < N; ++i) {
      EXPECT_EQ(buf[static_cast<size_t>(i)], in[static_cast<size_t>(i)]);
      EXPECT_EQ(buf[static_cast<size_t>(2 * N + i)], positions[static_cast<size_t>(i)]) << "token " << i;
    }
    for (int64_t k = 0; k <= N; ++k)
      EXPECT_EQ(buf[static_cast<size_t>(3 * N + k)], k < r.spans ? cu[static_cast<size_t>(k)] : N) << "cu " << k;
    for (int64_t k = 0; k < N; ++k)
      EXPECT_EQ(buf[static_cast<size_t>(4 * N + 1 + k)], k < r.spans ? lengths[static_cast<size_t>(k)] : 0)
          << "length " << k;
  }
}

class DocMaskCpu : public ::testing::TestWithParam<std::string> {};

// Documents of several lengths, one of them a single token, packed into one row.
TEST_P(DocMaskCpu, PackedDocumentsEqualSeparateSequences) {
  Path run;
  run.layers = GetParam();
  expect_packed_equals_separate(run, {7, 13, 1, 5, 1, 9}, 1, 36, 1e-5);
}

// A document ending exactly at the end of row 0, and row 1 that is one
// document (continuing into the next row: its last target is masked).
TEST_P(DocMaskCpu, RowEdges) {
  Path run;
  run.layers = GetParam();
  expect_packed_equals_separate(run, {5, 11, 16}, 2, 16, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Layers, DocMaskCpu, ::testing::Values("native", "fused"));

// An FP8 recipe (fp8_current, emulated on the CPU) and a mixture of experts,
// on documents of equal lengths (the same token matrix in both runs: the
// same per-tensor amaxes, the same routing statistics).
TEST(DocMaskCpuRecipes, Fp8RecipeAndMoe) {
  Path fp8;
  fp8.precision = "fp8_current";
  expect_packed_equals_separate(fp8, {12, 12, 12}, 1, 36, 1e-5);
  Path moe;
  moe.moe = true;
  expect_packed_equals_separate(moe, {12, 12, 12}, 1, 36, 1e-5);
  moe.layers = "fused";
  expect_packed_equals_separate(moe, {12, 12, 12}, 1, 36, 1e-5);
}

// A row of 1000 one-token documents: each token sees itself only, at position
// 0, so its loss is that of a sequence of one token (without the loss mask,
// which would mask every target of this row: then the loss and every gradient
// are 0, and finite).
TEST(DocMaskCpuEdges, ThousandOneTokenDocuments) {
  const int64_t S = 1000;
  Path run;
  const auto docs = make_documents(std::vector<int64_t>(S, 1), 5);
  const Packed p = pack(docs, 1, S, 9);
  auto ref = session(run, S, 1, false);
  auto packed = session(run, 1, S, true, /*eod=*/false);
  copy_params(*ref, *packed);
  loom::probe(*ref).load_batch(p.inputs.data(), p.targets.data());
  const Result want = train_once(*ref, S);
  loom::probe(*packed).load_batch(p.inputs.data(), p.targets.data(), p.starts.data());
  const Result got = train_once(*packed, S);
  EXPECT_LT(scaled_err(got.losses, want.losses), 1e-5);
  for (size_t k = 0; k < want.grads.size(); ++k) EXPECT_LT(scaled_err(got.grads[k], want.grads[k]), 1e-5);

  auto masked = session(run, 1, S, true, /*eod=*/true);
  copy_params(*ref, *masked);
  loom::probe(*masked).load_batch(p.inputs.data(), p.targets.data(), p.starts.data());
  const Result none = train_once(*masked, S);
  EXPECT_EQ(loom::probe(*masked).batch_loss(), 0.0);
  for (const auto& g : none.grads)
    for (float v : g) ASSERT_EQ(v, 0.0f);
}

// A run whose data cannot tell its documents, or whose attention plugin
// cannot mask them, is refused before any work, saying which key and why.
TEST(DocMaskConfig, RefusalsNameTheKeyAndTheReason) {
  Path run;
  std::string text = config_text(run, 1, 16, true);
  text.replace(text.find("document_length = 50\n"), 21, "");
  loom::test::expect_error([&] { Session s(loom::parse_config_string(text, "docmask.toml", {})); },
                           {"train.reset_attention_mask = true", "train.eod_mask_loss = true",
                            "data.plugin = \"synthetic\"", "data.document_length"});
  // The switches are off by default: the same config without them runs.
  std::string plain = config_text(run, 1, 16, false);
  plain.replace(plain.find("document_length = 50\n"), 21, "");
  EXPECT_NO_THROW(Session s(loom::parse_config_string(plain, "docmask.toml", {})));
  loom::test::expect_error(
      [&] { loom::parse_config_string(config_text(run, 1, 16, false) + "", "x.toml", {"train.eod_mask_loss=1"}); },
      {"train.eod_mask_loss"});
}

// CUDA: the naive plugin in fp32 within the CPU's 1e-5; cuDNN in bf16 within
// the bf16 golden tolerance (tests/test_golden.cpp: 3e-2 on gradients).
TEST(DocMaskGpu, NaiveFp32PackedEqualsSeparate) {
  LOOM_REQUIRE_GPU();
  for (const char* layers : {"native", "fused"}) {
    Path run;
    run.device = "cuda";
    run.layers = layers;
    expect_packed_equals_separate(run, {7, 13, 1, 5, 1, 9}, 1, 36, 1e-5);
    expect_packed_equals_separate(run, {5, 11, 16}, 2, 16, 1e-5);
  }
}

TEST(DocMaskGpu, CudnnBf16PackedEqualsSeparate) {
  LOOM_REQUIRE_GPU();
  for (const char* layers : {"native", "fused"}) {
    Path run;
    run.device = "cuda";
    run.precision = "bf16";
    run.attention = "cudnn";
    run.layers = layers;
    // cuDNN's head_dim must be a multiple of 8: 64 / 4 heads = 16.
    expect_packed_equals_separate(run, {7, 13, 1, 5, 1, 9}, 1, 36, 3e-2);
    expect_packed_equals_separate(run, {12, 12, 12}, 1, 36, 3e-2);
    expect_packed_equals_separate(run, std::vector<int64_t>(64, 1), 1, 64, 3e-2);
  }
}

// HF transformers on the same packed documents (tests/golden/docmask, made by
// make_docmask_golden.py from the "gqa" golden model: each document span fed
// alone from position 0, checked there against the packed rows with
// position_ids and a 4-D block-diagonal causal mask). Two rows of 33 tokens:
// documents of 1 token, one ending exactly at a row's end (its last target
// masked), one continuing from an earlier row and one running on into the
// next (its last target kept). Loom stages the rows with their starts and all
// three switches on: the logits, per-token losses, the loss (the mean over the
// targets that carry loss) and every gradient must match. Tolerances are
// test_golden.cpp's for the same model, as ‖a−b‖/‖b‖: fp32 on the CPU and on
// CUDA with the naive plugin 1e-5 (logits, losses) and 1e-4 (gradients), both
// sides fp32 with other summation orders; bf16 + cuDNN (ragged) 1e-2 and 3e-2,
// bf16's rounding of every GEMM and attention input through 3 layers. A
// document seeing one key of another, a position not restarted or a masked
// target counted each moves the loss by ~1e-2 relative, the logits more.
namespace {

using loom::test::rel_l2;

struct GoldenPath {
  const char* device;
  const char* precision;
  const char* attention;
  const char* layers;
  double tol_logits, tol_grad;
};

void expect_matches_hf_golden(const GoldenPath& p) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(LOOM_SOURCE_DIR) / "tests" / "golden";
  loom::hf::SafeTensorsFile ref((dir / "docmask" / "reference.safetensors").string());
  const auto& shape = ref.info("input_ids").shape;
  ASSERT_EQ(shape.size(), 2u);
  const int64_t B = shape[0], S = shape[1], N = B * S;
  auto ints = [&](const char* name) {
    const std::vector<int64_t> v = ref.read_i64(name);
    return std::vector<int32_t>(v.begin(), v.end());
  };
  const std::vector<int32_t> in = ints("input_ids"), tg = ints("targets"), st = ints("starts");
  ASSERT_EQ(static_cast<int64_t>(st.size()), B * (S + 1));
  const std::vector<uint8_t> starts(st.begin(), st.end());

  std::ostringstream c;
  c << "[run]\ndevice = \"" << p.device << "\"\nseed = 1\nthreads = 2\nlog_level = \"warn\"\nout_dir = \""
    << LOOM_BINARY_DIR << "/test_tmp/docmask_golden\"\nplugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\ninit = \"hf:" << (dir / "gqa" / "hf").string() << "\"\nlayers = \"" << p.layers << "\"\n"
    << (std::string(p.layers) == "fused" ? "head_chunk = 7\n" : "")
    << "[train]\nsteps = 1\nmicro_batch = " << B << "\nseq_len = " << S << "\n"
    << "reset_attention_mask = true\nreset_position_ids = true\neod_mask_loss = true\n"
    << "[checkpoint]\nresume = \"none\"\n[precision]\nplugin = \"" << p.precision << "\"\n[attention]\nplugin = \""
    << p.attention << "\"\n[sharding]\nplugin = \"none\"\n"
    // The rows come from the golden file; the source only has to be one that tells documents.
    << "[data]\nplugin = \"synthetic\"\ndocument_length = 8\n";
  Session s(loom::parse_config_string(c.str(), "docmask_golden.toml", {}));
  s.initialise();
  loom::probe(s).load_batch(in.data(), tg.data(), starts.data());

  loom::probe(s).forward(false, 0.f);
  const double e_logits = rel_l2(loom::probe(s).logits(), ref.read_f32("logits"));
  const double e_tokens = rel_l2(loom::probe(s).read_tensor(loom::probe(s).model().losses()), ref.read_f32("token_losses"));
  const double ref_loss = ref.read_f32("loss")[0];
  const double e_loss = std::abs(loom::probe(s).batch_loss() - ref_loss) / ref_loss;
  EXPECT_LT(e_logits, p.tol_logits);
  EXPECT_LT(e_tokens, p.tol_logits);
  EXPECT_LT(e_loss, p.tol_logits);

  // The gradient of the mean over the targets that carry loss: the session's
  // own weighting (1 / N here, N / count in the model under eod_mask_loss).
  loom::probe(s).zero_grads();
  loom::probe(s).forward(true, 1.0f / static_cast<float>(N));
  loom::probe(s).backward();
  const auto [worst, worst_name, checked] =
      loom::test::compare_grads(loom::probe(s), ref, [&](const std::string&) { return p.tol_grad; });
  EXPECT_EQ(checked, 3 * 9 + 3);  // 3 layers of 9 tensors, the embedding, the final norm, the untied head
  std::printf("[docmask golden %s %s+%s %s] logits %.2e  token losses %.2e  loss %.2e  worst grad %.2e (%s)\n",
              p.device, p.precision, p.attention, p.layers, e_logits, e_tokens, e_loss, worst, worst_name.c_str());
}

}  // namespace

TEST(DocMaskGolden, CpuMatchesHfTransformers) {
  for (const char* layers : {"native", "fused"}) expect_matches_hf_golden({"cpu", "fp32", "naive", layers, 1e-5, 1e-4});
}

TEST(DocMaskGpu, GoldenMatchesHfTransformers) {
  LOOM_REQUIRE_GPU();
  for (const char* layers : {"native", "fused"}) {
    expect_matches_hf_golden({"cuda", "fp32", "naive", layers, 1e-5, 1e-4});
    expect_matches_hf_golden({"cuda", "bf16", "cudnn", layers, 1e-2, 3e-2});
  }
}
