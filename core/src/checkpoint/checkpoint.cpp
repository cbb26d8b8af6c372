#include "checkpoint/checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <mutex>
#include <set>

#include "checkpoint/file_util.hpp"
#include "loom/json_fields.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "util/files.hpp"

namespace fs = std::filesystem;

namespace loom::ckpt {

static_assert(std::endian::native == std::endian::little, "checkpoint files are little-endian");

namespace {

constexpr char kMagic[8] = {'L', 'O', 'O', 'M', 'C', 'K', 'P', '1'};
constexpr uint64_t kPrefixBytes = 24;  // magic, u64 header length, u32 header CRC, u32 zero
constexpr uint64_t kAlign = 64;
// A header lists names and shapes only; anything above this is a corrupt length field.
constexpr uint64_t kMaxHeaderBytes = 256ull << 20;
constexpr const char* kComplete = "COMPLETE";
constexpr const char* kMeta = "meta.json";
// Every refusal of a damaged checkpoint ends so; the caller adds what to do
// (CheckpointDamaged).
constexpr const char* kUnusable = "; the checkpoint cannot be used";

uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

std::optional<DType> parse_dtype(const std::string& s) {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::e4m3, DType::e5m2, DType::i32, DType::u16, DType::u32,
                  DType::f64})
    if (dtype_name(t) == s) return t;
  return std::nullopt;
}

std::string shape_string(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

// "step_" and digits: the shape of a checkpoint's name. The step, when the
// digits hold one (at most 18 of them), goes to `step`.
bool step_shaped(const std::string& name, std::optional<int64_t>& step) {
  const std::string p = "step_";
  step.reset();
  if (name.size() <= p.size() || name.compare(0, p.size(), p) != 0) return false;
  const std::string digits = name.substr(p.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  if (digits.size() <= 18) step = std::stoll(digits);
  return true;
}

// The step whose checkpoint this name is: step_dir_name(step) exactly, as
// the writer names it. Anything else in root (tmp files, folders being
// deleted, "step_4" beside "step_00000004") is not a checkpoint of the run.
std::optional<int64_t> parse_step_dir(const std::string& name) {
  std::optional<int64_t> step;
  if (!step_shaped(name, step) || !step || name != step_dir_name(*step)) return std::nullopt;
  return step;
}

// The step a folder's name claims in any spelling ("step_4" too): a folder
// given directly (loom convert ../step_4) is still checked against its marker.
std::optional<int64_t> named_step(const std::string& name) {
  std::optional<int64_t> step;
  step_shaped(name, step);
  return step;
}

// A name shaped like a checkpoint's that is not the writer's spelling: said
// once, never used. A copy or a rename by hand would otherwise count toward
// keep_last (pruning a good checkpoint while keeping it) or be resumed from.
void warn_alias(const std::string& root, const std::string& name, const std::optional<int64_t>& step) {
  warn_once(cat("checkpoint folder ", root, " holds '", name, "', which is not a checkpoint name Loom writes",
                step ? cat(" (step ", *step, "'s is ", step_dir_name(*step), ")") : std::string(),
                ": it is left alone — never resumed from, counted toward checkpoint.keep_last or pruned. If it is a "
                "copy, move it out of ", root, "; to use it as a checkpoint, give it its canonical name"));
}

fs::path step_path(const std::string& root, int64_t step) { return fs::path(root) / step_dir_name(step); }

void ensure_dir(const fs::path& p) {
  std::error_code ec;
  fs::create_directories(p, ec);  // several ranks race here; losing the race is fine
  if (!fs::is_directory(p))
    throw Error(cat("cannot create checkpoint directory ", p.string(), ": ",
                    ec ? ec.message() : std::string("a file is in the way"), "; check permissions and disk space"));
  // Make the new directory entries durable before files inside them are relied upon.
  fsync_dir(p.parent_path().string());
  fsync_dir(p.parent_path().parent_path().empty() ? "." : p.parent_path().parent_path().string());
}

std::string complete_steps(const std::string& root) {
  std::string s;
  for (const auto& c : list_checkpoints(root))
    if (c.complete) s += (s.empty() ? "" : ", ") + std::to_string(c.step);
  return s.empty() ? "none" : s;
}

bool pread_all(int fd, void* dst, uint64_t bytes, uint64_t offset) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    size_t chunk = bytes < (uint64_t{1} << 30) ? static_cast<size_t>(bytes) : (size_t{1} << 30);
    ssize_t n = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (n == 0) return false;  // end of file: truncated
    p += n;
    bytes -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return true;
}

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// A checkpoint's name that is not a folder (a file, a FIFO, a device, a link
// to one, a dangling link): a run would resume past it, train, and fail at the
// save of that step; `loom convert` would skip it silently. Refused wherever
// the checkpoints are listed, before anything is done.
[[noreturn]] void refuse_non_folder(const std::string& root, const fs::path& p, int64_t step) {
  struct stat lst {};
  std::string what = "something that is not a folder";
  if (::lstat(p.c_str(), &lst) == 0) {
    if (S_ISLNK(lst.st_mode)) {
      std::error_code ec;
      const fs::path target = fs::read_symlink(p, ec);
      struct stat st {};
      what = cat("a symbolic link to ", ec ? std::string("?") : target.string(), ", which ",
                 ::stat(p.c_str(), &st) == 0 ? cat("is ", file_type_name(st.st_mode)) : std::string("does not exist"));
    } else {
      what = file_type_name(lst.st_mode);
    }
  }
  throw Error(cat("checkpoint folder ", root, " holds ", p.string(), ", which is ", what,
                  ", not a checkpoint folder: its name is that of the checkpoint of step ", step,
                  " (a save of that step would fail on it, and resuming or converting would pass it over). Move it out "
                  "of ", root, " or remove it"));
}

}  // namespace

