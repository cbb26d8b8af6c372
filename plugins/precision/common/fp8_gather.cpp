// The FP8 weight gathers' codec (fp8_gather.hpp) and its host casts. Free of
// CUDA: the device casts are fp8_gather_gpu.cpp.
#include "precision/common/fp8_gather.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "loom/error.hpp"
#include "loom/fp8.hpp"

namespace loom::fp8_gather {
namespace {

// ---- the host casts (loom/fp8.hpp), fp32 host tensors ----

float* host_f32(const Tensor& t, const char* what) {
  LOOM_CHECK(t.device == Device::cpu, "FP8 gathers: ", what, ": tensor ", t.shape_str(), " is on ",
             device_name(t.device), ", the CPU path needs host memory");
  LOOM_CHECK(t.dtype == DType::f32, "FP8 gathers: ", what, ": the CPU path computes in fp32, got ",
             dtype_name(t.dtype), " ", t.shape_str());
  return static_cast<float*>(t.data);
}

uint8_t* host_e4m3(const Tensor& t, int64_t numel, const char* what) {
  LOOM_CHECK(t.device == Device::cpu && t.dtype == DType::e4m3 && t.numel() == numel, "FP8 gathers: ", what,
             ": expected ", numel, " e4m3 codes in host memory, got ", dtype_name(t.dtype), " ", t.shape_str(),
             " on ", device_name(t.device));
  return static_cast<uint8_t*>(t.data);
}

class HostOps final : public Ops {
 public:
  void fill(Tensor& t, float v) override {
    float* p = host_f32(t, "fill");
    std::fill(p, p + t.numel(), v);
  }
  void zero(const ExecContext& /*ctx*/, Tensor& t) override {
    host_f32(t, "zero");
    std::memset(t.data, 0, t.bytes());
  }
  void copy(const ExecContext& /*ctx*/, Tensor& dst, const Tensor& src) override {
    LOOM_CHECK(dst.device == Device::cpu && src.device == Device::cpu && dst.bytes() == src.bytes(),
               "FP8 gathers: copy ", src.shape_str(), " (", dtype_name(src.dtype), ", ", device_name(src.device),
               ") -> ", dst.shape_str(), " (", dtype_name(dst.dtype), ", ", device_name(dst.device), ")");
    if (src.bytes() > 0 && dst.data != src.data) std::memcpy(dst.data, src.data, src.bytes());
  }
  void amax(const ExecContext& /*ctx*/, Tensor& amax, const Tensor& x) override {
    float* a = host_f32(amax, "amax");
    float m = fp8::amax(host_f32(x, "amax x"), x.numel());
    if (fp8::is_nan(m)) m = INFINITY;  // recorded as +inf, as the device casts do
    a[0] = std::max(a[0], m);
  }
  void scales(const ExecContext& /*ctx*/, Tensor& scale, Tensor& scale_inv, const Tensor& amax, int margin) override {
    LOOM_CHECK(scale.numel() == amax.numel() && scale_inv.numel() == amax.numel(), "FP8 gathers: scales: scale ",
               scale.shape_str(), ", scale_inv ", scale_inv.shape_str(), " and amax ", amax.shape_str(), " differ");
    float* s = host_f32(scale, "scales scale");
    float* si = host_f32(scale_inv, "scales scale_inv");
    const float* a = host_f32(amax, "scales amax");
    for (int64_t i = 0; i < amax.numel(); ++i) {
      s[i] = fp8::compute_scale(a[i], fp8::kE4M3Max, margin, s[i]).scale;
      si[i] = 1.0f / s[i];
    }
  }
  void encode(const ExecContext& /*ctx*/, Tensor& q, const Tensor& x, const Tensor& scale) override {
    const float* src = host_f32(x, "encode x");
    fp8::quantize(src, x.numel(), host_f32(scale, "encode scale")[0], fp8::Format::e4m3,
                  host_e4m3(q, x.numel(), "encode q"));
  }
  void decode(const ExecContext& /*ctx*/, Tensor& y, const Tensor& q, const Tensor& scale) override {
    float* dst = host_f32(y, "decode y");
    fp8::dequantize(host_e4m3(q, y.numel(), "decode q"), y.numel(), host_f32(scale, "decode scale")[0],
                    fp8::Format::e4m3, dst);
  }
};

// ---- the codec ----

constexpr int64_t kCodesAlign = 256;  // bytes: DirectCodes' weights start so far into an aligned unit
// A unit of FP8 weights moves them in place (the codes layout, fp8_gather.hpp)
// when its other elements are at most 1 / kOthersShare of it: those travel
// once per encode to every rank of the group, whose copy of them all stays
// small (a decoder layer's norm gains: 8,192 of 218M elements in Llama 3 8B).
constexpr int64_t kOthersShare = 256;

class Fp8GatherCodec final : public GatherCodec, public GatherCodecPlainUnits, public DirectCodes {
 public:
  Fp8GatherCodec(const GatherCodecSetup& setup, const CastsFromCurrentAmax& casts, std::unique_ptr<Ops> ops,
                 const std::string& plugin);

