// The cudnn attention plugin: causal GQA attention through cuDNN's fused SDPA
// (flash-style: the S x S scores are never written out), forward and backward,
// built with the cudnn-frontend graph API.
//
// - bf16 or fp16 q/k/v/out and gradients; softmax and accumulation in fp32.
// - Q/O/dO/dQ are {B, H, S, D} and K/V/dK/dV {B, Hkv, S, D} cuDNN tensors whose
//   strides are the BSHD tensors' own, so views into a fused QKV buffer are read
//   in place, and GQA needs no copy of K/V per query head.
// - Forward always writes the fp32 log-sum-exp stats ({B, H, S, 1} in cuDNN,
//   our contiguous [B, H, S]); backward consumes them.
// - Building a graph (heuristics, engine compilation) is the slow part, so each
//   graph is built once per (shape, strides, dtype, direction, determinism) and
//   cached; workspace_bytes(), called at start-up, builds the graphs a shape
//   needs (packed tensors and the fused-QKV layout, see fused_key) and reports
//   the largest workspace among them.
// - forward/backward run a few hundred times a step, so after the first call of
//   a graph they allocate nothing, format nothing and take no lock: the graph key
//   is a fixed-size array compared with the last graph each direction used, and
//   each cached graph owns its variant pack, whose pointer values are overwritten
//   in place (Graph::execute only looks the uids up). Whatever cuDNN itself does
//   inside execute is cuDNN's (the backend creates a variant-pack descriptor per
//   call); tests/test_cuda_attention.cpp counts the two apart.
//
// - Document masking (AttentionShape::documents): the micro-batch's document
//   spans become the sequences of a ragged (THD) SDPA — per-sequence lengths,
//   a padding mask and ragged offsets into the same BSHD buffers, causal
//   within each sequence — so the masked blocks between documents cost no
//   FLOPs. A graph's sequence count is fixed, so the spans' count is rounded
//   up to a bucket, B x 2^k up to B x S (the spans beyond `count` are empty,
//   length 0, and cost a few CTAs that exit at once); every graph's longest
//   sequence is S (the kernels stop at each sequence's own length). The host
//   knows the count when the micro-batch is staged, so picking the graph
//   needs no device read. workspace_bytes(), at start-up, builds the graphs
//   of every bucket (log2(S) + 1 of them per direction and layout) and sizes
//   the workspace for the largest; a call never builds one (a step neither
//   waits for the host nor allocates), and one whose graph was not built is
//   refused, naming it. Each graph's workspace is bounded by the tokens of
//   the micro-batch, not by buckets x S (max_total_seq_len). The ragged
//   offsets (elements, per tensor: a span's first token times the tensor's
//   token stride) are computed on the stream from the spans' cu_seqlens by a
//   small kernel (cudnn_offsets.cu) into the front of the workspace, once per
//   staged micro-batch (DocumentSpans::serial) and layout. The stats are laid
//   out [tokens, H] in the [B, H, S] buffer in this mode.
//
// - attention.sdpa_forward picks cuDNN's forward implementation: "auto"
//   (cudnn-frontend's choice: its unified SDPA operation where the cuDNN
//   library supports the graph, else the composite graph), "composite" or
//   "unified". The backward has one implementation. docs/PERFORMANCE.md
//   ("Attention beside PyTorch's") has what each costs.
//
// Threads: one. The core drives a plugin object from its step thread. The
// caches and variant packs are unguarded and the cuDNN handle's stream is set
// per call, so two threads calling one object at the same time are not
// supported (the mutex this replaced did not make that safe either: a stream
// set by one thread could be used by another's execute).
//
// The whole plugin is one translation unit: the frontend headers take long to
// compile, and nothing else needs them.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cudnn_frontend.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "attention/cudnn/cudnn_offsets.hpp"
#include "loom/attention.hpp"
#include "loom/error.hpp"

namespace {
// Graphs built (cuDNN asked, whether it accepted or refused) by every
// CudnnAttention object of this library.
std::atomic<int64_t> g_graphs_built{0};
}  // namespace

// Exported so that tests can prove that workspace_bytes() built every graph a
// step uses (the fused-QKV layout included) and that calls build no more (dlsym
// on the loaded plugin).
extern "C" __attribute__((visibility("default"))) int64_t loom_attention_cudnn_graphs_built() {
  return g_graphs_built.load();
}