std::string step_dir_name(int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::string rank_file_name(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank_%05d.bin", rank);
  return buf;
}

void warn_once(const std::string& msg) {
  static std::mutex mu;
  static auto* said = new std::set<std::string>;
  std::lock_guard<std::mutex> g(mu);
  if (said->insert(msg).second) log_warn(msg);
}

std::string TensorRecord::shape_str() const { return shape_string(shape); }

// ---------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------

CheckpointWriter::CheckpointWriter(std::string root, int64_t step, int rank)
    : root_(std::move(root)), step_(step), rank_(rank) {
  LOOM_CHECK(step >= 0, "checkpoint step must be >= 0, got ", step);
  LOOM_CHECK(rank >= 0, "checkpoint rank must be >= 0, got ", rank);
}

void CheckpointWriter::add(const std::string& name, const Tensor& t) {
  const std::string where = (step_path(root_, step_) / rank_file_name(rank_)).string();
  if (name.empty()) throw Error(cat(where, ": a tensor needs a name"));
  for (const auto& it : items_)
    if (it.name == name) throw Error(cat(where, ": tensor '", name, "' added twice"));
  if (t.device != Device::cpu)
    throw Error(cat(where, ": tensor '", name, "' is on ", device_name(t.device),
                    "; checkpoints take host tensors — copy it to the host first"));
  if (!t.is_contiguous()) throw Error(cat(where, ": tensor '", name, "' is not contiguous; pack it first"));
  if (t.numel() > 0 && t.data == nullptr) throw Error(cat(where, ": tensor '", name, "' has no data"));
  items_.push_back({name, t});
}

uint32_t CheckpointWriter::write_shard() {
  const fs::path dir = step_path(root_, step_);
  const std::string file = (dir / rank_file_name(rank_)).string();
  if (fs::exists(dir / kComplete))
    throw Error(cat("checkpoint ", dir.string(), " already exists and is complete; refusing to overwrite ", file,
                    " (remove the directory first if it is meant to be replaced)"));
  ensure_dir(dir);

  nlohmann::ordered_json hdr;
  hdr["format"] = 1;
  hdr["rank"] = rank_;
  // The step too, so that a rank file copied in from another step is refused on load.
  hdr["step"] = step_;
  hdr["tensors"] = nlohmann::ordered_json::array();
  uint64_t off = 0;
  for (const auto& it : items_) {
    std::vector<int64_t> shape(it.t.shape.begin(), it.t.shape.begin() + it.t.ndim);
    uint64_t bytes = it.t.bytes();
    hdr["tensors"].push_back({{"name", it.name},
                              {"dtype", std::string(dtype_name(it.t.dtype))},
                              {"shape", shape},
                              {"offset", off},
                              {"bytes", bytes},
                              {"crc32", crc32(it.t.data, bytes)}});
    off = align_up(off + bytes);
  }
  const std::string h = hdr.dump();
  const uint64_t hlen = h.size();
  const uint32_t hcrc = crc32(h.data(), h.size());
  const uint32_t zero = 0;
  static const char pad[kAlign] = {};

  AtomicFile f(file);
  f.write(kMagic, 8);
  f.write(&hlen, 8);
  f.write(&hcrc, 4);
  f.write(&zero, 4);
  f.write(h);
  f.write(pad, align_up(f.written()) - f.written());
  const uint64_t data_start = f.written();
  // Padding goes before each tensor, not after the last, so that the file
  // ends with data and any truncation cuts into a tensor the reader checks.
  for (size_t i = 0; i < items_.size(); ++i) {
    const uint64_t at = hdr["tensors"][i]["offset"].get<uint64_t>();
    f.write(pad, at - (f.written() - data_start));
    f.write(items_[i].t.data, items_[i].t.bytes());
  }
  f.commit();
  return hcrc;
}

void CheckpointWriter::write_meta(const std::string& root, int64_t step, const std::string& json) {
  const fs::path dir = step_path(root, step);
  try {
    (void)nlohmann::json::parse(json);
  } catch (const nlohmann::json::exception& e) {
    throw Error(cat("checkpoint metadata for ", dir.string(), " is not valid JSON (", e.what(), ")"));
  }
  if (fs::exists(dir / kComplete))
    throw Error(cat("checkpoint ", dir.string(), " is already complete; refusing to rewrite its ", kMeta));
  ensure_dir(dir);
  write_file_atomic((dir / kMeta).string(), json);
}

void CheckpointWriter::mark_complete(const std::string& root, int64_t step) {
  const fs::path dir = step_path(root, step);
  if (!fs::exists(dir / kMeta))
    throw Error(cat("cannot mark ", dir.string(), " complete: ", kMeta, " is missing (call write_meta first)"));
  if (!fs::exists(dir / rank_file_name(0)))
    throw Error(cat("cannot mark ", dir.string(), " complete: ", rank_file_name(0), " is missing"));
  nlohmann::json meta;
  const std::string meta_text = read_file((dir / kMeta).string(), "checkpoint metadata");
  try {
    meta = nlohmann::json::parse(meta_text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(cat((dir / kMeta).string(), ": not valid JSON (", e.what(), ")"));
  }
  if (meta.is_object() && meta.contains("world_size") && meta["world_size"].is_number_integer()) {
    int64_t ws = meta["world_size"].get<int64_t>();
    for (int64_t r = 0; r < ws; ++r)
      if (!fs::exists(dir / rank_file_name(static_cast<int>(r))))
        throw Error(cat("cannot mark ", dir.string(), " complete: ", rank_file_name(static_cast<int>(r)),
                        " is missing (world_size ", ws, " in ", kMeta, "); did every rank write its shard before the barrier?"));
    // Shards of ranks >= world_size can only be left over from an interrupted
    // save of this step with a larger world; readers count shards, so drop them.
    for (const auto& e : fs::directory_iterator(dir)) {
      std::string n = e.path().filename().string();
      int r = -1;
      if (std::sscanf(n.c_str(), "rank_%d.bin", &r) == 1 && n == rank_file_name(r) && r >= ws) fs::remove(e.path());
    }
  }
  // The marker certifies meta.json as it is now: a digit changed later (the
  // step, the data position) no longer matches and the checkpoint is refused.
  write_file_atomic((dir / kComplete).string(),
                    cat("{\"step\": ", step, ", \"meta_bytes\": ", meta_text.size(), ", \"meta_crc32\": ",
                        crc32(meta_text.data(), meta_text.size()), "}\n"));
}

// ---------------------------------------------------------------------------
// Listing and pruning
// ---------------------------------------------------------------------------

std::vector<CheckpointInfo> list_checkpoints(const std::string& root) {
  std::vector<CheckpointInfo> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    std::optional<int64_t> shaped;
    if (!step_shaped(name, shaped)) continue;
    const auto step = parse_step_dir(name);
    if (!step) {
      warn_alias(root, name, shaped);
      continue;
    }
    std::error_code dec;
    if (!e.is_directory(dec)) refuse_non_folder(root, e.path(), *step);  // follows links: a link to a folder is one
    out.push_back({*step, e.path().string(), fs::exists(e.path() / kComplete)});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

std::optional<CheckpointInfo> latest_complete(const std::string& root) {
  auto all = list_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (it->complete) return *it;
  return std::nullopt;
}

CheckpointInfo find_step(const std::string& root, int64_t step) {
  for (const auto& c : list_checkpoints(root)) {
    if (c.step != step) continue;
    if (!c.complete)
      throw Error(cat("checkpoint ", c.dir, " is incomplete (no ", kComplete,
                      " marker: its save was interrupted) and cannot be used; complete checkpoints in ", root, ": ",
                      complete_steps(root)));
    return c;
  }
  std::error_code ec;
  throw Error(cat("no checkpoint for step ", step, " in ", root,
                  fs::exists(root, ec) ? "" : " (the folder does not exist)", "; complete checkpoints: ",
                  complete_steps(root)));
}

std::string checkpoint_damage(const CheckpointInfo& c) {
  if (!c.complete) return cat("no ", kComplete, " marker: its save was interrupted");
  try {
    CheckpointReader r(c.dir, 0);  // the marker, meta.json's certificate, rank 0's header
  } catch (const std::exception& e) {  // a file system error too: whatever cannot be read is not counted on
    return e.what();
  }
  return "";
}

std::vector<std::string> prune(const std::string& root, int keep_last, const DamageCheck& damage) {
  std::vector<std::string> removed;
  if (keep_last <= 0) return removed;
  auto all = list_checkpoints(root);
  // Only checkpoints that can be counted on count: a damaged one among the
  // newest would otherwise take a good one's place, and the good one would go.
  std::vector<const CheckpointInfo*> good;
  for (const auto& c : all) {
    if (!c.complete) continue;
    if (const std::string why = damage(c); !why.empty()) {
      warn_once(cat("checkpoint ", c.dir, " is damaged (", why, "): it does not count toward checkpoint.keep_last "
                    "and is left in place; move it out of ", root, " or remove it"));
      continue;
    }
    good.push_back(&c);
  }
  if (good.empty()) return removed;  // nothing proven good yet: keep everything
  const int64_t newest = good.back()->step;
  std::set<int64_t> keep;
  for (size_t i = good.size() > static_cast<size_t>(keep_last) ? good.size() - keep_last : 0; i < good.size(); ++i)
    keep.insert(good[i]->step);
  for (const auto& c : all) {
    // Older than the newest good one: surplus good ones and interrupted saves.
    // Damaged complete ones stay (reported above): they are not this prune's to judge.
    if (c.step >= newest || keep.count(c.step)) continue;
    if (c.complete && std::none_of(good.begin(), good.end(), [&](const CheckpointInfo* g) { return g->step == c.step; }))
      continue;
    // Rename first (atomic), then delete: a crash mid-delete must not leave a
    // directory that still looks like a complete checkpoint with missing shards.
    fs::path victim(c.dir);
    fs::path trash = victim.parent_path() / ("." + victim.filename().string() + ".deleting");
    std::error_code ec;
    fs::remove_all(trash, ec);
    fs::rename(victim, trash, ec);
    if (ec) throw Error(cat("cannot remove old checkpoint ", c.dir, ": ", ec.message()));
    fsync_dir(root);
    fs::remove_all(trash, ec);
    if (ec) throw Error(cat("cannot remove old checkpoint ", trash.string(), ": ", ec.message()));
    removed.push_back(c.dir);
  }
  // Leftovers of a prune that crashed after its rename.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    std::string n = e.path().filename().string();
    if (n.size() > 10 && n[0] == '.' && n.ends_with(".deleting") && parse_step_dir(n.substr(1, n.size() - 10)))
      fs::remove_all(e.path(), ec);
  }
  return removed;
}

// ---------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------

CheckpointReader::CheckpointReader(std::string dir, int rank) : dir_(std::move(dir)) {
  const fs::path d(dir_);
  file_ = (d / rank_file_name(rank)).string();
  if (!fs::is_directory(d))
    throw Error(cat("checkpoint directory ", dir_, fs::exists(d) ? " is not a folder" : " does not exist"));
  if (!fs::exists(d / kComplete)) {
    // The folder above, also for "step_00000009/" (whose parent_path is itself).
    fs::path root = d.lexically_normal();
    if (root.filename().empty()) root = root.parent_path();
    root = root.parent_path();
    if (root.empty()) root = ".";
    throw Error(cat("checkpoint ", dir_, " is incomplete (no ", kComplete,
                    " marker: its save was interrupted) and cannot be used; complete checkpoints in ",
                    root.string(), ": ", complete_steps(root.string())));
  }
  // The folder's own name, also for "step_00000009/" (whose filename is empty).
  fs::path named_dir = d.lexically_normal();
  if (named_dir.filename().empty()) named_dir = named_dir.parent_path();
  {
    // A marker without meta.json: the metadata was deleted or moved after the save.
    struct stat mst {};
    if (::lstat((d / kMeta).c_str(), &mst) != 0 && errno == ENOENT)
      throw CheckpointDamaged(cat("checkpoint ", dir_, " has its ", kComplete, " marker but no ", kMeta,
                                  " (removed or moved after the checkpoint was written; it records the step, the "
                                  "layout and the data position, so the rank files cannot be read without it). If "
                                  "it was moved, put it back", kUnusable));
  }
  meta_ = read_file((d / kMeta).string(), "checkpoint metadata");
  {
    // COMPLETE records the step and meta.json's size and CRC (checkpoints of
    // older looms record the step only: "legacy", read without those checks;
    // CheckpointSet refuses that form for a meta.json of a version that
    // always had them). Every field is type-checked: a marker edited by hand
    // is refused naming the key, never met with a JSON library's type error.
    const std::string where = (d / kComplete).string();
    const JsonFields f(where, cat(" (a marker damaged or edited by hand)", kUnusable));
    nlohmann::json c;
    try {
      c = nlohmann::json::parse(read_file(where, "checkpoint marker"));
    } catch (const nlohmann::json::exception& e) {
      throw CheckpointDamaged(cat(where, ": not valid JSON (", e.what(), ")", kUnusable));
    }
    step_ = f.integer_at(c, "", "step");
    if (const auto named = named_step(named_dir.filename().string()); named && *named != step_)
      throw CheckpointDamaged(cat("checkpoint ", dir_, " is named for step ", *named, " but holds step ", step_,
                                  " (its ", kComplete, " marker says so): a folder renamed or copied over another",
                                  kUnusable));
    legacy_ = !c.contains("meta_crc32") && !c.contains("meta_bytes");
    if (!legacy_) {
      const uint64_t bytes = static_cast<uint64_t>(f.integer_at(c, "", "meta_bytes"));
      std::string key;
      const uint32_t want = f.crc32(f.member(c, "", "meta_crc32", key, "a CRC32: an integer in [0, 4294967295]"), key);
      const uint32_t got = crc32(meta_.data(), meta_.size());
      if (bytes != meta_.size() || want != got)
        throw CheckpointDamaged(cat((d / kMeta).string(), " was changed after the checkpoint was written (",
                                    meta_.size(), " bytes with CRC32 ", got, "; ", kComplete, " certifies ", bytes,
                                    " bytes with CRC32 ", want,
                                    "): its step, data position or layout can no longer be trusted", kUnusable));
    }
  }
  for (const auto& e : fs::directory_iterator(d)) {
    std::string n = e.path().filename().string();
    int r = -1;
    if (std::sscanf(n.c_str(), "rank_%d.bin", &r) == 1 && n == rank_file_name(r)) ++num_ranks_;
  }
  if (!fs::exists(file_))
    throw CheckpointDamaged(cat("checkpoint ", dir_, " has no shard for rank ", rank, " (", file_,
                                " missing; it holds ", num_ranks_, " shard(s))", kUnusable));

  auto bad = [&](const std::string& what) { return CheckpointDamaged(cat(file_, ": ", what, kUnusable)); };
  // A regular file only: open() of a FIFO in its place would block for ever.
  Fd fd{open_regular_file(file_, "checkpoint shard")};
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) throw Error(cat("cannot stat ", file_, ": ", std::strerror(errno)));
  file_size_ = static_cast<uint64_t>(st.st_size);
  char prefix[kPrefixBytes];
  if (file_size_ < kPrefixBytes || !pread_all(fd.fd, prefix, kPrefixBytes, 0))
    throw bad(cat("file is ", file_size_, " bytes, too short for a shard header (truncated)"));
  if (std::memcmp(prefix, kMagic, 8) != 0) throw bad("not a Loom checkpoint shard (bad magic; garbage header)");
  uint64_t hlen;
  uint32_t hcrc;
  std::memcpy(&hlen, prefix + 8, 8);
  std::memcpy(&hcrc, prefix + 16, 4);
  if (hlen == 0 || hlen > kMaxHeaderBytes || hlen > file_size_ - kPrefixBytes)
    throw bad(cat("header length ", hlen, " is impossible for a file of ", file_size_, " bytes (garbage or truncated header)"));
  std::string h(hlen, '\0');
  if (!pread_all(fd.fd, h.data(), hlen, kPrefixBytes)) throw bad("header is truncated");
  if (crc32(h.data(), h.size()) != hcrc) throw bad("header is corrupt (CRC mismatch)");
  header_crc_ = hcrc;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(h);
  } catch (const nlohmann::json::exception& e) {
    throw bad(cat("header is not valid JSON (", e.what(), ")"));
  }
  // Every field is type-checked (a header re-certified by hand can hold anything).
  const JsonFields f(file_ + " (header)", kUnusable);
  if (!j.is_object()) f.fail("(the whole header)", j, "a JSON object");
  {
    std::string key;
    const nlohmann::json& format = f.member(j, "", "format", key, "1");
    if (f.integer(format, key) != 1)
      throw bad(cat("header has format ", format.dump(), ", not 1: not a shard this loom reads (written by a newer Loom?)"));
  }
  // Every rank file records whose it is: a file renamed to another rank, or
  // copied in from another step, is refused instead of loaded as this one.
  if (const int64_t written_by = f.integer_at(j, "", "rank"); written_by != rank)
    throw bad(cat("the file was written by rank ", written_by, ", not rank ", rank,
                  " (a rank file renamed or copied from elsewhere)"));
  if (j.contains("step")) {
    if (const int64_t s = f.integer_at(j, "", "step"); s != step_)
      throw bad(cat("the file belongs to step ", s, ", not to step ", step_,
                    " of this checkpoint (a rank file copied in from another checkpoint)"));
  } else if (!legacy_) {
    throw bad(cat("the file records no step, but this checkpoint was written by a loom that records it in every "
                  "rank file (a rank file copied in from an older checkpoint)"));
  }
  data_start_ = align_up(kPrefixBytes + hlen);
  const uint64_t data_bytes = file_size_ >= data_start_ ? file_size_ - data_start_ : 0;
  const nlohmann::json& list = f.array_at(j, "", "tensors");
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& t = list[i];
    const std::string at = cat("tensors[", i, "]");
    f.object(t, at);
    TensorRecord r;
    r.name = f.string_at(t, at, "name");
    const std::string dtype = f.string_at(t, at, "dtype");
    auto dt = parse_dtype(dtype);
    if (!dt) throw bad(cat("tensor '", r.name, "' has unknown dtype \"", dtype, "\""));
    r.dtype = *dt;
    const nlohmann::json& shape = f.array_at(t, at, "shape");
    if (shape.size() > static_cast<size_t>(Tensor::kMaxDims))
      throw bad(cat("tensor '", r.name, "' has ", shape.size(), " dims (at most ", Tensor::kMaxDims, ")"));
    // The product is checked, so that the byte count below cannot wrap.
    uint64_t numel = 1;
    bool overflow = false;
    for (size_t k = 0; k < shape.size(); ++k) {
      r.shape.push_back(f.integer(shape[k], cat(at, ".shape[", k, "]")));
      overflow = overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(r.shape.back()), &numel);
    }
    uint64_t need = 0;
    if (overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(r.dtype)), &need))
      throw bad(cat("tensor '", r.name, "' has shape ", r.shape_str(), ", too large for any file"));
    r.offset = static_cast<uint64_t>(f.integer_at(t, at, "offset"));
    r.bytes = static_cast<uint64_t>(f.integer_at(t, at, "bytes"));
    {
      std::string key;
      r.crc32 = f.crc32(f.member(t, at, "crc32", key, "a CRC32: an integer in [0, 4294967295]"), key);
    }
    if (r.bytes != need)
      throw bad(cat("tensor '", r.name, "' records ", r.bytes, " bytes but ", dtype_name(r.dtype), " ", r.shape_str(),
                    " needs ", need));
    if (r.offset > data_bytes || r.bytes > data_bytes - r.offset)
      throw bad(cat("tensor '", r.name, "' lies beyond the end of the file (", file_size_,
                    " bytes): the shard is truncated"));
    if (index_.count(r.name)) throw bad(cat("tensor '", r.name, "' appears twice in the header"));
    index_[r.name] = tensors_.size();
    tensors_.push_back(std::move(r));
  }
}

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> n;
  for (const auto& t : tensors_) n.push_back(t.name);
  return n;
}

