// The mixture-of-experts feed-forward block (model.ffn = "moe"; HF Mixtral's
// MixtralSparseMoeBlock after the post-attention norm):
//
//   h = rmsnorm(x)                 xin = h, or h * noise (router jitter, training only)
//   logits = xin Wr^T (fp32) ; probs = softmax ; top-k experts, weights renormalised to 1
//   sort the (token, slot) pairs by expert ; xs = the gathered rows of xin
//   per expert e over its rows:  gu = xs [W1e; W3e]^T   (one GEMM: [rows, 2f])
//                                act = silu(gu[:, :f]) * gu[:, f:] ; eout = act W2e^T
//   out = x + per token, the weighted sum of its k expert rows
//
// The routing steps are Backend entry points (on the CPU the reference in
// kernels/cpu/moe.cpp); the expert GEMMs run through the precision plugin, two
// registered linears per expert ([w1; w3] and w2), on as many rows as the
// router sent that expert this micro-batch (the per-expert row counts are read
// on the host: on a device, one copy per layer in forward, the layer's one
// host wait). Backward: SwiGLU writes its gradient into one packed [rows, 2f]
// buffer, so one dgrad GEMM (K = 2f) gives the expert's input gradient and one
// wgrad GEMM the [w1; w3] gradient, as in the fused dense block.
// The load-balancing loss (MoeAuxLoss, the model's ExtraLoss "moe.aux", one
// for every layer: HF's is over every layer's tokens together) takes each
// layer's routing statistics in forward; the model finishes it after the last
// layer, into the loss and the per-expert gradient that backward adds to the
// softmax's.
//
// Parameters, HF Mixtral's names: post_attention_layernorm, the router
// block_sparse_moe.gate [E, h], then per expert experts.E.w1 [f, h] (gate),
// w3 [f, h] (up), w2 [h, f] (down). Within an expert w3 comes before w2 (HF's
// state dict lists w1, w2, w3) so that [w1; w3] is one contiguous [2f, h]
// matrix, the layout transformers keeps as an expert's gate_up_proj; the
// checkpoints and HF folders find every tensor by name, so the order within a
// unit is Loom's own.
//
// Expert parallelism (sharding.expert_parallel > 1, expert_parallel.hpp): the
// experts are in a unit of their own (declare_experts), of which this rank
// holds its experts only; the sorted rows go to the experts' owners and the
// outputs come back by all_to_all, and the same for the gradients.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "expert_parallel.hpp"
#include "loom/block.hpp"
#include "loom/error.hpp"

namespace loom {
namespace {

// HF Mixtral's load_balancing_loss_func over every layer's routing of a
// micro-batch: the statistics (Backend::moe_aux_accumulate) of every layer
// add up in one buffer, and after the last layer become the loss and its
// per-expert gradient, scaled like the LM loss's mean (Backend::moe_aux_finish).
class MoeAuxLoss final : public ExtraLoss {
 public:
  explicit MoeAuxLoss(const ModelSpec& spec) : spec_(spec) {}
  void plan(const BlockEnv& env, ActivationPlan& a) override {
    const size_t E = static_cast<size_t>(spec_.num_experts);
    dev_ = env.backend->device();
    N_ = env.N;
    stats_ = a.own("moe.aux_stats", (2 * E + 1) * 8);
    dprobs_ = a.own("moe.aux_dprobs", E * 4);
    aux_ = a.own("moe.aux_loss", 4);
  }
  void bind(const ActivationPlan& a) override { acts_ = &a; }
  void begin(Backend& be) override {
    Tensor s = stats();
    be.zero(s);
  }
  void finish(Backend& be, float dloss_scale) override {
    // 1 / (grad accumulation x world), as the LM loss's mean: dloss_scale is 1 / (tokens x those).
    Tensor aux = value(), dprobs = this->dprobs();
    be.moe_aux_finish(aux, dprobs, stats(), spec_.router_aux_loss_coef,
                      static_cast<double>(dloss_scale) * static_cast<double>(N_));
  }
  Tensor value() const override { return Tensor(acts_->ptr(aux_), DType::f32, dev_, {1}); }
  const char* range() const override { return "moe.aux_loss"; }
  // f64 [2E + 1] (Backend::moe_aux_accumulate), and fp32 [E]: coef-weighted, scaled d aux / d probs.
  Tensor stats() const { return Tensor(acts_->ptr(stats_), DType::f64, dev_, {2 * spec_.num_experts + 1}); }
  Tensor dprobs() const { return Tensor(acts_->ptr(dprobs_), DType::f32, dev_, {spec_.num_experts}); }