  int fp8_weights() const override { return static_cast<int>(weights_.size()); }
  std::string why_none() const override { return why_none_; }
  void plan(int group, int position, const std::vector<int64_t>& chunk) override;
  int64_t wire_chunk_bytes(int unit) const override;
  // A gathered unit none of whose weights this recipe casts per tensor (the
  // embedding; the LM head unless it is FP8): its wire would be its
  // parameters as they are.
  bool gathers_as_params(int unit) const override {
    LOOM_CHECK(unit >= 0 && static_cast<size_t>(unit) < chunk_.size(), "FP8 gathers: unit ", unit,
               " was not planned");
    return chunk_[static_cast<size_t>(unit)] > 0 &&
           std::none_of(weights_.begin(), weights_.end(), [&](const Weight& w) { return w.unit == unit; });
  }
  // Once a strategy planned gathers through this codec (plan() was called):
  // the amaxes and scales, 3 fp32 per FP8 weight; then the other elements of
  // the units in the codes layout, this rank's and the group's gathered.
  size_t state_bytes() const override {
    return segments_.empty() ? 0 : scale_bytes() + others_bytes() * static_cast<size_t>(1 + group_);
  }
  // Binds that memory and sets every scale to 1.
  void bind(void* ptr) override;
  void encode(const ExecContext& ctx, Communicator& group, const std::vector<UnitState>& units,
              std::vector<Tensor>& wire) override;
  void decode(const ExecContext& ctx, int unit, const Tensor& wire, Tensor& params) override;

  void set_direct(bool on) override { direct_ = on; }
  bool holds_codes(int id) const override {
    const int w = weight_of(id);
    if (!direct_ || w < 0 || segments_.empty()) return false;
    const Weight& x = weights_[static_cast<size_t>(w)];
    return chunk_[static_cast<size_t>(x.unit)] > 0 && (in_wire(x) || x.codes_aligned);
  }
  const void* codes(int id, const void* place) const override;
  const float* amax(int id) const override { return state_of(amax_, id); }
  const float* scale(int id) const override { return state_of(scale_, id); }
  const float* scale_inv(int id) const override { return state_of(scale_inv_, id); }

