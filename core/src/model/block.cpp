#include "loom/block.hpp"

#include <algorithm>
#include <cmath>

#include "loom/error.hpp"

namespace loom {

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::none;
  if (s == "selective") return Recompute::selective;
  if (s == "attention") return Recompute::attention;
  if (s == "full") return Recompute::full;
  throw Error(cat("model.recompute = \"", s, "\" is not one of: none, selective, attention, full"));
}

int BlockEnv::register_linear(const LinearDesc& desc) const {
  const int id = precision->register_linear(desc);
  if (linear_ids) linear_ids->push_back(id);
  return id;
}

LinearDesc BlockEnv::layer_linear(std::string name, int64_t in, int64_t out) const {
  LinearDesc d;
  d.name = std::move(name);
  d.in = in;
  d.out = out;
  d.max_rows = N;
  d.input_in_backward = recompute == Recompute::selective;
  return d;
}

BlockEnv::InputPlan BlockEnv::input_plan(std::initializer_list<int> ids) const {
  InputPlan p;
  p.kept_by_recipe = keeps_wgrad_input(ids);
  p.recomputed = !p.kept_by_recipe && recompute == Recompute::selective;
  return p;
}

bool BlockEnv::keeps_wgrad_input(std::initializer_list<int> ids) const {
  for (int id : ids)
    if (!precision->keeps_wgrad_input(id)) return false;
  return true;
}

AttentionShape BlockEnv::attention_shape() const {
  AttentionShape a;
  a.batch = B;
  a.seq = S;
  a.heads = spec->num_heads;
  a.kv_heads = spec->num_kv_heads;
  a.head_dim = spec->head_dim();
  a.causal = true;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.head_dim)));
  a.documents = document_attention;
  a.spans = document_attention ? documents : nullptr;
  return a;
}

void BlockEnv::rope(Tensor& x, double theta, bool backward) const {
  if (document_positions) {
    LOOM_CHECK(documents != nullptr, "rope: train.reset_position_ids without the model's document spans");
    if (backward) backend->rope_backward_at(x, theta, documents->positions);
    else backend->rope_forward_at(x, theta, documents->positions);
    return;
  }
  if (backward) backend->rope_backward(x, theta);
  else backend->rope_forward(x, theta);
}

// ---------------------------------------------------------------------------

int ActivationPlan::own(const std::string& name, size_t bytes) {
  entries_.push_back({name, bytes, MemCategory::activations});
  return static_cast<int>(entries_.size()) - 1;
}

int ActivationPlan::shared(const std::string& name, size_t bytes) {
  auto it = shared_index_.find(name);
  if (it != shared_index_.end()) {
    Entry& e = entries_[static_cast<size_t>(it->second)];
    e.bytes = std::max(e.bytes, bytes);
    return it->second;
  }
  const int id = own(name, bytes);
  shared_index_[name] = id;
  return id;
}

int ActivationPlan::kept(const std::string& name, int64_t layer, size_t bytes, bool recompute_full) {
  return recompute_full ? shared(name + ".shared", bytes) : own(name + "." + std::to_string(layer), bytes);
}

void ActivationPlan::add_to(ArenaPlan& plan) {
  blocks_.clear();
  for (const Entry& e : entries_) blocks_.push_back(plan.add(e.name, e.category, e.bytes));
}

void ActivationPlan::bind(const Arena& arena) {
  LOOM_CHECK(blocks_.size() == entries_.size(), "activation plan bound before add_to()");
  ptrs_.clear();
  for (size_t b : blocks_) ptrs_.push_back(arena.ptr(b));
}

// ---------------------------------------------------------------------------

int Block::add_param(UnitInfo& unit, std::string name, std::vector<int64_t> shape, ParamRole role) {
  ParamInfo p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.numel = 1;
  for (int64_t d : p.shape) p.numel *= d;
  p.offset = unit.numel;
  p.role = role;
  unit.numel += p.numel;
  spans_.emplace_back(p.offset, p.numel);
  unit.params.push_back(std::move(p));
  params_.push_back(static_cast<int>(unit.params.size()) - 1);
  unit_name_ = unit.name;
  return static_cast<int>(params_.size()) - 1;
}