 private:
  const ModelSpec& spec_;
  const ActivationPlan* acts_ = nullptr;
  Device dev_ = Device::cpu;
  int64_t N_ = 0;
  int stats_ = -1, dprobs_ = -1, aux_ = -1;
};

class MoeFfn final : public FfnBlock {
 public:
  MoeFfn(const ModelSpec& spec, int64_t layer) : FfnBlock(spec, layer) {
    LOOM_CHECK(spec.num_experts >= 1 && spec.top_k >= 1 && spec.top_k <= spec.num_experts,
               "model.ffn = \"moe\": top_k = ", spec.top_k, " and num_experts = ", spec.num_experts,
               " need 1 <= top_k <= num_experts");
  }
  const char* kind() const override { return "ffn.moe"; }

  enum MoeParam { kLn = 0, kRouter = 1, kFirstExpert = 2 };
  // An expert's three matrices, in declaration order (parameter kFirstExpert + 3e + j).
  enum ExpertMatrix { kW1 = 0, kW3 = 1, kW2 = 2 };

  void declare(UnitInfo& u) override {
    const std::string p = "model.layers." + std::to_string(layer_) + ".";
    const int64_t h = spec_.hidden, f = spec_.ffn_hidden;
    add_param(u, p + "post_attention_layernorm.weight", {h}, ParamRole::norm_gain);
    add_param(u, p + "block_sparse_moe.gate.weight", {spec_.num_experts, h}, ParamRole::matrix);
    if (experts_apart_) return;  // in their own unit (declare_experts)
    for (int64_t e = 0; e < spec_.num_experts; ++e) {
      const std::string q = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      add_param(u, q + "w1.weight", {f, h}, ParamRole::matrix);
      add_param(u, q + "w3.weight", {f, h}, ParamRole::matrix);
      add_param(u, q + "w2.weight", {h, f}, ParamRole::output_projection);
    }
  }

  // Expert parallelism: every expert, global names, in the experts unit
  // (expert e's w1, w3, w2 are its parameters 3e, 3e + 1, 3e + 2).
  bool declare_experts(UnitInfo& u) override {
    experts_apart_ = true;
    const std::string p = "model.layers." + std::to_string(layer_) + ".block_sparse_moe.experts.";
    const int64_t h = spec_.hidden, f = spec_.ffn_hidden;
    auto add = [&](std::string name, std::vector<int64_t> shape, ParamRole role) {
      ParamInfo q;
      q.name = std::move(name);
      q.numel = shape[0] * shape[1];
      q.shape = std::move(shape);
      q.offset = u.numel;
      q.role = role;
      u.numel += q.numel;
      u.params.push_back(std::move(q));
    };
    for (int64_t e = 0; e < spec_.num_experts; ++e) {
      const std::string q = p + std::to_string(e) + ".";
      add(q + "w1.weight", {f, h}, ParamRole::matrix);
      add(q + "w3.weight", {f, h}, ParamRole::matrix);
      add(q + "w2.weight", {h, f}, ParamRole::output_projection);
    }
    return true;
  }
  void set_experts(const UnitState* experts) override { experts_unit_ = experts; }