namespace loom::cudnn_attn {
namespace {

namespace fe = cudnn_frontend;

constexpr const char* kUseNaive = "; use attention.plugin = \"naive\" instead";
constexpr int64_t kMaxHeadDim = 256;  // cuDNN SDPA's limit for bf16/fp16 (9.x, Hopper)

// Tensor uids of the variant pack; fixed, so execution maps pointers without
// keeping the frontend's tensor objects around. The last seven are the
// ragged graphs' (document masking): per-sequence lengths and the ragged
// offsets of q, k, v, o (and dO), stats.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeqQ, kSeqKV, kOffQ, kOffK, kOffV, kOffO, kOffStats };
constexpr int kUidSlots = kOffStats + 1;  // indexed by Uid; slot 0 unused
constexpr std::array<Uid, 5> kForwardUids{kQ, kK, kV, kO, kStats};
constexpr std::array<Uid, 9> kBackwardUids{kQ, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV};
constexpr std::array<Uid, 7> kRaggedUids{kSeqQ, kSeqKV, kOffQ, kOffK, kOffV, kOffO, kOffStats};
// The ragged offsets' order in the workspace (cudnn_offsets.hpp): q, k, v, o, stats.
constexpr std::array<Uid, 5> kOffsetUids{kOffQ, kOffK, kOffV, kOffO, kOffStats};

// Element strides of a [B, S, heads, D] tensor (the D stride is 1).
struct Bshd {
  int64_t b = 0, s = 0, h = 0;
  static Bshd packed(int64_t S, int64_t heads, int64_t D) { return {S * heads * D, heads * D, D}; }
};

// A graph's identity as a plain array: built and compared on every call
// without allocating. 10 shape/dtype/direction words, then the strides of
// q, k, v, o (forward) and dout, dq, dk, dv (backward; zero in forward), then
// the ragged graph's sequence count and length (zero without documents).
using GraphId = std::array<int64_t, 10 + 8 * 3 + 2>;
// What workspace_bytes() is asked about: the shape (documents or not) and dtype.
using ShapeId = std::array<int64_t, 9>;

ShapeId shape_id(const AttentionShape& s, DType t) {
  return {s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, s.causal, std::bit_cast<int32_t>(s.scale),
          static_cast<int64_t>(t), s.documents};
}

// The sequence counts of a document shape's ragged graphs: B, 2B, 4B, ...,
// and B x S (every token a span of its own), the last bucket. Each count a
// micro-batch can have (B to B x S spans: each row begins one) falls into
// one: the smallest bucket >= it. Doubling bounds both the graphs built at
// start-up (log2(S) + 1) and the empty sequences of a call (fewer than its
// spans).
std::vector<int64_t> ragged_counts(const AttentionShape& s) {
  std::vector<int64_t> out;
  const int64_t N = s.batch * s.seq;
  for (int64_t c = s.batch; c < N; c *= 2) out.push_back(c);
  out.push_back(N);
  return out;
}
int64_t ragged_count(const AttentionShape& s, int64_t spans) {
  int64_t c = s.batch;
  while (c < spans) c *= 2;
  return std::min(c, s.batch * s.seq);
}

// Everything a graph depends on. For forward only q/k/v/o are used.
struct GraphKey {
  AttentionShape shape;
  DType dtype = DType::bf16;
  bool backward = false;
  bool deterministic = false;  // backward only: forward has a single algorithm
  Bshd q, k, v, o, dout, dq, dk, dv;
  // Document masking: a ragged graph of `seqs` sequences of at most `seq_len`
  // tokens (S; 0 and 0 without documents).
  int64_t seqs = 0, seq_len = 0;
  bool ragged() const { return seqs > 0; }

