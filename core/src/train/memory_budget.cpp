#include "train/memory_budget.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <vector>

#include <cctype>
#include <cmath>

#include "loom/config.hpp"
#include "loom/error.hpp"

namespace fs = std::filesystem;

namespace loom {
namespace {

struct CgroupMount {
  std::string mount_point, root;
  bool found = false;
};

// A number from a one-line cgroup file; UINT64_MAX for "max" or a missing file.
uint64_t read_limit(const fs::path& file) {
  std::ifstream in(file);
  std::string word;
  if (!(in >> word) || word == "max") return UINT64_MAX;
  try {
    return std::stoull(word);
  } catch (const std::exception&) {
    return UINT64_MAX;
  }
}

// "key value" lines (memory.stat, /proc/meminfo); -1 when the key is absent.
int64_t read_keyed(const fs::path& file, const std::string& key) {
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string k;
    int64_t v = 0;
    if ((ls >> k >> v) && (k == key || k == key + ":")) return v;
  }
  return -1;
}

// Where the cgroup v2 hierarchy and the v1 memory hierarchy are mounted.
void find_mounts(const std::string& mountinfo, CgroupMount& v2, CgroupMount& v1) {
  std::ifstream in(mountinfo);
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::vector<std::string> f;
    for (std::string w; ls >> w;) f.push_back(w);
    auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 5 || dash == f.end() || dash + 3 > f.end()) continue;
    const std::string& type = *(dash + 1);
    const std::string& opts = *(dash + 3);
    if (type == "cgroup2" && !v2.found) v2 = {f[4], f[3], true};
    if (type == "cgroup" && !v1.found) {
      std::istringstream os(opts);
      for (std::string o; std::getline(os, o, ',');)
        if (o == "memory") v1 = {f[4], f[3], true};
    }
  }
}

// The folder of this process's cgroup under a mount, from /proc/self/cgroup's path.
fs::path cgroup_dir(const CgroupMount& m, std::string path) {
  if (m.root != "/" && path.rfind(m.root, 0) == 0) path = path.substr(m.root.size());
  return fs::path(m.mount_point) / fs::path(path).relative_path();
}

}  // namespace

std::string human_bytes(double b) {
  std::ostringstream m;
  if (b >= 1024.0 * 1024.0 * 1024.0) m << std::fixed << std::setprecision(2) << b / (1024.0 * 1024.0 * 1024.0) << " GiB";
  else m << std::fixed << std::setprecision(1) << b / (1024.0 * 1024.0) << " MiB";
  return m.str();
}

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20, kGiB = uint64_t{1} << 30;