  void plan(const BlockEnv& env, ActivationPlan& a) override {
    env_ = env;
    LOOM_CHECK(env.losses != nullptr && env.micro != nullptr, "ffn.moe: the model gave no extra losses or micro-batch state");
    aux_ = &env.losses->get<MoeAuxLoss>("moe.aux", env, a, [&] { return std::make_unique<MoeAuxLoss>(spec_); });
    const int64_t h = spec_.hidden, f = spec_.ffn_hidden, l = layer_, E = spec_.num_experts, k = spec_.top_k;
    const size_t n = static_cast<size_t>(env.N), e = dtype_size(env.act), R = n * static_cast<size_t>(k);
    const size_t H = static_cast<size_t>(h), F = static_cast<size_t>(f), EE = static_cast<size_t>(E),
                 K = static_cast<size_t>(k);
    const bool full = env.recompute == Recompute::full;
    // Expert parallelism (expert_parallel.hpp): the experts' rows are the
    // ones this rank's experts receive, up to Rx of them.
    ep_.reset();
    if (env.expert_group != nullptr && env.expert_group->size() > 1)
      ep_ = std::make_unique<ExpertExchange>(env.expert_group, env.backend, E, env.N, k, h);
    // On a device each expert's run of sorted rows starts at a multiple of
    // the recipe's variable_row_multiple() and spans its count rounded up to
    // one, the padding rows zero (MoeRouting::row_align): an FP8 recipe's
    // expert call then runs whole in FP8 (16 rows for the per-tensor recipes,
    // 128 for fp8_block) instead of splitting off a bf16 tail, which re-reads
    // the whole bf16 weight and reads and writes the whole weight gradient
    // once more. The CPU reference packs the runs, and so does expert
    // parallelism (the exchange moves counts, not padded runs).
    row_align_ = 1;
    if (env.backend->device() != Device::cpu && !ep_) {
      row_align_ = env.precision->variable_row_multiple();
      LOOM_CHECK(row_align_ >= 1 && row_align_ <= 1024, "ffn.moe: the precision plugin's variable_row_multiple() is ",
                 row_align_, ", expected 1 to 1024 (the expert rows are padded to it)");
    }
    const size_t Rp = static_cast<size_t>(padded_rows());  // every (token, slot) pair and the padding of E runs
    const size_t Rx = ep_ ? static_cast<size_t>(ep_->max_recv_rows()) : Rp;
    ln2_ = a.kept("ln2", l, n * H * e, full);
    rstd2_ = a.kept("rstd2", l, n * 4, full);
    if (spec_.router_jitter_noise > 0) {
      noise_ = a.kept("moe.noise", l, n * H * e, full);
      xin_ = a.kept("moe.xin", l, n * H * e, full);
    }
    logits_ = a.kept("moe.logits", l, n * EE * 4, full);
    probs_ = a.kept("moe.probs", l, n * EE * 4, full);
    weights_ = a.kept("moe.weights", l, n * K * 4, full);
    experts_ = a.kept("moe.experts", l, n * K * 4, full);
    perm_ = a.kept("moe.perm", l, Rp * 4, full);
    row_of_ = a.kept("moe.row_of", l, R * 4, full);
    counts_ = a.kept("moe.counts", l, (2 * EE + 1) * 8, full);
    xs_ = a.kept("moe.xs", l, Rp * H * e, full);
    gu_ = a.kept("moe.gate_up", l, Rx * 2 * F * e, full);
    act_ = a.kept("moe.act", l, Rx * F * e, full);
    if (ep_) {
      xr_ = a.kept("moe.ep.xr", l, Rx * H * e, full);
      eout_r_ = a.kept("moe.ep.eout", l, Rx * H * e, full);
      d_xr_ = a.shared("grad.moe.ep.xr", Rx * H * e);
      d_eout_r_ = a.shared("grad.moe.ep.eout", Rx * H * e);
      ep_counts_ = a.shared("moe.ep.counts_in", EE * 8);  // exchange 1's receive buffer
    }
    eout_ = a.kept("moe.eout", l, Rp * H * e, full);
    tmp_ = a.shared("scratch.h", n * H * e);  // the combine's output before the residual add
    d_ln_ = a.shared("grad.ln", n * H * e);
    d_eout_ = a.shared("grad.moe.eout", Rp * H * e);
    d_act_ = a.shared("grad.moe.act", Rx * F * e);
    d_gu_ = a.shared("grad.moe.gate_up", Rx * 2 * F * e);
    d_xs_ = a.shared("grad.moe.xs", Rp * H * e);
    d_weights_ = a.shared("grad.moe.weights", n * K * 4);
    d_probs_ = a.shared("grad.moe.probs", n * EE * 4);
    d_logits_ = a.shared("grad.moe.logits", n * EE * 4);
    // An expert gets at most one row per token (a token's k experts differ)
    // from each rank that sends it rows; its padded run up to a multiple of row_align.
    const int64_t max_rows = ep_ ? env.N * ep_->group_size() : (env.N + row_align_ - 1) / row_align_ * row_align_;
    const std::string s = "layer." + std::to_string(l) + ".expert.";
    w13_.clear();
    w2_.clear();
    for (int64_t x = 0; x < E; ++x) {
      const std::string q = s + std::to_string(x) + ".";
      // variable_rows: the row count changes per call (GEMM plans per bucket of counts, not per count).
      // In the layer's unit (parameters kFirstExpert + 3x + j) their place
      // is recorded for the FP8 weight gathers; in an experts unit of their
      // own (expert parallelism) they are never gathered.
      auto reg = [&](const LinearDesc& d, int j, int count) {
        return experts_apart_ ? env.register_linear(d)
                              : register_weight_linear(env, d, kFirstExpert + 3 * static_cast<int>(x) + j, count);
      };
      w13_.push_back(reg({q + "w13", h, 2 * f, max_rows, LinearRole::hidden, true}, kW1, 2));
      w2_.push_back(reg({q + "w2", f, h, max_rows, LinearRole::hidden, true}, kW2, 1));
    }
    host_counts_.assign(2 * EE + 1, 0);
    expert_written_.assign(EE, 0);
    local_segments_.clear();
    local_segments_.reserve(EE);
  }

