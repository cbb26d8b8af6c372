#include "checkpoint/train_checkpoint.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "hf/safetensors.hpp"
#include "loom/error.hpp"

namespace fs = std::filesystem;

namespace loom::ckpt {
namespace {

using json = nlohmann::json;

DType any_dtype_named(const std::string& where, const std::string& s) {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::e4m3, DType::e5m2, DType::i32, DType::u16, DType::u32,
                  DType::f64})
    if (dtype_name(t) == s) return t;
  throw Error(cat(where, ": dtype \"", s, "\" is not one Loom knows"));
}

DType dtype_named(const std::string& dir, const std::string& s) {
  for (DType t : {DType::f32, DType::bf16, DType::f16})
    if (dtype_name(t) == s) return t;
  throw Error(cat("checkpoint ", dir, "/meta.json: dtype \"", s, "\" is not one Loom stores (fp32, bf16)"));
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

CheckpointSet::CheckpointSet(std::string dir) : dir_(std::move(dir)) {
  std::string text;
  int64_t certified_step = 0;
  uint32_t rank0_header = 0;
  {
    CheckpointReader r(dir_, 0);  // checks COMPLETE (and meta.json's CRC) and rank 0's header
    text = r.meta();
    certified_step = r.step();
    rank0_header = r.header_crc();
  }
  const std::string where = dir_ + "/meta.json";
  auto bad = [&](const std::string& what) {
    return Error(cat(where, ": ", what, "; the checkpoint cannot be used — resume from another one or set "
                     "checkpoint.resume = \"none\""));
  };
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw bad(cat("not valid JSON (", e.what(), ")"));
  }
  try {
    TrainMeta& m = meta_;
    m.version = j.value("version", 0);
    if (m.version < 2 || m.version > 5)
      throw Error(cat("checkpoint ", dir_, " has format version ", m.version,
                      "; this loom reads versions 2 to 5. Point checkpoint.dir elsewhere or set checkpoint.resume = "
                      "\"none\""));
    m.step = j.at("step").get<int64_t>();
    if (m.step != certified_step)
      throw bad(cat("it records step ", m.step, " but the checkpoint's COMPLETE marker says step ", certified_step));
    m.world_size = j.at("world_size").get<int>();
    if (m.world_size < 1) throw bad(cat("world_size ", m.world_size, " is impossible"));
    // Version 4 lists the header CRC of every rank file: a rank file that is
    // not the one written with this meta.json (another step, another run) is refused.
    if (m.version >= 4) {
      m.shard_header_crc = j.at("shard_header_crc32").get<std::vector<uint32_t>>();
      if (m.shard_header_crc.size() != static_cast<size_t>(m.world_size))
        throw bad(cat("it lists ", m.shard_header_crc.size(), " rank file checksums for a world size of ", m.world_size));
    }
    m.strategy = j.value("strategy", "");
    m.precision = j.value("precision", "");
    m.layers = j.value("layers", std::string("native"));
    const json& dt = j.at("dtypes");
    m.params_dtype = dtype_named(dir_, dt.at("params").get<std::string>());
    m.optim_dtype = dtype_named(dir_, dt.at("optim_state").get<std::string>());
    m.has_master = dt.at("master").get<bool>();
    const json& mj = j.at("model");
    m.model_json = mj.dump();
    m.spec.hidden = mj.at("hidden");
    m.spec.num_layers = mj.at("num_layers");
    m.spec.num_heads = mj.at("num_heads");
    m.spec.num_kv_heads = mj.at("num_kv_heads");
    m.spec.ffn_hidden = mj.at("ffn_hidden");
    m.spec.vocab_size = mj.at("vocab_size");
    m.spec.rope_theta = mj.at("rope_theta");
    m.spec.norm_eps = mj.at("norm_eps");
    m.spec.tied_embeddings = mj.at("tied_embeddings");
    m.spec.num_experts = mj.value("num_experts", int64_t{0});
    if (m.spec.moe()) {
      m.spec.top_k = mj.at("top_k");
      m.spec.router_aux_loss_coef = mj.at("router_aux_loss_coef");
      m.spec.router_jitter_noise = mj.at("router_jitter_noise");
    }
    for (const json& u : j.at("units")) {
      SavedUnit su;
      su.name = u.at("name").get<std::string>();
      su.numel = u.at("numel").get<int64_t>();
      for (const json& sh : u.at("shards")) {
        SavedUnit::Shard s{sh.at(0).get<int>(), sh.at(1).get<int64_t>(), sh.at(2).get<int64_t>()};
        if (s.rank < 0 || s.rank >= m.world_size || s.lo < 0 || s.lo > s.hi || s.hi > su.numel)
          throw bad(cat("unit ", su.name, " lists an impossible shard [", s.rank, ", ", s.lo, ", ", s.hi, "]"));
        su.shards.push_back(s);
      }
      for (const json& p : u.at("params")) {
        SavedParam sp;
        sp.name = p.at("name").get<std::string>();
        sp.shape = p.at("shape").get<std::vector<int64_t>>();
        sp.unit = m.units.size();
        sp.offset = p.at("offset").get<int64_t>();
        sp.numel = 1;
        for (int64_t d : sp.shape) sp.numel *= d;
        if (sp.offset < 0 || sp.numel < 0 || sp.offset + sp.numel > su.numel)
          throw bad(cat("parameter ", sp.name, " at offset ", sp.offset, " does not fit unit ", su.name, " of ",
                        su.numel, " elements"));
        if (m.by_name.count(sp.name)) throw bad(cat("parameter ", sp.name, " is listed twice"));
        m.by_name[sp.name] = m.params.size();
        m.params.push_back(std::move(sp));
      }
      m.units.push_back(std::move(su));
    }
    m.data_plugin = j.value("data_plugin", "");
    m.data_state = j.value("data_state", "");
    if (m.version >= 5) {
      for (const json& t : j.at("precision_tensors")) {
        SavedState st;
        st.name = t.at("name").get<std::string>();
        st.dtype = any_dtype_named(where, t.at("dtype").get<std::string>());
        st.shape = t.at("shape").get<std::vector<int64_t>>();
        st.replicated = t.at("replicated").get<bool>();
        for (const SavedState& o : m.precision_tensors)
          if (o.name == st.name) throw bad(cat("precision state tensor '", st.name, "' is listed twice"));
        m.precision_tensors.push_back(std::move(st));
      }
    } else if (const std::string old = j.value("precision_state", std::string()); !old.empty()) {
      // Versions 2 to 4 kept a recipe's state as opaque bytes; no recipe of
      // those looms wrote any, and the bytes cannot be mapped to named tensors.
      throw Error(cat("checkpoint ", dir_, " (format version ", m.version, ", precision \"", m.precision,
                      "\") holds precision state in the opaque form older looms wrote (", old.size() / 2,
                      " bytes in meta.json's \"precision_state\"); this loom keeps recipe state as named tensors and "
                      "cannot read it. Resume it with the loom that wrote it, or start fresh (checkpoint.resume = "
                      "\"none\")"));
    }
    m.samples_seen = j.value("samples_seen", int64_t{0});
  } catch (const json::exception& e) {
    throw bad(cat("a required field is missing or has the wrong type (", e.what(), ")"));
  }
  check_rank_file(0, rank0_header);
}