int Block::register_weight_linear(const BlockEnv& env, const LinearDesc& desc, int first, int count) const {
  const int id = env.register_linear(desc);
  if (env.linear_weights) {
    LOOM_CHECK(first >= 0 && count >= 1 && static_cast<size_t>(first + count) <= spans_.size(), kind(), ": linear ",
               desc.name, " names parameters ", first, " .. ", first + count - 1, " of ", spans_.size());
    int64_t numel = 0;
    for (int i = first; i < first + count; ++i) numel += spans_[static_cast<size_t>(i)].second;
    LOOM_CHECK(numel == desc.in * desc.out, kind(), ": linear ", desc.name, " is ", desc.out, " x ", desc.in,
               " but its parameters hold ", numel, " elements");
    env.linear_weights->push_back({id, unit_name_, spans_[static_cast<size_t>(first)].first, numel});
  }
  return id;
}

Tensor Block::param(const UnitState& u, int index, bool grad) const {
  const ParamInfo& p = u.info->params[static_cast<size_t>(params_[static_cast<size_t>(index)])];
  const Tensor& flat = grad ? u.grads : u.params;
  if (p.shape.size() == 1) return view(flat, p.offset, {p.shape[0]});
  return view(flat, p.offset, {p.shape[0], p.shape[1]});
}

Tensor Block::param_rows(const UnitState& u, int first, int count, bool grad) const {
  const auto& all = u.info->params;
  const ParamInfo& a = all[static_cast<size_t>(params_[static_cast<size_t>(first)])];
  int64_t rows = 0;
  for (int i = first; i < first + count; ++i) {
    const ParamInfo& p = all[static_cast<size_t>(params_[static_cast<size_t>(i)])];
    // Declared consecutively by the block itself, so this holds by construction.
    LOOM_CHECK(p.shape.size() == 2 && p.shape[1] == a.shape[1] && p.offset == a.offset + rows * a.shape[1], kind(),
               ": parameters ", a.name, " .. ", p.name, " are not one contiguous matrix");
    rows += p.shape[0];
  }
  const Tensor& flat = grad ? u.grads : u.params;
  return view(flat, a.offset, {rows, a.shape[1]});
}

bool Block::fp8_input(int linear, bool x_kept_by_recipe, Fp8Operand* op) const {
  const bool fp8 = env_.precision->fp8_operand(env_.backend->ctx(), linear, Fp8OperandRole::x, env_.N, op);
  LOOM_CHECK(!fp8 || x_kept_by_recipe, "precision recipe handed out an FP8 x for linear ", linear, " of ", unit_name_,
             " (", kind(), ") but does not keep that linear's wgrad input (keeps_wgrad_input): "
             "Precision::fp8_operand may offer x only for linears whose x it keeps itself");
  return fp8;
}

float* Block::operand_amax(int linear, Fp8OperandRole role) const {
  auto* p = dynamic_cast<Fp8OperandAmax*>(env_.precision);
  return p != nullptr ? p->operand_amax(env_.backend->ctx(), linear, role, env_.N) : nullptr;
}

bool Block::recast_input(int linear, Fp8Operand* op) const {
  auto* p = dynamic_cast<Fp8RecastOperand*>(env_.precision);
  return p != nullptr && p->recast_operand(env_.backend->ctx(), linear, env_.N, op);
}

Tensor Block::rmsnorm_for(int linear, bool x_kept_by_recipe, const Tensor& ln, Tensor& rstd, const Tensor& x,
                          const Tensor& w, float eps) const {
  Backend& be = *env_.backend;
  Fp8Operand q;
  if (fp8_input(linear, x_kept_by_recipe, &q)) {
    be.rmsnorm_forward_fp8(q, rstd, x, w, eps);
    return q.q;
  }
  Tensor out = ln;
  if (float* amax = operand_amax(linear, Fp8OperandRole::x)) be.rmsnorm_forward_amax(out, rstd, x, w, eps, amax);
  else be.rmsnorm_forward(out, rstd, x, w, eps);
  return out;
}