  void forward(const UnitState& u, const Tensor& x, Tensor& out) override {
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const MicroBatch& mb = *env_.micro;
    const int64_t N = env_.N, h = spec_.hidden, f = spec_.ffn_hidden;
    Tensor ln2 = act(ln2_, {N, h}), rstd2 = f32(rstd2_, {N});
    {
      Range r(be, "rmsnorm");
      be.rmsnorm_forward(ln2, rstd2, x, param(u, kLn), static_cast<float>(spec_.norm_eps));
    }
    jittered_ = mb.training && spec_.router_jitter_noise > 0;
    Tensor xin = ln2;
    if (jittered_) {
      Range r(be, "router_jitter");
      xin = act(xin_, {N, h});
      Tensor noise = act(noise_, {N, h});
      // The seed mixes the micro-batch's with the layer, so layers draw independent noise.
      be.moe_jitter(xin, noise, ln2, spec_.router_jitter_noise,
                    mb.seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(layer_ + 1)));
    }
    MoeRouting rt = routing();
    {
      Range r(be, "router");
      be.moe_route(rt, xin, param(u, kRouter));
      if (mb.training && !mb.replay) {
        Tensor stats = aux_->stats();
        be.moe_aux_accumulate(stats, rt);
      }
    }
    // Expert parallelism: the counts exchange is queued before the host reads
    // this layer's counts (expert_rows), so that one wait covers both.
    if (ep_) {
      Range x(be, "ep.counts");
      const Tensor counts_src(rt.counts, DType::f64, dev(), {rt.E});  // int64, moved as 8-byte elements
      Tensor counts_in(buf(ep_counts_), DType::f64, dev(), {rt.E});
      ep_->exchange_counts(counts_src, counts_in);
    }
    Tensor xs = act(xs_, {padded_rows(), h});
    {
      Range r(be, "gather");
      be.moe_gather(xs, xin, rt);
    }
    const int64_t* rows = expert_rows(rt, true);
    {
      Range r(be, "experts");
      const int64_t Rx = expert_side_rows();
      Tensor gu = act(gu_, {Rx, 2 * f}), a = act(act_, {Rx, f});
      Tensor eout = act(eout_, {padded_rows(), h});
      Tensor xin_rows = xs, eout_rows = eout;  // the rows the experts run on: local, or received
      if (ep_) {
        Range x(be, "ep.dispatch");
        xin_rows = act(xr_, {Rx, h});
        eout_rows = act(eout_r_, {Rx, h});
        ep_->dispatch(rows, xs, xin_rows);
      }
      // A run of rows: this rank's own are read and written in the sorted
      // layout, where no exchange touches them; received ones in the receive
      // layout. The intermediate rows (gate_up, SwiGLU) are at `row` either way.
      const auto run = [&](const ExpertExchange::Segment& sg) {
        const int64_t e = sg.expert, r0 = sg.row, m = sg.rows;
        Tensor xs_e = sg.local ? rows_of(xs, sg.src_row, m) : rows_of(xin_rows, r0, m), gu_e = rows_of(gu, r0, m);
        Tensor act_e = rows_of(a, r0, m);
        Tensor eout_e = sg.local ? rows_of(eout, sg.src_row, m) : rows_of(eout_rows, r0, m);
        env_.precision->linear_forward(ctx, w13_[static_cast<size_t>(e)], xs_e, expert_w13(u, e), gu_e, nullptr);
        be.swiglu_forward(act_e, column_half(gu_e, 0), column_half(gu_e, 1));
        env_.precision->linear_forward(ctx, w2_[static_cast<size_t>(e)], act_e, expert(u, e, kW2), eout_e, nullptr);
      };
      run_segments(rows, false, run, [&] { ep_->give_back(eout_rows, eout); });
    }
    {
      Range r(be, "combine+residual");
      Tensor tmp = act(tmp_, {N, h});
      be.moe_combine(tmp, act(eout_, {padded_rows(), h}), rt);
      be.add(out, x, tmp);
    }
  }

