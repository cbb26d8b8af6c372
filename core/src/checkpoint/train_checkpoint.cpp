#include "checkpoint/train_checkpoint.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>

#include <nlohmann/json.hpp>

#include "config/run_config.hpp"
#include "hf/safetensors.hpp"
#include "loom/block.hpp"
#include "loom/error.hpp"
#include "loom/json_fields.hpp"
#include "model/model.hpp"
#include "train/finite_checks.hpp"

namespace fs = std::filesystem;

namespace loom::ckpt {
namespace {

using json = nlohmann::json;

// Any dtype a tensor may have (a recipe's state: FP8 codes, integers).
DType any_dtype(const JsonFields& f, const json& obj, const std::string& at, const char* name) {
  const char* want = "a dtype Loom knows (fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, int32, uint16, uint32, fp64)";
  std::string key;
  const json& v = f.member(obj, at, name, key, want);
  const std::string s = f.string(v, key);
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::e4m3, DType::e5m2, DType::i32, DType::u16, DType::u32,
                  DType::f64})
    if (dtype_name(t) == s) return t;
  f.fail(key, v, want);
}

// Converts n elements between the storage dtypes a checkpoint can hold.
void convert(const void* src, DType from, void* dst, DType to, int64_t n) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(to));
    return;
  }
  if (from == DType::bf16 && to == DType::f32) {
    const auto* s = static_cast<const uint16_t*>(src);
    auto* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = hf::bf16_to_f32(s[i]);
    return;
  }
  if (from == DType::f32 && to == DType::bf16) {
    const auto* s = static_cast<const float*>(src);
    auto* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = hf::f32_to_bf16(s[i]);
    return;
  }
  throw Error(cat("checkpoint: cannot convert ", dtype_name(from), " to ", dtype_name(to)));
}

}  // namespace

std::string model_json(const ModelSpec& s) {
  json j = {{"hidden", s.hidden},         {"num_layers", s.num_layers},   {"num_heads", s.num_heads},
            {"num_kv_heads", s.num_kv_heads}, {"ffn_hidden", s.ffn_hidden}, {"vocab_size", s.vocab_size},
            {"rope_theta", s.rope_theta}, {"norm_eps", s.norm_eps}, {"tied_embeddings", s.tied_embeddings}};
  if (s.moe()) {  // only then: a dense model's record is what it always was
    j["num_experts"] = s.num_experts;
    j["top_k"] = s.top_k;
    j["router_aux_loss_coef"] = s.router_aux_loss_coef;
    j["router_jitter_noise"] = s.router_jitter_noise;
  }
  return j.dump();
}

std::string complete_list(const std::string& root) {
  std::string s;
  for (const CheckpointInfo& c : list_checkpoints(root))
    if (c.complete) s += (s.empty() ? "" : ", ") + fs::path(c.dir).filename().string();
  return s.empty() ? "none" : s;
}