 private:
  struct Weight {
    int unit = 0;
    int64_t offset = 0, numel = 0;
    int id = -1;  // the linear's
    // The weight's place starts 256 bytes into an aligned unit: where the
    // GEMMs read its codes in place, their pointer is as aligned as the
    // recipe's own scratch (cuBLASLt picks its kernels by alignment), so the
    // run is the same to the bit. Other weights are decoded.
    bool codes_aligned = false;
    // The last decode of its unit (direct): the weight's place in the params
    // it wrote, and where its codes are (in the wire, or that place).
    const void* place = nullptr;
    const void* at = nullptr;
  };
  // Direct and in the codes layout at a 256-byte offset: the GEMMs read the
  // weight's codes in the gathered wire (256-byte aligned, as arena buffers).
  bool in_wire(const Weight& w) const {
    return direct_ && codes_unit_[static_cast<size_t>(w.unit)] && w.offset % kCodesAlign == 0;
  }
  size_t scale_bytes() const { return (weights_.size() * 3 * sizeof(float) + 255) / 256 * 256; }
  size_t others_bytes() const { return static_cast<size_t>(others_) * dtype_size(param_dtype_); }
  int weight_of(int id) const {
    return id >= 0 && static_cast<size_t>(id) < weight_of_id_.size() ? weight_of_id_[static_cast<size_t>(id)] : -1;
  }
  const float* state_of(const Tensor& t, int id) const {
    const int w = weight_of(id);
    LOOM_CHECK(w >= 0 && t.data != nullptr, "FP8 gathers: linear ", id,
               w < 0 ? " has no weight moved in FP8" : "'s scale asked before bind()");
    return static_cast<const float*>(t.data) + w;
  }
  // [lo, hi) of the flat unit; weight: index into weights_ or -1 (moved as it
  // is); wire: byte offset inside its chunk, but for a non-FP8 segment of a
  // unit in the codes layout its element offset in the unit's block of the
  // others buffers (others_at_).
  struct Segment {
    int64_t lo = 0, hi = 0;
    int weight = -1;
    int64_t wire = 0;
  };
  Tensor wire_view(const Tensor& wire, int64_t byte, int64_t n, DType dt) const;
  static Tensor f32_slot(const Tensor& t, int i) { return view(t, i, {1}); }