  void backward(UnitState& u, const Tensor& x, Tensor& d) override {
    const bool acc = !env_.writes_grads();  // false: this micro-batch writes the weight gradients
    Backend& be = *env_.backend;
    const ExecContext& ctx = be.ctx();
    const int64_t N = env_.N, h = spec_.hidden, f = spec_.ffn_hidden, R = padded_rows();
    MoeRouting rt = routing();
    Tensor d_eout = act(d_eout_, {R, h}), d_weights = f32(d_weights_, {N, spec_.top_k});
    {
      Range r(be, "combine.grad");
      be.moe_combine_backward(d_eout, d_weights, d, act(eout_, {R, h}), rt);
    }
    const int64_t* rows = expert_rows(rt, false);
    {
      Range r(be, "experts.grad");
      const int64_t Rx = expert_side_rows();
      Tensor gu = act(gu_, {Rx, 2 * f}), a = act(act_, {Rx, f});
      Tensor d_act = act(d_act_, {Rx, f}), d_gu = act(d_gu_, {Rx, 2 * f});
      // The sorted layout (this rank's rows), and the receive layout (the
      // rows its experts got; the same buffers without expert parallelism).
      const Tensor xs = act(xs_, {R, h});
      Tensor d_xs = act(d_xs_, {R, h});
      Tensor xs_r = xs, d_xs_r = d_xs, d_eout_r = d_eout;
      if (ep_) {  // the experts' rows are the received ones; their gradients travel the same way
        Range x(be, "ep.dispatch.grad");
        xs_r = act(xr_, {Rx, h});
        d_xs_r = act(d_xr_, {Rx, h});
        d_eout_r = act(d_eout_r_, {Rx, h});
        ep_->dispatch_grad(d_eout, d_eout_r);
      }
      // An expert's first run of rows in a writing micro-batch writes its
      // weight gradients, every later run (other peers' rows under expert
      // parallelism) adds to them; an expert with no rows then gets zeros
      // (below). In an accumulating micro-batch an expert with no rows keeps
      // its gradients as they are.
      std::fill(expert_written_.begin(), expert_written_.end(), static_cast<char>(acc));
      const auto run = [&](const ExpertExchange::Segment& sg) {
        const int64_t e = sg.expert, r0 = sg.row, m = sg.rows;
        const bool acc_e = expert_written_[static_cast<size_t>(e)] != 0;
        expert_written_[static_cast<size_t>(e)] = 1;
        const int64_t at = sg.local ? sg.src_row : r0;  // own rows: the sorted layout
        Tensor d_eout_e = rows_of(sg.local ? d_eout : d_eout_r, at, m), d_act_e = rows_of(d_act, r0, m);
        Tensor d_gu_e = rows_of(d_gu, r0, m), d_xs_e = rows_of(sg.local ? d_xs : d_xs_r, at, m);
        Tensor gu_e = rows_of(gu, r0, m), xs_e = rows_of(sg.local ? xs : xs_r, at, m);
        Tensor dW2 = expert(u, e, kW2, true), dW13 = expert_w13(u, e, true);
        env_.precision->linear_backward(ctx, w2_[static_cast<size_t>(e)], rows_of(a, r0, m), expert(u, e, kW2),
                                        d_eout_e, &d_act_e, dW2, acc_e);
        Tensor d_gate_e = column_half(d_gu_e, 0), d_up_e = column_half(d_gu_e, 1);
        be.swiglu_backward(d_gate_e, d_up_e, d_act_e, column_half(gu_e, 0), column_half(gu_e, 1));
        env_.precision->linear_backward(ctx, w13_[static_cast<size_t>(e)], xs_e, expert_w13(u, e), d_gu_e, &d_xs_e,
                                        dW13, acc_e);
      };
      // So an expert's weight gradient sums its runs in a fixed order: under
      // expert parallelism its own rows first or last, the others by rank.
      run_segments(rows, true, run, [&] { ep_->give_back_grad(d_xs_r, d_xs); });
      const int64_t first = ep_ ? ep_->first_expert() : 0, held = ep_ ? ep_->local_experts() : spec_.num_experts;
      for (int64_t e = first; e < first + held; ++e) {
        if (expert_written_[static_cast<size_t>(e)] != 0) continue;
        for (int j = 0; j < 3; ++j) {
          Tensor g = expert(u, e, j, true);
          be.zero(g);
        }
      }
    }
    Tensor d_ln = act(d_ln_, {N, h});
    {
      Range r(be, "router.grad");
      Tensor dWr = param(u, kRouter, true);
      if (!acc) be.zero(dWr);  // moe_route_backward adds to it
      Tensor d_probs = f32(d_probs_, {N, spec_.num_experts}), d_logits = f32(d_logits_, {N, spec_.num_experts});
      const Tensor aux_dprobs = aux_->dprobs();
      const Tensor xin = jittered_ ? act(xin_, {N, h}) : act(ln2_, {N, h});
      be.moe_route_backward(d_ln, dWr, d_probs, d_logits, d_weights, xin, param(u, kRouter), rt, &aux_dprobs);
      const Tensor noise = jittered_ ? act(noise_, {N, h}) : Tensor();
      be.moe_scatter_add(d_ln, act(d_xs_, {R, h}), rt, jittered_ ? &noise : nullptr);
    }
    {
      Range r(be, "rmsnorm.grad");
      Tensor dln2 = param(u, kLn, true);
      if (!acc) be.zero(dln2);  // the first micro-batch writes (BlockEnv::first_micro)
      be.rmsnorm_backward(d, dln2, d_ln, x, param(u, kLn), f32(rstd2_, {N}));
    }
  }