Tensor Block::recompute_rmsnorm_for(int linear, const Tensor& ln, Tensor& rstd, const Tensor& x, const Tensor& w,
                                    float eps) const {
  Backend& be = *env_.backend;
  Fp8Operand q;
  if (recast_input(linear, &q)) {  // the wgrad's xᵀ in FP8, no bf16 copy of the norm's output
    be.rmsnorm_forward_fp8(q, rstd, x, w, eps);
    return q.q_t;
  }
  Tensor out = ln;
  be.rmsnorm_forward(out, rstd, x, w, eps);
  return out;
}

Fp8OperandAmax::~Fp8OperandAmax() = default;
Fp8RecastOperand::~Fp8RecastOperand() = default;

Tensor Block::column_half(const Tensor& packed, int which) {
  LOOM_CHECK(packed.ndim == 2 && packed.size(1) % 2 == 0 && (which == 0 || which == 1),
             "column_half: a [rows, 2f] view and half 0 or 1, got ", packed.shape_str(), " and ", which);
  const int64_t f = packed.size(1) / 2;
  Tensor v(static_cast<char*>(packed.data) + which * f * static_cast<int64_t>(dtype_size(packed.dtype)), packed.dtype,
           packed.device, {packed.size(0), f});
  v.stride[0] = packed.stride[0];
  return v;
}

void AttentionBlock::declare(UnitInfo& u) {
  const std::string p = "model.layers." + std::to_string(layer_) + ".";
  add_param(u, p + "input_layernorm.weight", {spec_.hidden}, ParamRole::norm_gain);
  add_param(u, p + "self_attn.q_proj.weight", {spec_.q_dim(), spec_.hidden}, ParamRole::matrix);
  add_param(u, p + "self_attn.k_proj.weight", {spec_.kv_dim(), spec_.hidden}, ParamRole::matrix);
  add_param(u, p + "self_attn.v_proj.weight", {spec_.kv_dim(), spec_.hidden}, ParamRole::matrix);
  add_param(u, p + "self_attn.o_proj.weight", {spec_.hidden, spec_.q_dim()}, ParamRole::output_projection);
}

BlockFloor AttentionBlock::hf_floor(const FloorEnv& env) {
  using LD = long double;
  const ModelSpec& s = *env.spec;
  const LD h = static_cast<LD>(s.hidden), hd = static_cast<LD>(s.head_dim());
  const LD q = static_cast<LD>(s.num_heads) * hd, kv = static_cast<LD>(s.num_kv_heads) * hd;
  BlockFloor f;
  f.params = h + h * q + 2 * h * kv + q * h;
  f.tensors = 5;
  return f;
}

BlockFloor FfnBlock::hf_floor(const FloorEnv& env) {
  using LD = long double;
  const LD h = static_cast<LD>(env.spec->hidden), F = static_cast<LD>(env.spec->ffn_hidden);
  BlockFloor f;
  f.params = h + 3 * h * F;
  f.tensors = 4;
  f.activations = 2 * env.tokens * F;  // one layer's gate and up (shared by every layer under recompute = full)
  return f;
}

void FfnBlock::declare(UnitInfo& u) {
  const std::string p = "model.layers." + std::to_string(layer_) + ".";
  add_param(u, p + "post_attention_layernorm.weight", {spec_.hidden}, ParamRole::norm_gain);
  add_param(u, p + "mlp.gate_proj.weight", {spec_.ffn_hidden, spec_.hidden}, ParamRole::matrix);
  add_param(u, p + "mlp.up_proj.weight", {spec_.ffn_hidden, spec_.hidden}, ParamRole::matrix);
  add_param(u, p + "mlp.down_proj.weight", {spec_.hidden, spec_.ffn_hidden}, ParamRole::output_projection);
}

}  // namespace loom