namespace {

constexpr const char* kCannotUse = "; the checkpoint cannot be used";
// As many ranks as `loom check --world` plans for: a larger world_size is a damaged field.
constexpr int64_t kMaxWorldSize = int64_t{1} << 20;

// The storage dtypes a checkpoint's params and optimizer state may have.
DType stored_dtype(const JsonFields& f, const json& obj, const std::string& at, const char* name) {
  const char* want = "one of: fp32, bf16, fp16 (the dtypes Loom stores)";
  std::string key;
  const json& v = f.member(obj, at, name, key, want);
  const std::string s = f.string(v, key);
  for (DType t : {DType::f32, DType::bf16, DType::f16})
    if (dtype_name(t) == s) return t;
  f.fail(key, v, want);
}

std::string shape_words(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// The layout a version-4-or-later meta.json lists, against the one its own
// model record derives (the units Model declares, in order, with their
// parameters). Reading is by name, so an edit that keeps the certificate
// valid — units or offsets swapped, names of two same-shaped parameters
// exchanged — would otherwise load one matrix as another without a word.
// Parameters of different shapes may sit in another order than today's
// (the MoE experts' w2 and w3 were once declared the other way round): a
// shape mismatch cannot load silently, so only the order among parameters of
// one shape is held to the derived one.
void check_derived_layout(const TrainMeta& m, const std::string& where) {
  auto bad = [&](const std::string& what) {
    return CheckpointDamaged(cat(where, ": ", what, " (meta.json edited or damaged)", kCannotUse));
  };
  bool experts_apart = false;
  for (const SavedUnit& u : m.units) experts_apart = experts_apart || u.name.ends_with(".experts");
  const Model model(m.spec, m.layers, experts_apart ? 2 : 1);
  const std::vector<UnitInfo>& want = model.units();
  const std::string described = cat("the model meta.json describes (", m.spec.num_layers, " layers",
                                    m.spec.moe() ? cat(", ", m.spec.num_experts, " experts") : std::string(), ")");
  for (size_t i = 0; i < std::max(want.size(), m.units.size()); ++i) {
    if (i >= m.units.size())
      throw bad(cat("it lists ", m.units.size(), " units, but ", described, " has ", want.size(), " (the first missing: ",
                    want[i].name, ")"));
    if (i >= want.size())
      throw bad(cat("unit ", m.units[i].name, " (units[", i, "]) is not part of ", described));
    const SavedUnit& su = m.units[i];
    const UnitInfo& wu = want[i];
    if (su.name != wu.name)
      throw bad(cat("units[", i, "] is unit ", su.name, " where ", described, " has unit ", wu.name,
                    " (units out of order, renamed or missing)"));
    if (su.numel != wu.numel)
      throw bad(cat("unit ", su.name, " holds ", su.numel, " elements, but in ", described, " it holds ", wu.numel));
  }
  // The saved parameters of each unit, in the order listed (their offsets' order: checked before).
  std::vector<std::vector<const SavedParam*>> by_unit(want.size());
  for (const SavedParam& p : m.params) by_unit[p.unit].push_back(&p);
  for (size_t i = 0; i < want.size(); ++i) {
    const UnitInfo& wu = want[i];
    const std::vector<const SavedParam*>& saved = by_unit[i];
    if (saved.size() != wu.params.size())
      throw bad(cat("unit ", wu.name, " lists ", saved.size(), " parameters, but in ", described, " it has ",
                    wu.params.size()));
    // Each derived parameter and its place among the unit's parameters of its shape.
    std::map<std::string, std::pair<const ParamInfo*, int64_t>> derived;
    std::map<std::vector<int64_t>, int64_t> seen;
    for (const ParamInfo& q : wu.params) derived[q.name] = {&q, seen[q.shape]++};
    seen.clear();
    for (const SavedParam* p : saved) {
      const auto d = derived.find(p->name);
      if (d == derived.end()) {
        // The derived parameter it stands in place of, if any, for the message.
        const auto gone = std::find_if(wu.params.begin(), wu.params.end(), [&](const ParamInfo& q) {
          return std::none_of(saved.begin(), saved.end(), [&](const SavedParam* s) { return s->name == q.name; });
        });
        throw bad(cat("parameter '", p->name, "' is listed in unit ", wu.name, ", which in ", described,
                      " does not hold it",
                      gone != wu.params.end() ? cat(" (it holds '", gone->name, "', which meta.json does not list)")
                                              : std::string()));
      }
      const ParamInfo& w = *d->second.first;
      if (w.shape != p->shape)
        throw bad(cat("parameter '", p->name, "' has shape ", shape_words(p->shape), ", but ", shape_words(w.shape),
                      " in ", described));
      if (seen[p->shape]++ != d->second.second) {
        const auto other = std::find_if(saved.begin(), saved.end(), [&](const SavedParam* q) {
          return q->shape == p->shape && q->offset == w.offset;
        });
        throw bad(cat("parameter '", p->name, "' is at offset ", p->offset, " of unit ", wu.name, ", but ", described,
                      " puts it at offset ", w.offset,
                      other != saved.end() ? cat(", where meta.json has '", (*other)->name, "' of the same shape")
                                           : std::string(),
                      ": the two would be loaded in each other's place"));
      }
    }
  }
}

}  // namespace

CheckpointSet::CheckpointSet(std::string dir) : dir_(std::move(dir)) {
  std::string text;
  int64_t certified_step = 0;
  uint32_t rank0_header = 0;
  bool certified = false;
  {
    CheckpointReader r(dir_, 0);  // checks COMPLETE (and meta.json's CRC) and rank 0's header
    text = r.meta();
    certified_step = r.step();
    rank0_header = r.header_crc();
    certified = !r.legacy();
  }
  const std::string where = (fs::path(dir_) / "meta.json").string();
  auto bad = [&](const std::string& what) { return CheckpointDamaged(cat(where, ": ", what, kCannotUse)); };
  // Every field is type- and range-checked, naming the key: a meta.json
  // re-certified by hand can hold anything.
  const JsonFields f(where, kCannotUse);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw bad(cat("not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object()) f.fail("(the whole file)", j, "a JSON object");
  TrainMeta& m = meta_;
  m.version = static_cast<int>(f.integer_at(j, "", "version", 0, 1 << 30));
  if (m.version < 2 || m.version > 5)
    throw Error(cat("checkpoint ", dir_, " has format version ", m.version,
                    "; this loom reads versions 2 to 5. Point checkpoint.dir elsewhere or set checkpoint.resume = "
                    "\"none\""));
  // The format decides, not the marker: every loom that wrote version 5
  // certified meta.json in COMPLETE. A marker in the older form there was
  // rewritten, and would switch the certificate off for any edit. (Version 4
  // is accepted with either marker, as checkpoints of that version have been
  // read so far.)
  if (!certified && m.version >= 5)
    throw CheckpointDamaged(cat((fs::path(dir_) / "COMPLETE").string(),
                                " records the step only (the marker of older looms), but ",
                                where, " is format version ", m.version,
                                ", which is always written with a marker that certifies it (\"meta_bytes\", "
                                "\"meta_crc32\"): the marker was rewritten, so meta.json's step, layout and data "
                                "position cannot be trusted. If the original marker is at hand, put it back",
                                kCannotUse));
  m.step = f.integer_at(j, "", "step");
  if (m.step != certified_step)
    throw bad(cat("it records step ", m.step, " but the checkpoint's COMPLETE marker says step ", certified_step));
  m.world_size = static_cast<int>(f.integer_at(j, "", "world_size", 1, kMaxWorldSize));
  // Version 4 lists the header CRC of every rank file: a rank file that is
  // not the one written with this meta.json (another step, another run) is refused.
  if (m.version >= 4) {
    const json& crcs = f.array_at(j, "", "shard_header_crc32");
    for (size_t i = 0; i < crcs.size(); ++i) m.shard_header_crc.push_back(f.crc32(crcs[i], cat("shard_header_crc32[", i, "]")));
    if (m.shard_header_crc.size() != static_cast<size_t>(m.world_size))
      throw bad(cat("it lists ", m.shard_header_crc.size(), " rank file checksums for a world size of ", m.world_size));
  }
  m.strategy = f.string_or(j, "", "strategy", "");
  m.precision = f.string_or(j, "", "precision", "");
  m.layers = f.string_or(j, "", "layers", "native");
  if (!is_layer_variant(m.layers)) f.fail("layers", j["layers"], cat("one of: ", layer_variants()));
  const json& dt = f.object_at(j, "", "dtypes");
  m.params_dtype = stored_dtype(f, dt, "dtypes", "params");
  m.optim_dtype = stored_dtype(f, dt, "dtypes", "optim_state");
  {
    std::string key;
    m.has_master = f.boolean(f.member(dt, "dtypes", "master", key, "true or false"), key);
  }
  // The architecture, held to the ranges of the model.* keys it stands for
  // (config/run_config.hpp): `loom convert` builds its layout from it.
  const json& mj = f.object_at(j, "", "model");
  m.model_json = mj.dump();
  {
    ModelSpec& s = m.spec;
    s.hidden = f.integer_at(mj, "model", "hidden", 1, kMaxDim);
    s.num_layers = f.integer_at(mj, "model", "num_layers", 1, kMaxLayersOrHeads);
    s.num_heads = f.integer_at(mj, "model", "num_heads", 1, kMaxLayersOrHeads);
    s.num_kv_heads = f.integer_at(mj, "model", "num_kv_heads", 1, kMaxLayersOrHeads);
    s.ffn_hidden = f.integer_at(mj, "model", "ffn_hidden", 1, kMaxDim);
    s.vocab_size = f.integer_at(mj, "model", "vocab_size", 1, kMaxVocabSize);
    std::string key;
    s.rope_theta = f.number(f.member(mj, "model", "rope_theta", key, "a number >= 1"), key, 1.0,
                            std::numeric_limits<double>::max());
    s.norm_eps = f.number(f.member(mj, "model", "norm_eps", key, "a number in (0, 1]"), key, kFp32MinNormal, 1.0);
    s.tied_embeddings = f.boolean(f.member(mj, "model", "tied_embeddings", key, "true or false"), key);
    s.num_experts = f.find(mj, "model", "num_experts", key) ? f.integer_at(mj, "model", "num_experts", 0, kMaxExperts) : 0;
    if (s.moe()) {
      s.top_k = f.integer_at(mj, "model", "top_k", 1, std::min(kMaxTopK, s.num_experts));
      s.router_aux_loss_coef = f.number(f.member(mj, "model", "router_aux_loss_coef", key, "a number in [0, 1000000]"),
                                        key, 0.0, kMaxRouterAuxLossCoef);
      s.router_jitter_noise = f.number(f.member(mj, "model", "router_jitter_noise", key, "a number in [0, 0.999]"), key,
                                       0.0, kMaxRouterJitterNoise);
    }
    if (s.hidden % s.num_heads != 0 || s.num_heads % s.num_kv_heads != 0)
      throw bad(cat("model.hidden ", s.hidden, ", model.num_heads ", s.num_heads, " and model.num_kv_heads ",
                    s.num_kv_heads, " do not divide as a model's must"));
  }
  const json& units = f.array_at(j, "", "units");
  for (size_t ui = 0; ui < units.size(); ++ui) {
    const std::string at = cat("units[", ui, "]");
    f.object(units[ui], at);
    SavedUnit su;
    su.name = f.string_at(units[ui], at, "name");
    su.numel = f.integer_at(units[ui], at, "numel");
    const json& shards = f.array_at(units[ui], at, "shards");
    for (size_t k = 0; k < shards.size(); ++k) {
      const std::string sk = cat(at, ".shards[", k, "]");
      if (!shards[k].is_array() || shards[k].size() != 3) f.fail(sk, shards[k], "[rank, lo, hi]: three integers");
      SavedUnit::Shard s{static_cast<int>(f.integer(shards[k][0], sk + "[0]", 0, m.world_size - 1)),
                         f.integer(shards[k][1], sk + "[1]", 0, su.numel), 0};
      s.hi = f.integer(shards[k][2], sk + "[2]", s.lo, su.numel);
      su.shards.push_back(s);
    }
    // Every element of the unit is written exactly once, by one rank (train_checkpoint.hpp).
    std::vector<SavedUnit::Shard> sorted = su.shards;
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.lo < b.lo; });
    int64_t covered = 0;
    for (const SavedUnit::Shard& s : sorted) {
      if (s.lo != covered)
        throw bad(cat("the shards of unit ", su.name, " do not hold each of its ", su.numel, " elements once: ",
                      s.lo < covered ? cat("[", s.lo, ", ", std::min(covered, s.hi), ") is listed twice")
                                     : cat("[", covered, ", ", s.lo, ") is in none")));
      covered = s.hi;
    }
    if (covered != su.numel)
      throw bad(cat("the shards of unit ", su.name, " hold ", covered, " of its ", su.numel, " elements"));
    // The parameters tile the unit in the order listed, as every writer lays
    // them out: an offset edited to overlap another, or two swapped, is refused.
    int64_t next = 0;
    const json& params = f.array_at(units[ui], at, "params");
    for (size_t pi = 0; pi < params.size(); ++pi) {
      const std::string pat = cat(at, ".params[", pi, "]");
      f.object(params[pi], pat);
      SavedParam sp;
      sp.name = f.string_at(params[pi], pat, "name");
      const json& shape = f.array_at(params[pi], pat, "shape");
      sp.numel = 1;
      for (size_t k = 0; k < shape.size(); ++k) {
        sp.shape.push_back(f.integer(shape[k], cat(pat, ".shape[", k, "]")));
        if (__builtin_mul_overflow(sp.numel, sp.shape.back(), &sp.numel) || sp.numel > su.numel)
          throw bad(cat("parameter '", sp.name, "' of shape ", shape.dump(), " does not fit unit ", su.name, " of ",
                        su.numel, " elements"));
      }
      sp.unit = m.units.size();
      sp.offset = f.integer_at(params[pi], pat, "offset");
      if (sp.offset != next)
        throw bad(cat("parameter '", sp.name, "' is at offset ", sp.offset, " of unit ", su.name, ", but the "
                      "parameters listed before it end at ", next, ": offsets that overlap, leave a gap or are out of "
                      "order (edited or damaged)"));
      if (sp.numel > su.numel - next)
        throw bad(cat("parameter '", sp.name, "' at offset ", sp.offset, " does not fit unit ", su.name, " of ",
                      su.numel, " elements"));
      next += sp.numel;
      if (m.by_name.count(sp.name)) throw bad(cat("parameter '", sp.name, "' is listed twice"));
      m.by_name[sp.name] = m.params.size();
      m.params.push_back(std::move(sp));
    }
    if (next != su.numel)
      throw bad(cat("the parameters of unit ", su.name, " cover ", next, " of its ", su.numel, " elements"));
    m.units.push_back(std::move(su));
  }
  // Versions 2 and 3 came before the layout was declared by the blocks; from 4 on it must be the one derived.
  if (m.version >= 4) check_derived_layout(m, where);
  m.data_plugin = f.string_or(j, "", "data_plugin", "");
  m.data_state = f.string_or(j, "", "data_state", "");
  if (m.version >= 5) {
    const json& states = f.array_at(j, "", "precision_tensors");
    for (size_t i = 0; i < states.size(); ++i) {
      const std::string at = cat("precision_tensors[", i, "]");
      f.object(states[i], at);
      SavedState st;
      st.name = f.string_at(states[i], at, "name");
      st.dtype = any_dtype(f, states[i], at, "dtype");
      const json& shape = f.array_at(states[i], at, "shape");
      for (size_t k = 0; k < shape.size(); ++k) st.shape.push_back(f.integer(shape[k], cat(at, ".shape[", k, "]")));
      std::string key;
      st.replicated = f.boolean(f.member(states[i], at, "replicated", key, "true or false"), key);
      for (const SavedState& o : m.precision_tensors)
        if (o.name == st.name) throw bad(cat("precision state tensor '", st.name, "' is listed twice"));
      m.precision_tensors.push_back(std::move(st));
    }
  } else if (const std::string old = f.string_or(j, "", "precision_state", ""); !old.empty()) {
    // Versions 2 to 4 kept a recipe's state as opaque bytes; no recipe of
    // those looms wrote any, and the bytes cannot be mapped to named tensors.
    throw Error(cat("checkpoint ", dir_, " (format version ", m.version, ", precision \"", m.precision,
                    "\") holds precision state in the opaque form older looms wrote (", old.size() / 2,
                    " bytes in meta.json's \"precision_state\"); this loom keeps recipe state as named tensors and "
                    "cannot read it. Resume it with the loom that wrote it, or start fresh (checkpoint.resume = "
                    "\"none\")"));
  }
  {
    std::string key;
    m.samples_seen = f.find(j, "", "samples_seen", key) ? f.integer_at(j, "", "samples_seen") : 0;
  }
  check_rank_file(0, rank0_header);
}

void CheckpointSet::check_rank_file(int rank, uint32_t header_crc) const {
  if (meta_.shard_header_crc.empty()) return;  // written before version 4
  const uint32_t want = meta_.shard_header_crc.at(static_cast<size_t>(rank));
  if (header_crc != want)
    throw CheckpointDamaged(cat("checkpoint ", dir_, ": ", rank_file_name(rank), " is not the file this checkpoint "
                                "was written with (its header CRC32 is ", header_crc, ", meta.json records ", want,
                                "): a rank file copied in from another step or run", kCannotUse));
}

CheckpointReader& CheckpointSet::reader(int rank) {
  auto& rd = readers_[rank];
  if (!rd) {
    if (rank < 0 || rank >= meta_.world_size)
      throw CheckpointDamaged(cat("checkpoint ", dir_, ": meta.json refers to rank ", rank, " of a world of ",
                                  meta_.world_size, kCannotUse));
    rd = std::make_unique<CheckpointReader>(dir_, rank);
    check_rank_file(rank, rd->header_crc());
  }
  return *rd;
}

void CheckpointSet::check_files() {
  for (int r = 0; r < meta_.world_size; ++r) reader(r);
  // Each shard meta.json lists is in its rank's file, of the dtype and size it records.
  auto expect = [&](int rank, const std::string& tensor, DType dtype, int64_t numel, const std::string& what) {
    CheckpointReader& rd = reader(rank);
    if (!rd.has(tensor))
      throw CheckpointDamaged(cat(rd.file(), ": no tensor ", tensor, ", which meta.json lists (", what, ")",
                                  kCannotUse));
    const TensorRecord& rec = rd.info(tensor);
    if (rec.dtype != dtype || rec.bytes != static_cast<uint64_t>(numel) * dtype_size(dtype))
      throw CheckpointDamaged(cat(rd.file(), ": tensor ", tensor, " is ", dtype_name(rec.dtype), " ", rec.shape_str(),
                                  ", but meta.json records ", numel, " ", dtype_name(dtype), " elements (", what, ")",
                                  kCannotUse));
  };
  for (const SavedUnit& u : meta_.units)
    for (const SavedUnit::Shard& sh : u.shards) {
      const std::string what = cat("unit ", u.name, "'s elements [", sh.lo, ", ", sh.hi, ")");
      expect(sh.rank, "params." + u.name, meta_.params_dtype, sh.hi - sh.lo, what);
      if (meta_.has_master) expect(sh.rank, "master." + u.name, DType::f32, sh.hi - sh.lo, what);
      expect(sh.rank, "adam_m." + u.name, meta_.optim_dtype, sh.hi - sh.lo, what);
      expect(sh.rank, "adam_v." + u.name, meta_.optim_dtype, sh.hi - sh.lo, what);
    }
  for (const SavedState& s : meta_.precision_tensors) {
    int64_t n = 1;
    for (int64_t d : s.shape)
      if (__builtin_mul_overflow(n, d, &n))
        throw CheckpointDamaged(cat(dir_, "/meta.json: precision state '", s.name, "' has an impossible shape",
                                    kCannotUse));
    for (int r = 0; r < (s.replicated ? 1 : meta_.world_size); ++r)
      expect(r, "precision." + s.name, s.dtype, n, cat("precision state '", s.name, "'"));
  }
}

CheckpointSet::~CheckpointSet() = default;

std::string training_checkpoint_damage(const CheckpointInfo& c) {
  if (!c.complete) return cat("no COMPLETE marker: its save was interrupted");
  try {
    CheckpointSet set(c.dir);
    set.check_files();
  } catch (const std::exception& e) {  // a file system error too: whatever cannot be read is not counted on
    return e.what();
  }
  return "";
}

const SavedParam& CheckpointSet::param(const std::string& name) const {
  auto it = meta_.by_name.find(name);
  if (it == meta_.by_name.end())
    throw Error(cat("checkpoint ", dir_, " has no parameter '", name, "' (it holds ", meta_.params.size(),
                    " parameters of another layout): the checkpoint belongs to another model"));
  return meta_.params[it->second];
}

const std::vector<std::byte>& CheckpointSet::piece(int rank, const std::string& tensor) {
  auto key = std::make_pair(rank, tensor);
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  CheckpointReader& rd = reader(rank);
  const TensorRecord& rec = rd.info(tensor);
  std::vector<std::byte> bytes(rec.bytes);
  int64_t n = 1;
  for (int64_t d : rec.shape) n *= d;
  Tensor host(bytes.data(), rec.dtype, Device::cpu, {n});
  rd.read(tensor, host);
  return cache_.emplace(key, std::move(bytes)).first->second;
}

void CheckpointSet::read(const std::string& kind, const SavedParam& p, int64_t begin, int64_t end, DType dtype,
                         void* dst) {
  LOOM_CHECK(0 <= begin && begin <= end && end <= p.numel, "checkpoint read of [", begin, ", ", end, ") of ",
             p.name, " (", p.numel, " elements)");
  if (begin == end) return;
  const SavedUnit& u = meta_.units[p.unit];
  const std::string tensor = kind + "." + u.name;
  if (cached_unit_ != u.name) {  // pieces are read whole (their CRC covers them whole), one unit at a time
    cache_.clear();
    cached_unit_ = u.name;
  }
  const DType stored = kind == "params" ? meta_.params_dtype : kind == "master" ? DType::f32 : meta_.optim_dtype;
  const size_t es = dtype_size(stored), ed = dtype_size(dtype);
  const int64_t a = p.offset + begin, b = p.offset + end;  // in the saved unit's flat vector
  int64_t covered = 0;
  for (const SavedUnit::Shard& sh : u.shards) {
    const int64_t x = std::max(a, sh.lo), y = std::min(b, sh.hi);
    if (x >= y) continue;
    const std::vector<std::byte>& bytes = piece(sh.rank, tensor);
    if (bytes.size() != static_cast<size_t>(sh.hi - sh.lo) * es)
      throw CheckpointDamaged(cat("checkpoint ", dir_, ": rank ", sh.rank, "'s tensor ", tensor, " holds ",
                                  bytes.size(), " bytes, but meta.json records ", sh.hi - sh.lo, " ",
                                  dtype_name(stored), " elements", kCannotUse));
    convert(bytes.data() + static_cast<size_t>(x - sh.lo) * es, stored,
            static_cast<std::byte*>(dst) + static_cast<size_t>(x - a) * ed, dtype, y - x);
    covered += y - x;
  }
  if (covered != b - a)
    throw CheckpointDamaged(cat("checkpoint ", dir_, ": the shards hold ", covered, " of the ", b - a, " elements of ",
                                p.name, " (", kind, ") this rank needs: a shard file is missing or the metadata is "
                                "damaged", kCannotUse));
  // NaN or inf in the weights or the AdamW state would make every step of a
  // resumed run, and every use of an export, non-finite: the one read that
  // resuming and `loom convert` share refuses them, naming what holds them
  // (the CRCs only say the bytes are the ones written). Looked at as the
  // caller takes them (a finite fp32 beyond bf16's range is inf in bf16).
  if (const NonFiniteCount bad = count_nonfinite(dst, dtype, b - a))
    throw CheckpointDamaged(cat("checkpoint ", dir_, ": the ", state_kind_words(kind), " of '", p.name, "' hold ",
                                describe_nonfinite(bad, b - a), " (elements counted from ", begin,
                                "): it was written from a diverged run (or changed by hand) and cannot be resumed or "
                                "converted"));
}

std::vector<float> CheckpointSet::weights_f32(const SavedParam& p) {
  std::vector<float> out(static_cast<size_t>(p.numel));
  read(meta_.has_master ? "master" : "params", p, 0, p.numel, DType::f32, out.data());
  return out;
}

void CheckpointSet::read_precision_state(int rank, const SavedState& s, Tensor& dst) {
  const std::string tensor = "precision." + s.name;
  if (rank < 0 || rank >= meta_.world_size)
    throw Error(cat("checkpoint ", dir_, ": precision state '", s.name, "' of rank ", rank, ", but it was written by ",
                    meta_.world_size, " rank(s)"));
  CheckpointReader& rd = reader(rank);
  if (!rd.has(tensor))
    throw CheckpointDamaged(cat("checkpoint ", dir_, ": meta.json lists precision state '", s.name, "' but ",
                                rank_file_name(rank), " has no tensor ", tensor, kCannotUse));
  const TensorRecord& rec = rd.info(tensor);
  if (rec.dtype != dst.dtype || rec.shape != std::vector<int64_t>(dst.shape.begin(), dst.shape.begin() + dst.ndim))
    throw Error(cat("checkpoint ", dir_, ": precision state '", s.name, "' is ", dtype_name(rec.dtype), " ",
                    rec.shape_str(), " there and ", dtype_name(dst.dtype), " ", dst.shape_str(),
                    " in this run's recipe: its state has another layout there (a [precision] setting that sizes it, "
                    "such as an FP8 amax history length, or the model's linears, such as model.layers, changed). Resume "
                    "with the settings that wrote it, or start fresh (checkpoint.resume = \"none\")"));
  rd.read(tensor, dst);
}

}  // namespace loom::ckpt