 private:
  MoeRouting routing() const {
    MoeRouting r;
    r.N = env_.N;
    r.E = spec_.num_experts;
    r.k = spec_.top_k;
    r.logits = f32(logits_, {r.N, r.E});
    r.probs = f32(probs_, {r.N, r.E});
    r.weights = f32(weights_, {r.N, r.k});
    r.experts = Tensor(buf(experts_), DType::i32, dev(), {r.N, r.k});
    r.perm = Tensor(buf(perm_), DType::i32, dev(), {padded_rows()});
    r.row_of = Tensor(buf(row_of_), DType::i32, dev(), {r.N * r.k});
    r.counts = static_cast<int64_t*>(buf(counts_));
    r.offsets = r.counts + r.E;
    r.row_align = row_align_;
    return r;
  }

  // Sorted rows the buffers hold: N k pairs plus the padding of E runs (row_align_).
  int64_t padded_rows() const {
    return env_.N * spec_.top_k + (row_align_ > 1 ? spec_.num_experts * (row_align_ - 1) : 0);
  }

  // The per-expert row counts then offsets ([2E + 1]) on the host: read in
  // place on the CPU; a device backend copies them once per layer, in forward
  // (Backend::moe_read_counts: the one host wait the layer adds; under
  // expert parallelism it also covers the counts exchange), and backward
  // reuses that copy — the routing it inverts is the one its forward (or the
  // replayed forward under recompute = "full") read.
  const int64_t* expert_rows(const MoeRouting& r, bool read) {
    if (dev() == Device::cpu) return r.counts;
    if (read) env_.backend->moe_read_counts(host_counts_.data(), r);
    return host_counts_.data();
  }