const TensorRecord& CheckpointReader::info(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    std::string some;
    for (size_t i = 0; i < tensors_.size() && i < 6; ++i) some += (i ? ", " : "") + tensors_[i].name;
    if (tensors_.size() > 6) some += ", ...";
    throw Error(cat(file_, ": no tensor '", name, "' in this checkpoint (it holds ", tensors_.size(), ": ", some,
                    "); was it written by a different model or sharding configuration?"));
  }
  return tensors_[it->second];
}

void CheckpointReader::read(const std::string& name, Tensor& dst) const {
  const auto& r = info(name);
  std::vector<int64_t> dshape(dst.shape.begin(), dst.shape.begin() + dst.ndim);
  if (dst.dtype != r.dtype || dshape != r.shape)
    throw Error(cat(file_, ": tensor '", name, "' is ", dtype_name(r.dtype), " ", r.shape_str(),
                    " in the checkpoint but the destination is ", dtype_name(dst.dtype), " ", shape_string(dshape),
                    "; the model or precision configuration differs from the one that saved it"));
  if (dst.device != Device::cpu)
    throw Error(cat(file_, ": tensor '", name, "': read into a host tensor, then copy it to the device"));
  if (!dst.is_contiguous() || (r.bytes > 0 && dst.data == nullptr))
    throw Error(cat(file_, ": tensor '", name, "': the destination must be a contiguous tensor with memory"));
  Fd fd{open_regular_file(file_, "checkpoint shard")};  // replaced since the header was read: still no FIFO
  if (!pread_all(fd.fd, dst.data, r.bytes, data_start_ + r.offset))
    throw CheckpointDamaged(
        cat(file_, ": tensor '", name, "' could not be read (", std::strerror(errno), " or truncated file)", kUnusable));
  if (crc32(dst.data, r.bytes) != r.crc32)
    throw CheckpointDamaged(cat(file_, ": tensor '", name, "' is corrupt (CRC mismatch)", kUnusable));
}

}  // namespace loom::ckpt