void CheckpointSet::check_rank_file(int rank, uint32_t header_crc) const {
  if (meta_.shard_header_crc.empty()) return;  // written before version 4
  const uint32_t want = meta_.shard_header_crc.at(static_cast<size_t>(rank));
  if (header_crc != want)
    throw Error(cat("checkpoint ", dir_, ": ", rank_file_name(rank), " is not the file this checkpoint was written with "
                    "(its header CRC32 is ", header_crc, ", meta.json records ", want, "): a rank file copied in from "
                    "another step or run. The checkpoint cannot be used — resume from another one or set "
                    "checkpoint.resume = \"none\""));
}

CheckpointSet::~CheckpointSet() = default;

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
  auto& rd = readers_[rank];
  if (!rd) {
    if (rank < 0 || rank >= meta_.world_size)
      throw Error(cat("checkpoint ", dir_, ": meta.json refers to rank ", rank, " of a world of ", meta_.world_size));
    rd = std::make_unique<CheckpointReader>(dir_, rank);
    check_rank_file(rank, rd->header_crc());
  }
  const TensorRecord& rec = rd->info(tensor);
  std::vector<std::byte> bytes(rec.bytes);
  int64_t n = 1;
  for (int64_t d : rec.shape) n *= d;
  Tensor host(bytes.data(), rec.dtype, Device::cpu, {n});
  rd->read(tensor, host);
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
      throw Error(cat("checkpoint ", dir_, ": rank ", sh.rank, "'s tensor ", tensor, " holds ", bytes.size(),
                      " bytes, but meta.json records ", sh.hi - sh.lo, " ", dtype_name(stored),
                      " elements: the checkpoint is damaged"));
    convert(bytes.data() + static_cast<size_t>(x - sh.lo) * es, stored,
            static_cast<std::byte*>(dst) + static_cast<size_t>(x - a) * ed, dtype, y - x);
    covered += y - x;
  }
  if (covered != b - a)
    throw Error(cat("checkpoint ", dir_, ": the shards hold ", covered, " of the ", b - a, " elements of ", p.name,
                    " (", kind, ") this rank needs: a shard file is missing or the metadata is damaged"));
}

std::vector<float> CheckpointSet::weights_f32(const SavedParam& p) {
  std::vector<float> out(static_cast<size_t>(p.numel));
  read(meta_.has_master ? "master" : "params", p, 0, p.numel, DType::f32, out.data());
  return out;
}

void CheckpointSet::read_precision_state(int rank, const SavedState& s, Tensor& dst) {
  const std::string tensor = "precision." + s.name;
  auto& rd = readers_[rank];
  if (!rd) {
    if (rank < 0 || rank >= meta_.world_size)
      throw Error(cat("checkpoint ", dir_, ": precision state '", s.name, "' of rank ", rank, ", but it was written by ",
                      meta_.world_size, " rank(s)"));
    rd = std::make_unique<CheckpointReader>(dir_, rank);
    check_rank_file(rank, rd->header_crc());
  }
  if (!rd->has(tensor))
    throw Error(cat("checkpoint ", dir_, ": meta.json lists precision state '", s.name, "' but ", rank_file_name(rank),
                    " has no tensor ", tensor, ": the checkpoint is damaged"));
  const TensorRecord& rec = rd->info(tensor);
  if (rec.dtype != dst.dtype || rec.shape != std::vector<int64_t>(dst.shape.begin(), dst.shape.begin() + dst.ndim))
    throw Error(cat("checkpoint ", dir_, ": precision state '", s.name, "' is ", dtype_name(rec.dtype), " ",
                    rec.shape_str(), " there and ", dtype_name(dst.dtype), " ", dst.shape_str(),
                    " in this run's recipe: its state has another layout there (a [precision] setting that sizes it, "
                    "such as an FP8 amax history length, or the model's linears, such as model.layers, changed). Resume "
                    "with the settings that wrote it, or start fresh (checkpoint.resume = \"none\")"));
  rd->read(tensor, dst);
}

}  // namespace loom::ckpt