struct NamedGpu {
  const char* key;
  const char* name;
  uint64_t mib;  // nvidia-smi's memory.total
};
constexpr NamedGpu kGpus[] = {
    {"h100", "NVIDIA H100 80GB HBM3", 81559},
    {"h200", "NVIDIA H200 141GB HBM3e", 143771},
    {"a100-80gb", "NVIDIA A100-SXM4-80GB", 81920},
    {"a100-40gb", "NVIDIA A100-SXM4-40GB", 40960},
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

uint64_t parse_memory_size(const std::string& text, const std::string& flag) {
  const std::string how =
      "; write a size such as 80GiB, 81559MiB or 141GB (units B, KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, "
      "TiB in powers of 1024), or name the card with --gpu (" + named_gpu_list() + ")";
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const std::string number = text.substr(0, i);
  std::string unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  double value = 0;
  size_t used = 0;
  try {
    value = number.empty() ? -1 : std::stod(number, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (number.empty() || used != number.size() || !std::isfinite(value))
    throw Error(cat(flag, " ", text, ": '", text, "' does not start with a number", how));
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1.0},    {"b", 1.0},    {"kb", 1e3},     {"mb", 1e6},     {"gb", 1e9},     {"tb", 1e12},
      {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  double mult = -1;
  for (const auto& [u, m] : kUnits)
    if (lower(unit) == u) mult = m;
  if (mult < 0) throw Error(cat(flag, " ", text, ": '", unit, "' is not a unit of memory", how));
  const double bytes = value * mult;
  auto in_range = [](double b) { return b >= static_cast<double>(kGiB) && b <= std::ldexp(1.0, 50); };
  if (!in_range(bytes))
    throw Error(cat(flag, " ", text, " is ",
                    bytes < static_cast<double>(kMiB) ? cat(static_cast<uint64_t>(bytes), " bytes") : human_bytes(bytes),
                    ": a GPU's memory is between 1 GiB and 1 PiB",
                    // A number with no unit read as GiB, where that would be a card's memory.
                    unit.empty() && in_range(value * static_cast<double>(kGiB)) ? cat(" (did you mean ", number, "GiB?)")
                                                                                 : std::string(),
                    how));
  return static_cast<uint64_t>(bytes);
}

std::string named_gpu_list() {
  std::string out;
  for (const NamedGpu& g : kGpus)
    out += cat(out.empty() ? "" : ", ", g.key, " (", human_bytes(static_cast<double>(g.mib * kMiB)), ")");
  return out;
}

PlannedDevice named_gpu(const std::string& name) {
  const std::string key = lower(name);
  for (const NamedGpu& g : kGpus)
    if (key == g.key) return {cat(g.name, " (--gpu ", g.key, ")"), g.mib * kMiB};
  std::vector<std::string> keys;
  for (const NamedGpu& g : kGpus) keys.emplace_back(g.key);
  const std::string near = did_you_mean(key, keys);
  throw Error(cat("--gpu ", name, " is not a GPU loom knows", near.empty() ? "" : cat(" (did you mean '", near, "'?)"),
                  ": one of ", named_gpu_list(), "; for another card give its memory with --device-memory (e.g. "
                  "--device-memory 94GiB)"));
}

OutsideArena outside_arena_estimate(int world, int local_world, bool launched) {
  // Measured (memory_budget.hpp): 0.57 GiB beyond the arena for a process
  // started alone, 1.89 GiB for one rank started by mpirun (MPI and NCCL up,
  // no peer), 1.8-2.2 GiB on four ranks of a node. NCCL's buffers to its
  // peers (connected at the first collective) are taken as 128 MiB on two
  // ranks plus 64 MiB for each further rank on the node (up to 8) and
  // 128 MiB for the network between nodes.
  OutsideArena o;
  o.context = static_cast<uint64_t>(0.57 * static_cast<double>(kGiB));
  if (launched || world > 1) o.launcher = static_cast<uint64_t>(1.32 * static_cast<double>(kGiB));
  if (world > 1) {
    const int node = std::max(1, std::min(local_world > 0 ? local_world : world, world));
    o.nccl = 128 * kMiB + 64 * kMiB * static_cast<uint64_t>(std::max(0, std::min(node, 8) - 2)) +
             (node < world ? 128 * kMiB : 0);
  }
  return o;
}

MemoryBudget host_memory_budget(const HostMemoryFiles& files) {
  MemoryBudget best;
  auto consider = [&](uint64_t avail, const std::string& source) {
    if (avail < best.available) best = {avail, source};
  };
  CgroupMount v2, v1;
  find_mounts(files.mountinfo, v2, v1);
  std::ifstream cg(files.self_cgroup);
  for (std::string line; std::getline(cg, line);) {
    // "hierarchy:controllers:path"; v2 is "0::path".
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    bool is_v1_memory = false;
    {
      std::istringstream cs(controllers);
      for (std::string c; std::getline(cs, c, ',');) is_v1_memory = is_v1_memory || c == "memory";
    }
    const bool is_v2 = controllers.empty() && line.rfind("0:", 0) == 0;
    const CgroupMount* m = is_v1_memory ? &v1 : is_v2 ? &v2 : nullptr;
    if (!m || !m->found) continue;
    const char* limit_file = is_v2 ? "memory.max" : "memory.limit_in_bytes";
    const char* usage_file = is_v2 ? "memory.current" : "memory.usage_in_bytes";
    const char* cache_key = is_v2 ? "inactive_file" : "total_inactive_file";
    // Every level up to the mount: a parent's limit binds its children too.
    const fs::path top = fs::path(m->mount_point).lexically_normal();
    for (fs::path dir = cgroup_dir(*m, path).lexically_normal();; dir = dir.parent_path()) {
      const uint64_t limit = read_limit(dir / limit_file);
      // v1 reports "no limit" as a huge page-rounded number.
      if (limit != UINT64_MAX && limit < (uint64_t{1} << 62)) {
        const uint64_t usage = read_limit(dir / usage_file);
        const int64_t cache = read_keyed(dir / "memory.stat", cache_key);
        uint64_t used = usage == UINT64_MAX ? 0 : usage;
        if (cache > 0) used -= std::min(used, static_cast<uint64_t>(cache));
        consider(limit > used ? limit - used : 0,
                 cat("the memory cgroup ", dir.string(), " allows ", human_bytes(static_cast<double>(limit)), " (",
                     is_v2 ? "memory.max" : "memory.limit_in_bytes", ") and ", human_bytes(static_cast<double>(used)),
                     " of it is in use"));
      }
      if (dir == top || dir == dir.parent_path() || dir.string().size() <= top.string().size()) break;
    }
  }
  const int64_t kb = read_keyed(files.meminfo, "MemAvailable");
  if (kb >= 0) consider(static_cast<uint64_t>(kb) * 1024, cat("the machine has ", human_bytes(static_cast<double>(kb) * 1024.0),
                                                               " available (MemAvailable in ", files.meminfo, ")"));
  return best;
}

}  // namespace loom