  GraphId id() const {
    const ShapeId sid = shape_id(shape, dtype);
    GraphId g{};
    std::copy(sid.begin(), sid.end(), g.begin());
    g[8] = backward;
    g[9] = backward && deterministic;
    const Bshd* all[8] = {&q, &k, &v, &o, &dout, &dq, &dk, &dv};
    const int n = backward ? 8 : 4;
    for (int i = 0; i < n; ++i) {
      g[10 + 3 * i] = all[i]->b;
      g[11 + 3 * i] = all[i]->s;
      g[12 + 3 * i] = all[i]->h;
    }
    g[34] = seqs;
    g[35] = seq_len;
    return g;
  }
  std::string describe() const {
    return cat(backward ? "backward" : "forward", " B=", shape.batch, " S=", shape.seq, " H=", shape.heads,
               " Hkv=", shape.kv_heads, " D=", shape.head_dim, " ", dtype_name(dtype),
               shape.causal ? " causal" : " non-causal", backward && deterministic ? " deterministic" : "",
               ragged() ? cat(" documents (ragged: ", seqs, " sequences of up to ", seq_len, " tokens)") : "");
  }
};

// The layouts the model hands over: separate packed q/k/v/o (and grads), or
// the fused attention block's: q/k/v as views into one packed
// [B, S, (H + 2 Hkv) * D] buffer (q: heads [0, H), k: [H, H + Hkv), v: the
// rest), dq/dk/dv the same views of one packed gradient buffer of that shape,
// out and dout packed [B, S, H * D]. Only strides enter the key: the views'
// offsets inside the buffer are pointers, which the variant pack carries.
GraphKey packed_key(const AttentionShape& s, DType t, bool backward, bool det) {
  GraphKey k{s, t, backward, det};
  k.q = k.o = k.dout = k.dq = Bshd::packed(s.seq, s.heads, s.head_dim);
  k.k = k.v = k.dk = k.dv = Bshd::packed(s.seq, s.kv_heads, s.head_dim);
  return k;
}
GraphKey fused_key(const AttentionShape& s, DType t, bool backward, bool det) {
  GraphKey k = packed_key(s, t, backward, det);  // o and dout stay packed
  const int64_t W = (s.heads + 2 * s.kv_heads) * s.head_dim;
  k.q = k.k = k.v = k.dq = k.dk = k.dv = Bshd{s.seq * W, W, s.head_dim};
  return k;
}
// The same layout as a ragged graph of `seqs` sequences of up to `seq_len` tokens.
GraphKey ragged(GraphKey k, int64_t seqs, int64_t seq_len) {
  k.seqs = seqs;
  k.seq_len = seq_len;
  return k;
}

// Bytes at the front of the workspace for the ragged offsets of a document
// shape: five int64 arrays of B * S + 1 (q, k, v, o, stats), 256-aligned.
int64_t offsets_bytes(const AttentionShape& s) {
  if (!s.documents) return 0;
  const int64_t b = 5 * (s.batch * s.seq + 1) * static_cast<int64_t>(sizeof(int64_t));
  return (b + 255) / 256 * 256;
}

void check_cudnn(cudnnStatus_t st, const char* call, const GraphKey* key) {
  LOOM_CHECK(st == CUDNN_STATUS_SUCCESS, "cudnn attention: ", call, " failed for ",
             key ? key->describe() : std::string("the plugin's handle"), ": ", cudnnGetErrorString(st));
}

// By value: error_t::get_message() is not const. Copying a success (an empty
// message, held in place by the small-string buffer) allocates nothing.
void check_fe(fe::error_t st, const char* step, const GraphKey& key) {
  if (st.is_bad())
    throw Error(cat("cudnn attention: cuDNN SDPA ", step, " failed for ", key.describe(), ": ", st.get_message()));
}

// [B, S, heads, D] strides -> cuDNN's {B, heads, S, D} order. A ragged
// graph's "batch" is its sequences (the document spans) and its "S" their
// longest; each sequence starts at its ragged offset, tokens t.s apart.
std::vector<int64_t> bhsd_dims(const GraphKey& k, int64_t heads) {
  return k.ragged() ? std::vector<int64_t>{k.seqs, heads, k.seq_len, k.shape.head_dim}
                    : std::vector<int64_t>{k.shape.batch, heads, k.shape.seq, k.shape.head_dim};
}
std::vector<int64_t> bhsd_strides(const GraphKey& k, const Bshd& t) {
  return {k.ragged() ? k.seq_len * t.s : t.b, t.h, t.s, 1};
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

TensorPtr add_tensor(fe::graph::Graph& g, const char* name, Uid uid, const GraphKey& k, int64_t heads, const Bshd& st) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(bhsd_dims(k, heads)).set_stride(
      bhsd_strides(k, st)));
}

// The stats tensor: our contiguous fp32 [B, H, S] seen as {B, H, S, 1}; in a
// ragged graph the same buffer holds [tokens, H] (sequence i from token
// cu_seqlens[i], offset cu_seqlens[i] * H).
void set_stats_layout(fe::graph::Tensor_attributes& t, const GraphKey& k) {
  const AttentionShape& s = k.shape;
  t.set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
  if (k.ragged())
    t.set_dim({k.seqs, s.heads, k.seq_len, 1}).set_stride({k.seq_len * s.heads, 1, s.heads, 1});
  else
    t.set_dim({s.batch, s.heads, s.seq, 1}).set_stride({s.heads * s.seq, s.seq, 1, 1});
}

// The ragged graph's extra inputs: per-sequence lengths (for q and kv: the
// same spans) and the ragged offsets of each tensor.
struct RaggedInputs {
  TensorPtr seq_q, seq_kv, off[5];  // off in kOffsetUids order: q, k, v, o, stats
};
RaggedInputs add_ragged_inputs(fe::graph::Graph& g, const GraphKey& k) {
  RaggedInputs r;
  auto lengths = [&](const char* name, Uid uid) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({k.seqs, 1, 1, 1})
                        .set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::INT32));
  };
  r.seq_q = lengths("seq_len_q", kSeqQ);
  r.seq_kv = lengths("seq_len_kv", kSeqKV);
  const char* names[5] = {"offsets_q", "offsets_k", "offsets_v", "offsets_o", "offsets_stats"};
  for (int i = 0; i < 5; ++i)
    r.off[i] = g.tensor(fe::graph::Tensor_attributes().set_name(names[i]).set_uid(kOffsetUids[static_cast<size_t>(i)])
                            .set_dim({k.seqs + 1, 1, 1, 1}).set_stride({1, 1, 1, 1})
                            .set_data_type(fe::DataType_t::INT64));
  return r;
}

// One cached graph with everything its calls need.
struct Entry {
  GraphId id{};
  GraphKey key;  // for messages
  std::shared_ptr<fe::graph::Graph> graph;  // null when cuDNN refused the graph
  int64_t workspace = 0;
  std::string error;  // why it was refused
  // The variant pack handed to Graph::execute, holding every uid of the graph
  // from the start; a call only overwrites the values (through `slot`: pointers
  // into the map's nodes, which never move), so execute's lookups allocate nothing.
  std::unordered_map<int64_t, void*> pack;
  std::array<void**, kUidSlots> slot{};
  // workspace_bytes()'s figure for this shape, found on the first call (the
  // planned_ map's nodes never move either).
  const int64_t* planned = nullptr;
};