  std::unique_ptr<Ops> ops_;
  DType param_dtype_;
  Device device_;
  std::string why_none_;
  int margin_ = 0;
  std::vector<int64_t> numel_;  // per unit
  std::vector<Weight> weights_;
  int group_ = 1, position_ = 0;
  std::vector<int64_t> chunk_, wire_bytes_;
  std::vector<std::vector<std::vector<Segment>>> segments_;  // [unit][rank]
  std::vector<char> codes_unit_;  // per unit: in the codes layout
  std::vector<int64_t> others_at_;  // per unit in it: its block's element offset in a rank's others
  int64_t others_ = 0;              // elements of each rank's others (a multiple of 8)
  Tensor others_own_, others_all_;  // [others_] this rank's; [group * others_] every rank's, gathered by encode()
  Tensor amax_, scale_, scale_inv_;
  std::vector<int> weight_of_id_;  // linear id -> index in weights_, or -1
  bool direct_ = false;            // DirectCodes: decode() leaves the FP8 weights as codes
};

Fp8GatherCodec::Fp8GatherCodec(const GatherCodecSetup& setup, const CastsFromCurrentAmax& casts,
                               std::unique_ptr<Ops> ops, const std::string& plugin)
    : ops_(std::move(ops)),
      param_dtype_(setup.param_dtype),
      device_(setup.device),
      why_none_(cat("precision.plugin = \"", plugin,
                    "\" casts none of this model's gathered decoder weights to FP8 per tensor from its current "
                    "amax (it keeps the LM head, variable-row linears such as MoE experts and linears whose rows "
                    "its FP8 GEMMs cannot take out of FP8)")) {
  LOOM_CHECK(ops_ != nullptr, "FP8 gathers: precision ", plugin, " built a codec without its casts");
  const std::vector<UnitInfo>& units = setup.units;
  for (const UnitInfo& u : units) numel_.push_back(u.numel);
  bool have_margin = false;
  for (const LinearWeight& w : setup.weights) {
    int margin = 0;
    if (!casts(w.id, &margin)) continue;
    int unit = -1;
    for (size_t i = 0; i < units.size(); ++i)
      if (units[i].name == w.unit) unit = static_cast<int>(i);
    LOOM_CHECK(unit >= 0 && w.offset >= 0 && w.offset + w.numel <= units[static_cast<size_t>(unit)].numel,
               "FP8 gathers: linear ", w.id, " names unit '", w.unit, "' range [", w.offset, ", ",
               w.offset + w.numel, ") outside the model's units");
    if (units[static_cast<size_t>(unit)].expert_group > 1) continue;  // never gathered
    LOOM_CHECK(!have_margin || margin == margin_, "FP8 gathers: precision ", plugin, " casts weights with margins ",
               margin_, " and ", margin, "; one margin is expected");
    margin_ = margin;
    have_margin = true;
    weights_.push_back({unit, w.offset, w.numel, w.id,
                        w.offset * static_cast<int64_t>(dtype_size(param_dtype_)) % kCodesAlign == 0});
  }
  std::sort(weights_.begin(), weights_.end(), [](const Weight& a, const Weight& b) {
    return a.unit != b.unit ? a.unit < b.unit : a.offset < b.offset;
  });
  for (size_t i = 0; i < weights_.size(); ++i) {
    const auto id = static_cast<size_t>(weights_[i].id);
    if (id >= weight_of_id_.size()) weight_of_id_.resize(id + 1, -1);
    weight_of_id_[id] = static_cast<int>(i);
  }
  for (size_t i = 1; i < weights_.size(); ++i)
    LOOM_CHECK(weights_[i].unit != weights_[i - 1].unit ||
                   weights_[i].offset >= weights_[i - 1].offset + weights_[i - 1].numel,
               "FP8 gathers: two linears' weights overlap in unit ", units[static_cast<size_t>(weights_[i].unit)].name);
  LOOM_CHECK(param_dtype_ == DType::f32 || param_dtype_ == DType::bf16, "FP8 gathers: parameters stored as ",
             dtype_name(param_dtype_), " (fp32 or bf16 expected)");
}

void Fp8GatherCodec::bind(void* ptr) {
  const int64_t n = static_cast<int64_t>(weights_.size());
  if (n == 0) return;
  LOOM_CHECK(ptr != nullptr, "FP8 gathers: bind() of ", state_bytes(), " bytes got no memory");
  float* p = static_cast<float*>(ptr);
  amax_ = Tensor(p, DType::f32, device_, {n});
  scale_ = Tensor(p + n, DType::f32, device_, {n});
  scale_inv_ = Tensor(p + 2 * n, DType::f32, device_, {n});
  ops_->fill(scale_, 1.0f);
  ops_->fill(scale_inv_, 1.0f);
  ops_->fill(amax_, 0.0f);
  if (others_ > 0) {
    char* o = static_cast<char*>(ptr) + scale_bytes();
    others_own_ = Tensor(o, param_dtype_, device_, {others_});
    others_all_ = Tensor(o + others_bytes(), param_dtype_, device_, {group_ * others_});
  }
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
  codes_unit_.assign(numel_.size(), 0);
  others_at_.assign(numel_.size(), 0);
  others_ = 0;
  for (size_t u = 0; u < numel_.size(); ++u) {
    const int64_t c = chunk_[u];
    if (c <= 0) continue;
    // The unit as intervals: its FP8 weights and the gaps between them.
    std::vector<Segment> parts;
    int64_t at = 0, fp8 = 0;
    for (size_t w = 0; w < weights_.size(); ++w) {
      if (weights_[w].unit != static_cast<int>(u)) continue;
      if (weights_[w].offset > at) parts.push_back({at, weights_[w].offset, -1, 0});
      parts.push_back({weights_[w].offset, weights_[w].offset + weights_[w].numel, static_cast<int>(w), 0});
      at = weights_[w].offset + weights_[w].numel;
      fp8 += weights_[w].numel;
    }
    if (at < numel_[u]) parts.push_back({at, numel_[u], -1, 0});
    const bool codes = fp8 > 0 && (numel_[u] - fp8) * kOthersShare <= numel_[u];
    codes_unit_[u] = codes;
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
      if (codes) {
        // Codes at their elements' bytes; the other elements in the unit's
        // block of the others, in flat order.
        int64_t n = 0;
        for (Segment& s : segs) {
          if (s.weight >= 0) s.wire = s.lo - lo;
          else s.wire = n, n += s.hi - s.lo;
        }
        most = std::max(most, n);
        continue;
      }
      // Elements in the parameter dtype first (aligned to their size), then codes.
      int64_t bytes = 0;
      for (Segment& s : segs)
        if (s.weight < 0) s.wire = bytes, bytes += (s.hi - s.lo) * esize;
      for (Segment& s : segs)
        if (s.weight >= 0) s.wire = bytes, bytes += s.hi - s.lo;
      most = std::max(most, bytes);
    }
    if (codes) {
      // Chunks follow each other byte for byte, so that a weight cut by a
      // chunk boundary is whole in the gathered wire.
      wire_bytes_[u] = c;
      others_at_[u] = others_;
      others_ += (most + 7) / 8 * 8;  // blocks 16-byte aligned in bf16, 32 in fp32
    } else {
      // Chunks start 16-byte aligned in the gathered buffer.
      wire_bytes_[u] = (most + 15) / 16 * 16;
    }
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

void Fp8GatherCodec::encode(const ExecContext& ctx, Communicator& group, const std::vector<UnitState>& units,
                            std::vector<Tensor>& wire) {
  LOOM_CHECK(!weights_.empty() && !segments_.empty() && wire.size() == units.size(),
             "FP8 gathers: encode before plan() or without FP8 weights");
  LOOM_CHECK(amax_.data != nullptr, "FP8 gathers: encode before bind()");
  LOOM_CHECK(group.size() == group_, "FP8 gathers: planned for a group of ", group_, " ranks, encoding over ",
             group.size());
  // Every weight's amax over the whole weight: this rank's ranges, then the group's max.
  ops_->zero(ctx, amax_);
  for (const UnitState& u : units) {
    const size_t ui = static_cast<size_t>(u.index);
    if (chunk_[ui] <= 0) continue;
    const int64_t base = static_cast<int64_t>(position_) * chunk_[ui];
    for (const Segment& s : segments_[ui][static_cast<size_t>(position_)]) {
      if (s.weight < 0) continue;
      Tensor a = f32_slot(amax_, s.weight);
      ops_->amax(ctx, a, view(u.param_shard, s.lo - base, {s.hi - s.lo}));
    }
  }
  if (group.size() > 1) group.wait(ctx, group.all_reduce(ctx, amax_, ReduceOp::max));
  ops_->scales(ctx, scale_, scale_inv_, amax_, margin_);
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
        Tensor dst = codes_unit_[ui] ? view(others_own_, others_at_[ui] + s.wire, {s.hi - s.lo})
                                     : wire_view(out, s.wire, s.hi - s.lo, param_dtype_);
        ops_->copy(ctx, dst, src);
      } else {
        Tensor q = wire_view(out, s.wire, s.hi - s.lo, DType::e4m3);
        ops_->encode(ctx, q, src, f32_slot(scale_, s.weight));
      }
    }
  }
  // The codes layout's other elements, to every rank of the group once per
  // encode (the decodes until the next one read them there).
  if (others_ > 0) {
    LOOM_CHECK(others_all_.data != nullptr, "FP8 gathers: encode before bind() gave the others their memory");
    if (group.size() > 1) group.wait(ctx, group.all_gather(ctx, others_own_, others_all_));
    else ops_->copy(ctx, others_all_, others_own_);
  }
}