  // Expert e's matrix j (kW1, kW3, kW2), or its gradient: in the layer's
  // unit, or (expert parallelism) in the experts unit, of which this rank
  // holds its experts' range [optim_begin, optim_begin + optim_numel).
  Tensor expert(const UnitState& u, int64_t e, int j, bool grad = false) const {
    return expert_matrices(u, e, j, 1, grad);
  }
  // Expert e's [w1; w3] as one [2f, h] matrix (or its gradient).
  Tensor expert_w13(const UnitState& u, int64_t e, bool grad = false) const {
    return expert_matrices(u, e, kW1, 2, grad);
  }
  // Matrices j .. j + count - 1 of expert e, consecutive and of one row width, as one matrix.
  Tensor expert_matrices(const UnitState& u, int64_t e, int j, int count, bool grad) const {
    if (!experts_apart_) return param_rows(u, kFirstExpert + 3 * static_cast<int>(e) + j, count, grad);
    const UnitState* x = experts_unit_;
    LOOM_CHECK(x != nullptr, "ffn.moe layer ", layer_, ": the model set no experts unit");
    const auto& ps = x->info->params;
    const ParamInfo& p = ps[static_cast<size_t>(3 * e + j)];
    int64_t rows = 0, numel = 0;
    for (int i = 0; i < count; ++i) {
      const ParamInfo& q = ps[static_cast<size_t>(3 * e + j + i)];
      LOOM_CHECK(q.shape[1] == p.shape[1] && q.offset == p.offset + numel, "ffn.moe layer ", layer_, ": ", p.name,
                 " .. ", q.name, " are not one contiguous matrix");
      rows += q.shape[0];
      numel += q.numel;
    }
    const int64_t lo = p.offset - x->layout.optim_begin;
    LOOM_CHECK(lo >= 0 && lo + numel <= x->layout.optim_numel, "ffn.moe layer ", layer_, ": expert ", e,
               " is not held on this rank (", p.name, ")");
    return view(grad ? x->grads : x->params, lo, {rows, p.shape[1]});
  }

  // Rows the experts run on: the sorted local ones, or those received.
  int64_t expert_side_rows() const { return ep_ ? ep_->max_recv_rows() : padded_rows(); }

  // The experts' runs of rows: every expert with rows, over the sorted rows
  // (rows: counts then offsets; a run spans its count padded to row_align_,
  // the padding rows zero); under expert parallelism, the received ones.
  // (No allocation in the step: the list's capacity is set in plan().)
  const std::vector<ExpertExchange::Segment>& segments(const int64_t* rows) {
    if (ep_) return ep_->segments();
    local_segments_.clear();
    const int64_t E = spec_.num_experts;
    for (int64_t e = 0; e < E; ++e)
      if (rows[e] > 0) {
        const int64_t r0 = rows[E + e];
        local_segments_.push_back({e, r0, rows[E + e + 1] - r0, r0, true});
      }
    return local_segments_;
  }