// attention.sdpa_forward's values; the first is the default.
struct ForwardImpl {
  const char* name;
  fe::AttentionImplementation_t impl;
};
constexpr std::array<ForwardImpl, 3> kForwardImpls = {{{"auto", fe::AttentionImplementation_t::AUTO},
                                                       {"composite", fe::AttentionImplementation_t::COMPOSITE},
                                                       {"unified", fe::AttentionImplementation_t::UNIFIED}}};

std::shared_ptr<fe::graph::Graph> build_graph(cudnnHandle_t handle, const GraphKey& key, int64_t& workspace,
                                              fe::AttentionImplementation_t forward_impl) {
  const AttentionShape& s = key.shape;
  const int64_t tokens = s.batch * s.seq;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(key.dtype == DType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto Q = add_tensor(*g, "Q", kQ, key, s.heads, key.q);
  auto K = add_tensor(*g, "K", kK, key, s.kv_heads, key.k);
  auto V = add_tensor(*g, "V", kV, key, s.kv_heads, key.v);
  RaggedInputs rag;
  if (key.ragged()) {
    rag = add_ragged_inputs(*g, key);
    Q->set_ragged_offset(rag.off[0]);
    K->set_ragged_offset(rag.off[1]);
    V->set_ragged_offset(rag.off[2]);
  }
  if (!key.backward) {
    auto attrs = fe::graph::SDPA_attributes()
                     .set_name("sdpa_forward")
                     .set_generate_stats(true)  // training: backward needs the log-sum-exp
                     .set_causal_mask(s.causal)
                     .set_attn_scale(s.scale)
                     .set_implementation(forward_impl);
    if (key.ragged())
      attrs.set_padding_mask(true).set_seq_len_q(rag.seq_q).set_seq_len_kv(rag.seq_kv)
          .set_max_total_seq_len_q(tokens).set_max_total_seq_len_kv(tokens);
    auto [O, Stats] = g->sdpa(Q, K, V, attrs);
    O->set_output(true).set_uid(kO).set_dim(bhsd_dims(key, s.heads)).set_stride(bhsd_strides(key, key.o));
    Stats->set_output(true);
    set_stats_layout(*Stats, key);
    if (key.ragged()) {
      O->set_ragged_offset(rag.off[3]);
      Stats->set_ragged_offset(rag.off[4]);
    }
  } else {
    auto O = add_tensor(*g, "O", kO, key, s.heads, key.o);
    auto dO = add_tensor(*g, "dO", kDO, key, s.heads, key.dout);
    fe::graph::Tensor_attributes stats_attr;
    stats_attr.set_name("Stats");
    set_stats_layout(stats_attr, key);
    auto Stats = g->tensor(stats_attr);
    if (key.ragged()) {
      O->set_ragged_offset(rag.off[3]);
      dO->set_ragged_offset(rag.off[3]);  // dout has out's token stride (checked per call)
      Stats->set_ragged_offset(rag.off[4]);
    }
    auto attrs = fe::graph::SDPA_backward_attributes()
                     .set_name("sdpa_backward")
                     .set_causal_mask(s.causal)
                     .set_attn_scale(s.scale)
                     .set_deterministic_algorithm(key.deterministic);
    if (key.ragged())
      attrs.set_padding_mask(true).set_seq_len_q(rag.seq_q).set_seq_len_kv(rag.seq_kv)
          .set_max_total_seq_len_q(tokens).set_max_total_seq_len_kv(tokens);
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, attrs);
    dQ->set_output(true).set_uid(kDQ).set_dim(bhsd_dims(key, s.heads)).set_stride(bhsd_strides(key, key.dq));
    dK->set_output(true).set_uid(kDK).set_dim(bhsd_dims(key, s.kv_heads)).set_stride(bhsd_strides(key, key.dk));
    dV->set_output(true).set_uid(kDV).set_dim(bhsd_dims(key, s.kv_heads)).set_stride(bhsd_strides(key, key.dv));
    if (key.ragged()) {  // the gradients have their inputs' token strides (checked per call)
      dQ->set_ragged_offset(rag.off[0]);
      dK->set_ragged_offset(rag.off[1]);
      dV->set_ragged_offset(rag.off[2]);
    }
  }
  check_fe(g->validate(), "validate", key);
  check_fe(g->build_operation_graph(handle), "build_operation_graph", key);
  check_fe(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans (heuristics mode A)", key);
  check_fe(g->check_support(handle), "check_support", key);
  check_fe(g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans", key);
  check_fe(g->get_workspace_size(workspace), "get_workspace_size", key);
  return g;
}

// Checks one BSHD tensor against the shape and returns its strides.
Bshd bshd(const Tensor& t, const char* what, const AttentionShape& s, int64_t heads, DType dtype) {
  LOOM_CHECK(t.data != nullptr, "cudnn attention: ", what, " has no data");
  LOOM_CHECK(t.dtype == dtype && t.device == Device::cuda, "cudnn attention: ", what, " must be ", dtype_name(dtype),
             " on cuda (like q), got ", dtype_name(t.dtype), " on ", device_name(t.device));
  LOOM_CHECK(t.ndim == 4 && t.shape[0] == s.batch && t.shape[1] == s.seq && t.shape[2] == heads &&
                 t.shape[3] == s.head_dim,
             "cudnn attention: ", what, " must have shape [B,S,heads,D] = [", s.batch, ",", s.seq, ",", heads, ",",
             s.head_dim, "], got ", t.shape_str());
  LOOM_CHECK(t.stride[3] == 1, "cudnn attention: ", what, " must be contiguous in head_dim, got stride ", t.stride[3]);
  // cuDNN's SDPA kernels load 16-byte vectors.
  LOOM_CHECK(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, "cudnn attention: ", what,
             " must start on a 16-byte boundary, got address ", t.data);
  return {t.stride[0], t.stride[1], t.stride[2]};
}

void check_stats(const Tensor& t, const AttentionShape& s) {
  LOOM_CHECK(t.data != nullptr, "cudnn attention: stats has no data");
  LOOM_CHECK(t.dtype == DType::f32 && t.device == Device::cuda, "cudnn attention: stats must be fp32 on cuda, got ",
             dtype_name(t.dtype), " on ", device_name(t.device));
  LOOM_CHECK(t.ndim == 3 && t.shape[0] == s.batch && t.shape[1] == s.heads && t.shape[2] == s.seq &&
                 t.is_contiguous(),
             "cudnn attention: stats must be a contiguous [B,H,S] = [", s.batch, ",", s.heads, ",", s.seq,
             "] tensor, got ", t.shape_str());
}

class CudnnAttention final : public Attention {
 public:
  explicit CudnnAttention(const PluginInit& init)
      : device_(init.device), deterministic_(init.deterministic), planning_(init.planning) {
    std::vector<std::string> names;
    for (const ForwardImpl& f : kForwardImpls) names.emplace_back(f.name);
    const std::string impl = init.config.get_choice("sdpa_forward", kForwardImpls[0].name, names);
    for (const ForwardImpl& f : kForwardImpls)
      if (impl == f.name) forward_impl_ = &f;
    init.config.finish();  // rejects any other key
  }

  ~CudnnAttention() override {
    // Graphs hold cuDNN descriptors: release them before the handle.
    last_ = {};
    cache_.clear();
    if (handle_) cudnnDestroy(handle_);  // at teardown there is nobody to report a failure to
  }

  Support supports(const AttentionShape& shape, DType dtype, Device device) const override {
    if (device != Device::cuda)
      return Support::no(cat("cudnn attention runs on cuda only, got device ", device_name(device), kUseNaive));
    if (dtype != DType::bf16 && dtype != DType::f16)
      return Support::no(cat("cudnn attention takes bf16 or fp16 tensors (cuDNN SDPA), got ", dtype_name(dtype),
                             kUseNaive));
    if (shape.head_dim > kMaxHeadDim)
      return Support::no(cat("cudnn attention: head_dim=", shape.head_dim, " is above cuDNN SDPA's limit of ",
                             kMaxHeadDim, kUseNaive));
    if (shape.head_dim <= 0 || shape.head_dim % 8 != 0)
      return Support::no(cat("cudnn attention: head_dim=", shape.head_dim,
                             " is not a positive multiple of 8 (cuDNN SDPA loads 16-byte vectors)", kUseNaive));
    if (shape.batch <= 0 || shape.seq <= 0 || shape.heads <= 0 || shape.kv_heads <= 0 ||
        shape.heads % shape.kv_heads != 0)
      return Support::no(cat("cudnn attention: needs positive dims with heads a multiple of kv_heads, got B=",
                             shape.batch, " S=", shape.seq, " H=", shape.heads, " Hkv=", shape.kv_heads, kUseNaive));
    if (!(shape.scale > 0 && shape.scale < INFINITY))
      return Support::no(cat("cudnn attention: softmax scale must be finite and > 0, got ", shape.scale));
    if (shape.documents && !shape.causal)
      return Support::no(cat("cudnn attention: document masking is causal within each document; a non-causal shape "
                             "with documents is not supported", kUseNaive));
    // A run planned without its GPU (PluginInit::planning): cuDNN cannot be
    // asked; the rules above are all that can be checked.
    if (planning_) return Support::yes();
    // The rest is cuDNN's to say: build (and keep) the graphs this shape needs
    // (with documents: the ragged graphs of one span per row).
    try {
      for (bool bwd : {false, true}) {
        const Entry& e = entry(first_key(packed_key(shape, dtype, bwd, deterministic_)));
        if (!e.graph)
          return Support::no(cat(shape.documents ? "cuDNN SDPA has no ragged (document-masked) graph here: " : "",
                                 e.error, kUseNaive));
      }
    } catch (const Error& e) {
      return Support::no(cat(e.what(), kUseNaive));
    }
    return Support::yes();
  }

  // Builds every graph a step can ask for with this shape: forward and backward
  // (with the determinism the plugin was created with), for packed tensors and
  // for the fused attention block's layout (fused_key).
  // With documents: the ragged graphs of every sequence-count bucket
  // (ragged_counts), so that no call builds one; the workspace is the
  // largest of them plus the ragged offsets' room. A bucket cuDNN refuses
  // refuses the run here, at start-up, naming it.
  size_t workspace_bytes(const AttentionShape& shape, DType dtype, Device device) const override {
    LOOM_CHECK(device == Device::cuda, "cudnn attention runs on cuda only, got device ", device_name(device), kUseNaive);
    if (planning_) return planned_workspace(shape, deterministic_) + static_cast<size_t>(offsets_bytes(shape));
    int64_t most = 0;
    for (bool bwd : {false, true})
      for (const GraphKey& k :
           {packed_key(shape, dtype, bwd, deterministic_), fused_key(shape, dtype, bwd, deterministic_)}) {
        std::vector<GraphKey> keys;
        if (shape.documents)
          for (int64_t c : ragged_counts(shape)) keys.push_back(ragged(k, c, shape.seq));
        else
          keys.push_back(k);
        for (const GraphKey& rk : keys) {
          const Entry& e = entry(rk);
          LOOM_CHECK(e.graph != nullptr, e.error,
                     shape.documents ? " (train.reset_attention_mask: every bucket of document counts is built at "
                                       "start-up)"
                                     : "",
                     kUseNaive);
          most = std::max(most, e.workspace);
        }
      }
    int64_t& planned = planned_[shape_id(shape, dtype)];
    planned = std::max(planned, most);
    return static_cast<size_t>(most + offsets_bytes(shape));
  }

  void forward(const ExecContext& ctx, const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
               Tensor& out, Tensor& stats, void* workspace) override {
    check_ctx(ctx);
    const DType t = io_dtype(q);
    GraphKey key{shape, t, false, false};
    key.q = bshd(q, "q", shape, shape.heads, t);
    key.k = bshd(k, "k", shape, shape.kv_heads, t);
    key.v = bshd(v, "v", shape, shape.kv_heads, t);
    key.o = bshd(out, "out", shape, shape.heads, t);
    check_stats(stats, shape);
    std::array<void*, kUidSlots> ptrs{};
    ptrs[kQ] = q.data, ptrs[kK] = k.data, ptrs[kV] = v.data, ptrs[kO] = out.data, ptrs[kStats] = stats.data;
    execute(ctx, documents(ctx, key, ptrs, workspace), ptrs, workspace);
  }

  void backward(const ExecContext& ctx, const AttentionShape& shape, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& out, const Tensor& dout, const Tensor& stats, Tensor& dq, Tensor& dk, Tensor& dv,
                void* workspace) override {
    check_ctx(ctx);
    const DType t = io_dtype(q);
    GraphKey key{shape, t, true, ctx.deterministic};
    key.q = bshd(q, "q", shape, shape.heads, t);
    key.k = bshd(k, "k", shape, shape.kv_heads, t);
    key.v = bshd(v, "v", shape, shape.kv_heads, t);
    key.o = bshd(out, "out", shape, shape.heads, t);
    key.dout = bshd(dout, "dout", shape, shape.heads, t);
    key.dq = bshd(dq, "dq", shape, shape.heads, t);
    key.dk = bshd(dk, "dk", shape, shape.kv_heads, t);
    key.dv = bshd(dv, "dv", shape, shape.kv_heads, t);
    check_stats(stats, shape);
    std::array<void*, kUidSlots> ptrs{};
    ptrs[kQ] = q.data, ptrs[kK] = k.data, ptrs[kV] = v.data, ptrs[kO] = out.data, ptrs[kStats] = stats.data;
    ptrs[kDO] = dout.data, ptrs[kDQ] = dq.data, ptrs[kDK] = dk.data, ptrs[kDV] = dv.data;
    if (shape.documents)  // the gradients share their inputs' ragged offsets: the same token strides
      LOOM_CHECK(key.dq.s == key.q.s && key.dk.s == key.k.s && key.dv.s == key.v.s && key.dout.s == key.o.s,
                 "cudnn attention with documents: dq, dk, dv and dout must have the token strides of q, k, v and ",
                 "out (", key.q.s, ", ", key.k.s, ", ", key.v.s, ", ", key.o.s, "), got ", key.dq.s, ", ", key.dk.s,
                 ", ", key.dv.s, ", ", key.dout.s);
    execute(ctx, documents(ctx, key, ptrs, workspace), ptrs, workspace);
  }

 private:
  // Without a GPU (PluginInit::planning) the graphs cannot be built, so the
  // workspace is the most cudnn-frontend's SDPA backward asks for (its
  // scaled_dot_product_flash_attention.h): the fp32 dQ accumulator
  // [B, H, S, D], the softmax sum [B, H, S] and, with grouped-query
  // attention, full-head dK and dV in fp32; deterministic runs use the dP
  // workspace [B, H, S, S] in bf16 (S rounded up to 64) instead of the dQ
  // accumulator. The forward needs none. An upper bound of what the GPU plans.
  static size_t planned_workspace(const AttentionShape& s, bool deterministic) {
    const int64_t b = s.batch, h = s.heads, S = s.seq, d = s.head_dim;
    int64_t bytes = b * h * S * 4;  // softmax sum
    const int64_t padded = (S + 63) / 64 * 64;
    bytes += deterministic ? b * h * padded * padded * 2 : b * h * S * d * 4;
    if (s.kv_heads != s.heads) bytes += 2 * b * h * S * d * 4;
    return static_cast<size_t>(bytes);
  }

  void check_ctx(const ExecContext& ctx) const {
    LOOM_CHECK(ctx.device == Device::cuda && device_ == Device::cuda, "cudnn attention: called on ",
               device_name(ctx.device), " (plugin created for ", device_name(device_), "); it runs on cuda only",
               kUseNaive);
  }

  // The key supports() asks cuDNN about: with documents, the ragged graph
  // of one span per row (workspace_bytes() builds the other buckets).
  static GraphKey first_key(const GraphKey& k) {
    const AttentionShape& s = k.shape;
    return s.documents ? ragged(k, ragged_count(s, s.batch), s.seq) : k;
  }

  // Document masking: the ragged graph this micro-batch's spans need, with
  // the spans' lengths and the ragged offsets (computed into the front of the
  // workspace when the spans or the strides changed) in ptrs. Without
  // documents, key itself.
  GraphKey documents(const ExecContext& ctx, const GraphKey& key, std::array<void*, kUidSlots>& ptrs,
                     void* workspace) {
    const AttentionShape& s = key.shape;
    if (!s.documents) return key;
    LOOM_CHECK(s.spans != nullptr, "cudnn attention: the shape asks for document masking but carries no spans");
    const DocumentSpans& d = *s.spans;
    const int64_t N = s.batch * s.seq;
    LOOM_CHECK(d.count >= 1 && d.count <= N && d.longest >= 1 && d.longest <= s.seq, "cudnn attention: ", d.count,
               " document spans, the longest ", d.longest, " tokens, cannot be the spans of ", s.batch, " rows of ",
               s.seq, " tokens");
    for (const auto& [t, n, what] : {std::tuple{&d.cu_seqlens, N + 1, "cu_seqlens"},
                                     std::tuple{&d.lengths, N, "lengths"}})
      LOOM_CHECK(t->data != nullptr && t->dtype == DType::i32 && t->device == Device::cuda && t->numel() == n &&
                     t->is_contiguous(),
                 "cudnn attention: the document spans' ", what, " must be a contiguous int32 cuda tensor of ", n,
                 " entries, got ", dtype_name(t->dtype), " ", t->shape_str(), " on ", device_name(t->device));
    // Token t = b * S + s must sit at t * (token stride): rows back to back.
    for (const auto& [st, what] : {std::pair{&key.q, "q"}, std::pair{&key.k, "k"}, std::pair{&key.v, "v"},
                                   std::pair{&key.o, "out"}})
      LOOM_CHECK(st->b == s.seq * st->s, "cudnn attention with documents: ", what, "'s rows must follow each other ",
                 "(batch stride = S x token stride = ", s.seq * st->s, "), got batch stride ", st->b);
    LOOM_CHECK(workspace != nullptr, "cudnn attention with documents needs the workspace workspace_bytes() asked for");
    const GraphKey rk = ragged(key, ragged_count(s, d.count), s.seq);
    auto* off = static_cast<int64_t*>(workspace);  // 5 arrays of N + 1: q, k, v, o, stats
    const std::array<int64_t, 5> strides{key.q.s, key.k.s, key.v.s, key.o.s, s.heads};
    if (!(d.serial == offsets_serial_ && &d == offsets_spans_ && workspace == offsets_at_ &&
          strides == offsets_strides_)) {
      cudnn_offsets::ragged_offsets(d.cu_seqlens.ptr<const int32_t>(), N + 1, strides.data(), off, ctx.stream);
      offsets_serial_ = d.serial, offsets_spans_ = &d, offsets_at_ = workspace, offsets_strides_ = strides;
    }
    for (size_t i = 0; i < kOffsetUids.size(); ++i) ptrs[kOffsetUids[i]] = off + static_cast<int64_t>(i) * (N + 1);
    ptrs[kSeqQ] = ptrs[kSeqKV] = d.lengths.data;
    return rk;
  }

  // The tensors' dtype: q decides, every other tensor is checked against it.
  static DType io_dtype(const Tensor& q) {
    LOOM_CHECK(q.dtype == DType::bf16 || q.dtype == DType::f16,
               "cudnn attention takes bf16 or fp16 tensors (cuDNN SDPA), got q in ", dtype_name(q.dtype), kUseNaive);
    return q.dtype;
  }

  cudnnHandle_t handle() const {
    // Created on first use, not in the constructor: supports() for another
    // device, and loading the plugin to list it, need no GPU.
    if (!handle_) check_cudnn(cudnnCreate(&handle_), "cudnnCreate", nullptr);
    return handle_;
  }

  // The cached graph for `key`, built on first use. A graph cuDNN refuses is
  // cached too (with the reason), so asking again costs nothing. Lookups
  // (std::map::find on an array key) allocate nothing; building does.
  Entry& entry(const GraphKey& key) const { return entry(key, key.id()); }
  Entry& entry(const GraphKey& key, const GraphId& id) const {
    auto it = cache_.find(id);
    if (it != cache_.end()) return it->second;
    cudnnHandle_t h = handle();  // a failure here (no GPU, no libcudnn) is not cached: it throws
    Entry e;
    e.id = id;
    e.key = key;
    ++g_graphs_built;
    try {
      e.graph = build_graph(h, key, e.workspace, forward_impl_->impl);
    } catch (const Error& err) {
      e.graph.reset();
      e.error = err.what();
      if (!key.backward && forward_impl_ != &kForwardImpls[0])
        e.error += cat(" (with attention.sdpa_forward = \"", forward_impl_->name,
                       "\"; \"auto\" takes whichever implementation cuDNN supports)");
    }
    Entry& placed = cache_.emplace(id, std::move(e)).first->second;
    if (placed.graph) {
      // The variant pack, filled once: in place, because `slot` points into its nodes.
      const bool bwd = key.backward;
      const Uid* uids = bwd ? kBackwardUids.data() : kForwardUids.data();
      const size_t n = bwd ? kBackwardUids.size() : kForwardUids.size();
      placed.pack.reserve(n + (key.ragged() ? kRaggedUids.size() : 0));
      for (size_t i = 0; i < n; ++i) placed.slot[uids[i]] = &placed.pack.emplace(uids[i], nullptr).first->second;
      if (key.ragged())
        for (Uid u : kRaggedUids) placed.slot[u] = &placed.pack.emplace(u, nullptr).first->second;
    }
    return placed;
  }

  // The graph of a forward/backward call: the one this direction used last
  // (every layer of a model asks for the same), else the cache. A ragged
  // graph is never built here: building one allocates and may wait for the
  // device, in the middle of a step; workspace_bytes() built them all.
  Entry& call_entry(const GraphKey& key) {
    const GraphId id = key.id();
    Entry*& last = last_[key.backward ? 1 : 0];
    if (last == nullptr || last->id != id) {
      if (key.ragged()) {
        auto it = cache_.find(id);
        LOOM_CHECK(it != cache_.end(), "cudnn attention: the ", key.describe(),
                   " graph was not built at start-up: workspace_bytes() builds every graph of a document shape, and "
                   "was not asked for this one (B=", key.shape.batch, " S=", key.shape.seq, ")");
        last = &it->second;
      } else {
        last = &entry(key, id);
      }
    }
    return *last;
  }

  void execute(const ExecContext& ctx, const GraphKey& key, const std::array<void*, kUidSlots>& ptrs,
               void* workspace) {
    Entry& e = call_entry(key);
    LOOM_CHECK(e.graph != nullptr, e.error, kUseNaive);
    if (e.workspace > 0 && e.planned == nullptr) {
      auto it = planned_.find(shape_id(key.shape, key.dtype));
      if (it != planned_.end()) e.planned = &it->second;
    }
    // The core sizes the workspace from workspace_bytes() once; a layout or
    // determinism setting it did not foresee may need more.
    LOOM_CHECK(e.workspace == 0 || (workspace != nullptr && e.planned != nullptr && *e.planned >= e.workspace),
               "cudnn attention: the ", key.describe(), " graph for these tensor strides needs a workspace of ",
               e.workspace, " bytes, but workspace_bytes() planned ",
               e.planned ? std::to_string(*e.planned) : std::string("nothing"), " bytes for this shape",
               workspace ? "" : " and none was passed",
               key.backward && key.deterministic != deterministic_
                   ? " (ExecContext::deterministic differs from the PluginInit::deterministic it was planned with)"
                   : "");
    for (int uid = kQ; uid < kUidSlots; ++uid)
      if (e.slot[uid] != nullptr) *e.slot[uid] = ptrs[uid];
    // Every call: a stream value may be destroyed and its address reused for a
    // new stream, which cuDNN must be told about all the same.
    cudnnHandle_t h = handle();
    check_cudnn(cudnnSetStream(h, static_cast<cudaStream_t>(ctx.stream)), "cudnnSetStream", &key);
    // With documents the ragged offsets take the workspace's front.
    void* graph_ws = workspace ? static_cast<char*>(workspace) + offsets_bytes(key.shape) : nullptr;
    check_fe(e.graph->execute(h, e.pack, graph_ws), "execute", key);
  }

  Device device_;
  bool deterministic_;
  const ForwardImpl* forward_impl_ = &kForwardImpls[0];  // attention.sdpa_forward
  bool planning_ = false;  // PluginInit::planning: no GPU to ask
  mutable cudnnHandle_t handle_ = nullptr;
  // std::map: entries never move, so `last_` and Entry::slot stay valid.
  mutable std::map<GraphId, Entry> cache_;
  std::array<Entry*, 2> last_{};                // per direction: forward, backward
  mutable std::map<ShapeId, int64_t> planned_;  // shape -> workspace bytes of its graphs (offsets not counted)
  // What the ragged offsets in the workspace were computed from (documents).
  uint64_t offsets_serial_ = 0;
  const DocumentSpans* offsets_spans_ = nullptr;
  const void* offsets_at_ = nullptr;
  std::array<int64_t, 5> offsets_strides_{};
};

}  // namespace
}  // namespace loom::cudnn_attn

using loom::cudnn_attn::CudnnAttention;
LOOM_PLUGIN(attention, CudnnAttention, "cudnn", "1.1.0",
            "causal GQA attention through cuDNN's fused SDPA (cudnn-frontend graphs), bf16/fp16 with fp32 softmax; "
            "document masking as ragged sequences")