const void* Fp8GatherCodec::codes(int id, const void* place) const {
  LOOM_CHECK(holds_codes(id), "FP8 gathers: the codes of linear ", id, " asked, but its gathers leave no codes");
  const Weight& w = weights_[static_cast<size_t>(weight_of(id))];
  LOOM_CHECK(w.place == place && w.at != nullptr, "FP8 gathers: the codes of linear ", id, " asked for parameters at ",
             place, ", but the last decode of its unit wrote ", w.place);
  return w.at;
}

void Fp8GatherCodec::decode(const ExecContext& ctx, int unit, const Tensor& wire, Tensor& params) {
  const size_t ui = static_cast<size_t>(unit);
  LOOM_CHECK(ui < segments_.size() && chunk_[ui] > 0, "FP8 gathers: unit ", unit, " is not gathered");
  LOOM_CHECK(static_cast<int64_t>(wire.bytes()) >= group_ * wire_bytes_[ui], "FP8 gathers: unit ", unit,
             " gathered into ", wire.bytes(), " bytes, ", group_ * wire_bytes_[ui], " expected");
  const bool codes_layout = codes_unit_[ui] != 0;
  if (codes_layout) LOOM_CHECK(others_ == 0 || others_all_.data != nullptr, "FP8 gathers: decode before bind()");
  const int64_t esize = static_cast<int64_t>(dtype_size(param_dtype_));
  for (int r = 0; r < group_; ++r) {
    const int64_t at = static_cast<int64_t>(r) * wire_bytes_[ui];
    for (const Segment& s : segments_[ui][static_cast<size_t>(r)]) {
      if (s.weight < 0) {  // moved in the parameter dtype
        Tensor dst = view(params, s.lo, {s.hi - s.lo});
        ops_->copy(ctx, dst,
                   codes_layout ? view(others_all_, r * others_ + others_at_[ui] + s.wire, {s.hi - s.lo})
                                : wire_view(wire, at + s.wire, s.hi - s.lo, param_dtype_));
        continue;
      }
      const Tensor codes = wire_view(wire, at + s.wire, s.hi - s.lo, DType::e4m3);
      Weight& w = weights_[static_cast<size_t>(s.weight)];
      char* place = static_cast<char*>(params.data) + w.offset * esize;
      if (in_wire(w)) {
        // Nothing to move: the weight's codes lie whole in the wire, from
        // byte w.offset (the chunks follow each other byte for byte).
        LOOM_CHECK(reinterpret_cast<uintptr_t>(wire.data) % kCodesAlign == 0, "FP8 gathers: unit ", unit,
                   "'s gathered wire at ", wire.data, " is not ", kCodesAlign,
                   "-byte aligned; the GEMMs would read its weights' codes misaligned");
        w.place = place;
        w.at = static_cast<const char*>(wire.data) + w.offset;
      } else if (direct_ && w.codes_aligned) {
        // The codes as they are, at the weight's place: byte (element of the
        // weight) after the weight's first byte.
        LOOM_CHECK(reinterpret_cast<uintptr_t>(params.data) % kCodesAlign == 0, "FP8 gathers: unit ", unit,
                   "'s parameters at ", params.data, " are not ", kCodesAlign,
                   "-byte aligned; the GEMMs would read its weights' codes misaligned");
        Tensor dst(place + (s.lo - w.offset), DType::e4m3, params.device, {s.hi - s.lo});
        ops_->copy(ctx, dst, codes);
        w.place = w.at = place;
      } else {
        Tensor dst = view(params, s.lo, {s.hi - s.lo});
        ops_->decode(ctx, dst, codes, f32_slot(scale_, s.weight));
      }
    }
  }
}

}  // namespace

std::unique_ptr<Ops> host_ops() { return std::make_unique<HostOps>(); }

std::unique_ptr<GatherCodec> make_codec(const GatherCodecSetup& setup, const CastsFromCurrentAmax& casts,
                                        std::unique_ptr<Ops> ops, const std::string& plugin, DirectCodes** direct) {
  auto codec = std::make_unique<Fp8GatherCodec>(setup, casts, std::move(ops), plugin);
  if (direct != nullptr) *direct = codec.get();
  return codec;
}

}  // namespace loom::fp8_gather
