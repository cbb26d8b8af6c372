#include "train/fp8_gather.hpp"

#include <algorithm>

#include "loom/error.hpp"

namespace loom {

Fp8GatherCodec::Fp8GatherCodec(Backend& be, const std::vector<UnitInfo>& units,
                               const std::vector<LinearWeight>& weights, const Precision& precision,
                               DType param_dtype, std::string why_none)
    : be_(be), param_dtype_(param_dtype), why_none_(std::move(why_none)) {
  for (const UnitInfo& u : units) numel_.push_back(u.numel);
  bool have_margin = false;
  for (const LinearWeight& w : weights) {
    Fp8WeightCast cast;
    if (!precision.current_fp8_weight(w.id, &cast) || cast.dtype != DType::e4m3) continue;
    int unit = -1;
    for (size_t i = 0; i < units.size(); ++i)
      if (units[i].name == w.unit) unit = static_cast<int>(i);
    LOOM_CHECK(unit >= 0 && w.offset >= 0 && w.offset + w.numel <= units[static_cast<size_t>(unit)].numel,
               "FP8 gathers: linear ", w.id, " names unit '", w.unit, "' range [", w.offset, ", ",
               w.offset + w.numel, ") outside the model's units");
    if (units[static_cast<size_t>(unit)].expert_group > 1) continue;  // never gathered
    LOOM_CHECK(!have_margin || cast.margin == margin_, "FP8 gathers: the recipe casts weights with margins ",
               margin_, " and ", cast.margin, "; one margin is expected");
    margin_ = cast.margin;
    have_margin = true;
    weights_.push_back({unit, w.offset, w.numel});
  }
  std::sort(weights_.begin(), weights_.end(), [](const Weight& a, const Weight& b) {
    return a.unit != b.unit ? a.unit < b.unit : a.offset < b.offset;
  });
  for (size_t i = 1; i < weights_.size(); ++i)
    LOOM_CHECK(weights_[i].unit != weights_[i - 1].unit ||
                   weights_[i].offset >= weights_[i - 1].offset + weights_[i - 1].numel,
               "FP8 gathers: two linears' weights overlap in unit ", units[static_cast<size_t>(weights_[i].unit)].name);
  LOOM_CHECK(param_dtype == DType::f32 || param_dtype == DType::bf16, "FP8 gathers: parameters stored as ",
             dtype_name(param_dtype), " (fp32 or bf16 expected)");
}

void Fp8GatherCodec::bind(void* ptr) {
  const int64_t n = static_cast<int64_t>(weights_.size());
  if (n == 0) return;
  const Device d = be_.device();
  float* p = static_cast<float*>(ptr);
  amax_ = Tensor(p, DType::f32, d, {n});
  scale_ = Tensor(p + n, DType::f32, d, {n});
  scale_inv_ = Tensor(p + 2 * n, DType::f32, d, {n});
  const std::vector<float> ones(static_cast<size_t>(n), 1.0f);
  be_.upload(scale_, ones.data(), ones.size() * sizeof(float));
  be_.upload(scale_inv_, ones.data(), ones.size() * sizeof(float));
  be_.zero(amax_);
}

void Fp8GatherCodec::plan(int group, int position, const std::vector<int64_t>& chunk) {
  LOOM_CHECK(group >= 1 && position >= 0 && position < group && chunk.size() == numel_.size(),
             "FP8 gathers: planned for ", chunk.size(), " units of ", numel_.size(), ", position ", position,
             " of ", group);
  group_ = group;
  position_ = position;
  chunk_ = chunk;
  const int64_t esize = static_cast<int64_t>(dtype_size(param_dtype_));
  segments_.assign(numel_.size(), {});
  wire_bytes_.assign(numel_.size(), 0);
  for (size_t u = 0; u < numel_.size(); ++u) {
    const int64_t c = chunk_[u];
    if (c <= 0) continue;
    // The unit as intervals: its FP8 weights and the gaps between them.
    std::vector<Segment> parts;
    int64_t at = 0;
    for (size_t w = 0; w < weights_.size(); ++w) {
      if (weights_[w].unit != static_cast<int>(u)) continue;
      if (weights_[w].offset > at) parts.push_back({at, weights_[w].offset, -1, 0});
      parts.push_back({weights_[w].offset, weights_[w].offset + weights_[w].numel, static_cast<int>(w), 0});
      at = weights_[w].offset + weights_[w].numel;
    }
    if (at < numel_[u]) parts.push_back({at, numel_[u], -1, 0});
    auto& per_rank = segments_[u];
    per_rank.assign(static_cast<size_t>(group), {});
    int64_t most = 0;
    for (int r = 0; r < group; ++r) {
      const int64_t lo = r * c, hi = std::min(numel_[u], (r + 1) * c);
      std::vector<Segment>& segs = per_rank[static_cast<size_t>(r)];
      for (const Segment& p : parts) {
        const int64_t a = std::max(lo, p.lo), b = std::min(hi, p.hi);
        if (a < b) segs.push_back({a, b, p.weight, 0});
      }
      // Elements in the parameter dtype first (aligned to their size), then codes.
      int64_t bytes = 0;
      for (Segment& s : segs)
        if (s.weight < 0) s.wire = bytes, bytes += (s.hi - s.lo) * esize;
      for (Segment& s : segs)
        if (s.weight >= 0) s.wire = bytes, bytes += s.hi - s.lo;
      most = std::max(most, bytes);
    }
    // Chunks start 16-byte aligned in the gathered buffer.
    wire_bytes_[u] = (most + 15) / 16 * 16;
  }
}

int64_t Fp8GatherCodec::wire_chunk_bytes(int unit) const {
  LOOM_CHECK(unit >= 0 && static_cast<size_t>(unit) < wire_bytes_.size(), "FP8 gathers: unit ", unit,
             " was not planned");
  return wire_bytes_[static_cast<size_t>(unit)];
}

Tensor Fp8GatherCodec::wire_view(const Tensor& wire, int64_t byte, int64_t n, DType dt) const {
  LOOM_CHECK(byte >= 0 && byte + n * static_cast<int64_t>(dtype_size(dt)) <= static_cast<int64_t>(wire.bytes()),
             "FP8 gathers: wire range [", byte, ", +", n, " x ", dtype_name(dt), ") outside a ", wire.bytes(),
             "-byte buffer");
  return Tensor(static_cast<char*>(wire.data) + byte, dt, wire.device, {n});
}

Tensor Fp8GatherCodec::f32_slot(const Tensor& t, int i) const { return view(t, i, {1}); }

void Fp8GatherCodec::encode(const ExecContext& ctx, Communicator& group, const std::vector<UnitState>& units,
                            std::vector<Tensor>& wire) {
  LOOM_CHECK(!weights_.empty() && !segments_.empty() && wire.size() == units.size(),
             "FP8 gathers: encode before plan() or without FP8 weights");
  LOOM_CHECK(group.size() == group_, "FP8 gathers: planned for a group of ", group_, " ranks, encoding over ",
             group.size());
  // Every weight's amax over the whole weight: this rank's ranges, then the group's max.
  be_.zero(amax_);
  for (const UnitState& u : units) {
    const size_t ui = static_cast<size_t>(u.index);
    if (chunk_[ui] <= 0) continue;
    const int64_t base = static_cast<int64_t>(position_) * chunk_[ui];
    for (const Segment& s : segments_[ui][static_cast<size_t>(position_)]) {
      if (s.weight < 0) continue;
      Tensor a = f32_slot(amax_, s.weight);
      be_.fp8_amax(a, view(u.param_shard, s.lo - base, {s.hi - s.lo}));
    }
  }
  if (group.size() > 1) group.wait(ctx, group.all_reduce(ctx, amax_, ReduceOp::max));
  be_.fp8_scales(scale_, scale_inv_, amax_, margin_);
  for (const UnitState& u : units) {
    const size_t ui = static_cast<size_t>(u.index);
    if (chunk_[ui] <= 0) continue;
    Tensor& out = wire[ui];
    LOOM_CHECK(static_cast<int64_t>(out.bytes()) >= wire_bytes_[ui], "FP8 gathers: unit ", u.info->name,
               " wire shard of ", out.bytes(), " bytes, ", wire_bytes_[ui], " needed");
    const int64_t base = static_cast<int64_t>(position_) * chunk_[ui];
    for (const Segment& s : segments_[ui][static_cast<size_t>(position_)]) {
      const Tensor src = view(u.param_shard, s.lo - base, {s.hi - s.lo});
      if (s.weight < 0) {
        Tensor dst = wire_view(out, s.wire, s.hi - s.lo, param_dtype_);
        be_.copy(dst, src);
      } else {
        Tensor q = wire_view(out, s.wire, s.hi - s.lo, DType::e4m3);
        be_.fp8_encode(q, src, f32_slot(scale_, s.weight));
      }
    }
  }
}

void Fp8GatherCodec::decode(const ExecContext& /*ctx*/, int unit, const Tensor& wire, Tensor& params) {
  const size_t ui = static_cast<size_t>(unit);
  LOOM_CHECK(ui < segments_.size() && chunk_[ui] > 0, "FP8 gathers: unit ", unit, " is not gathered");
  LOOM_CHECK(static_cast<int64_t>(wire.bytes()) >= group_ * wire_bytes_[ui], "FP8 gathers: unit ", unit,
             " gathered into ", wire.bytes(), " bytes, ", group_ * wire_bytes_[ui], " expected");
  for (int r = 0; r < group_; ++r) {
    const int64_t at = static_cast<int64_t>(r) * wire_bytes_[ui];
    for (const Segment& s : segments_[ui][static_cast<size_t>(r)]) {
      Tensor dst = view(params, s.lo, {s.hi - s.lo});
      if (s.weight < 0) {
        be_.copy(dst, wire_view(wire, at + s.wire, s.hi - s.lo, param_dtype_));
      } else {
        be_.fp8_decode(dst, wire_view(wire, at + s.wire, s.hi - s.lo, DType::e4m3), f32_slot(scale_, s.weight));
      }
    }
  }
}

}  // namespace loom