  // Runs `run` on every segment of the layer, forward (grad false) or
  // backward, around the dispatch queued before it: the first half of this
  // rank's own rows while the dispatch travels, the other ranks' rows once
  // it has arrived, then `give_back` queues the return and the second half
  // of the own rows runs while it travels; the compute queue waits for it
  // last. Without expert parallelism: every segment, in order.
  template <typename Run, typename GiveBack>
  void run_segments(const int64_t* rows, bool grad, const Run& run, const GiveBack& give_back) {
    Backend& be = *env_.backend;
    const std::vector<ExpertExchange::Segment>& segs = segments(rows);
    int64_t own = 0;
    for (const ExpertExchange::Segment& sg : segs)
      if (sg.local) own += sg.rows;
    // The own segments that start before half of the own rows run first.
    const auto own_half = [&](bool first_half) {
      int64_t before = 0;
      for (const ExpertExchange::Segment& sg : segs) {
        if (!sg.local) continue;
        const bool first = 2 * before < own;
        before += sg.rows;
        if (first == first_half) run(sg);
      }
    };
    own_half(true);
    if (ep_) {
      {
        Range x(be, grad ? "ep.dispatch.grad.wait" : "ep.dispatch.wait");
        ep_->wait();
      }
      for (const ExpertExchange::Segment& sg : segs)
        if (!sg.local) run(sg);
      Range x(be, grad ? "ep.return.grad" : "ep.return");
      give_back();
    }
    own_half(false);
    if (ep_) {
      Range x(be, grad ? "ep.return.grad.wait" : "ep.return.wait");
      ep_->wait();
    }
  }

  // Rows [r0, r0 + m) of a packed [rows, cols] matrix.
  static Tensor rows_of(const Tensor& t, int64_t r0, int64_t m) {
    return view(t, r0 * t.size(1), {m, t.size(1)});
  }

  MoeAuxLoss* aux_ = nullptr;  // the model's, shared by every layer
  int ln2_ = -1, rstd2_ = -1, noise_ = -1, xin_ = -1, logits_ = -1, probs_ = -1, weights_ = -1, experts_ = -1;
  int perm_ = -1, row_of_ = -1, counts_ = -1, xs_ = -1, gu_ = -1, act_ = -1, eout_ = -1, tmp_ = -1;
  int d_ln_ = -1, d_eout_ = -1, d_act_ = -1, d_gu_ = -1, d_xs_ = -1, d_weights_ = -1, d_probs_ = -1;
  int d_logits_ = -1, xr_ = -1, eout_r_ = -1, d_xr_ = -1, d_eout_r_ = -1, ep_counts_ = -1;
  std::unique_ptr<ExpertExchange> ep_;  // expert parallelism (null: this rank runs every expert)
  bool experts_apart_ = false;           // the experts are in their own unit (expert parallelism)
  const UnitState* experts_unit_ = nullptr;  // that unit's state
  std::vector<ExpertExchange::Segment> local_segments_;  // segments() without expert parallelism
  std::vector<int> w13_, w2_;  // per expert: the [w1; w3] linear and the w2 linear
  std::vector<int64_t> host_counts_;
  std::vector<char> expert_written_;  // per expert: its weight gradients have this micro-batch's first rows
  bool jittered_ = false;  // the last forward applied jitter (what backward inverts)
  int64_t row_align_ = 1;  // MoeRouting::row_align of this block's sorted rows
};

BlockFloor moe_floor(const FloorEnv& env) {
  using LD = long double;
  const ModelSpec& s = *env.spec;
  const LD h = static_cast<LD>(s.hidden), F = static_cast<LD>(s.ffn_hidden), E = static_cast<LD>(s.num_experts);
  BlockFloor f;
  f.params = h + E * (h + 3 * h * F);  // the norm, the router [E, h], E experts of 3 matrices
  f.tensors = 2 + 3 * s.num_experts;
  // One layer's gate and up of every routed (token, slot) row; with expert
  // parallelism the rows a rank's experts receive, which may be none.
  f.activations = env.expert_parallel == 1 ? 2 * env.tokens * static_cast<LD>(s.top_k) * F : 0;
  return f;
}

}  // namespace

extern const FfnVariant ffn_moe;  // blocks/block_table.cpp's table lists it
const FfnVariant ffn_moe{
    "moe",  // with either attention variant
    [](const ModelSpec& spec, int64_t layer) -> std::unique_ptr<FfnBlock> { return std::make_unique<MoeFfn>(spec, layer); },
    moe_floor,
};

}  // namespace loom
