// Memory (docs/RELIABILITY.md "Memory"): the memory plan is compared with the
// memory available — the tightest memory cgroup above the process (v1 or v2,
// every level), the machine's MemAvailable, or the GPU's free memory — before
// anything is allocated, and a plan that does not fit is refused with the plan
// and what to change, instead of an OOM kill. The cgroup case runs `loom`
// inside a real 1 GiB memory cgroup and needs root: it skips with a message
// otherwise (CI runs as root).
#include <gtest/gtest.h>
#include <unistd.h>

#include "config/run_config.hpp"
#include "reliability_util.hpp"
#include "test_util.hpp"
#include "train/memory_budget.hpp"
#include "train/session_probe.hpp"
#include "train/train_state.hpp"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

constexpr uint64_t MiB = 1ull << 20, GiB = 1ull << 30;

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

// A memory cgroup of `limit` bytes made for the test (v1 or v2, beside this
// process's own), removed at the end. ok() is false where it cannot be made.
class MemoryCgroup {
 public:
  explicit MemoryCgroup(uint64_t limit) {
    if (::geteuid() != 0) {
      why_ = "needs root";
      return;
    }
    std::ifstream cg("/proc/self/cgroup");
    for (std::string line; std::getline(cg, line);) {
      const size_t a = line.find(':'), b = line.find(':', a + 1);
      const std::string ctl = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
      if (ctl.find("memory") != std::string::npos && try_make("/sys/fs/cgroup/memory" + path, "memory.limit_in_bytes", limit))
        return;
      if (ctl.empty() && try_make("/sys/fs/cgroup" + path, "memory.max", limit)) return;
    }
    if (why_.empty()) why_ = "no writable memory cgroup hierarchy";
  }
  ~MemoryCgroup() {
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  bool ok() const { return !dir_.empty(); }
  const std::string& why() const { return why_; }
  // `program args...` run inside the cgroup: a shell moves itself in, then
  // execs the program (same pid), which so starts under the limit.
  std::string run_inside(const std::string& program_and_args) const {
    return "sh -c 'echo $$ > \"" + (fs::path(dir_) / "cgroup.procs").string() + "\" && exec \"$0\" \"$@\"' " +
           program_and_args;
  }

 private:
  bool try_make(const fs::path& parent, const char* limit_file, uint64_t limit) {
    if (!fs::is_directory(parent)) return false;
    const fs::path d = parent / ("loom_test_" + std::to_string(::getpid()));
    ::rmdir(d.c_str());
    if (::mkdir(d.c_str(), 0755) != 0) {
      why_ = "cannot create a cgroup under " + parent.string();
      return false;
    }
    std::ofstream(d / limit_file) << limit;
    std::ifstream check(d / limit_file);
    uint64_t got = 0;
    if (!(check >> got) || got != limit) {
      ::rmdir(d.c_str());
      why_ = "cannot set " + std::string(limit_file);
      return false;
    }
    dir_ = d.string();
    return true;
  }
  std::string dir_, why_;
};

}  // namespace

// The budget from cgroup and meminfo files (a fake tree: no root needed).
TEST(ReliabilityMemory, BudgetIsTheTightestCgroupLevelOrMemAvailable) {
  const fs::path d = fresh_dir("memory_files");
  // v1 memory at <d>/v1 with the process in /job/step; v2 at <d>/v2 in /a/b.
  write(d / "mountinfo",
        "31 23 0:28 / " + (d / "v1").string() + " rw,relatime - cgroup cgroup rw,memory\n" +
        "41 31 0:38 / " + (d / "v2").string() + " rw,relatime - cgroup2 cgroup2 rw\n");
  write(d / "cgroup", "4:memory:/job/step\n0::/a/b\n");
  write(d / "meminfo", "MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n");  // 16 GiB
  // v1: the job allows 4 GiB with 3.5 GiB used, of which 1 GiB is droppable cache: 1.5 GiB left.
  write(d / "v1/job/memory.limit_in_bytes", std::to_string(4 * GiB));
  write(d / "v1/job/memory.usage_in_bytes", std::to_string(3584 * MiB));
  write(d / "v1/job/memory.stat", "cache 0\ntotal_inactive_file " + std::to_string(GiB) + "\n");
  write(d / "v1/job/step/memory.limit_in_bytes", "9223372036854771712");  // no limit, v1's way
  loom::HostMemoryFiles f{(d / "cgroup").string(), (d / "mountinfo").string(), (d / "meminfo").string()};
  loom::MemoryBudget b = loom::host_memory_budget(f);
  EXPECT_EQ(b.available, 1536 * MiB);
  EXPECT_CONTAINS(b.source, (d / "v1" / "job").string());
  EXPECT_CONTAINS(b.source, "memory.limit_in_bytes");
  // v2: a tighter limit on the leaf (1 GiB, 200 MiB used) wins.
  write(d / "v2/a/memory.max", "max");
  write(d / "v2/a/b/memory.max", std::to_string(GiB));
  write(d / "v2/a/b/memory.current", std::to_string(200 * MiB));
  b = loom::host_memory_budget(f);
  EXPECT_EQ(b.available, 824 * MiB);
  EXPECT_CONTAINS(b.source, "memory.max");
  // No cgroup limit anywhere: MemAvailable.
  write(d / "cgroup", "0::/\n");
  b = loom::host_memory_budget(f);
  EXPECT_EQ(b.available, 16 * GiB);
  EXPECT_CONTAINS(b.source, "MemAvailable");
  // Nothing readable: unknown (no refusal can come from it).
  b = loom::host_memory_budget({"/nonexistent", "/nonexistent", "/nonexistent"});
  EXPECT_FALSE(b.known());
}

// The documented default: an empty config builds 134M parameters and plans about 3.5 GiB.
TEST(ReliabilityMemory, EmptyConfigIsWhatTheDocsSay) {
  loom::Config c = loom::parse_config_string("", "empty.toml", {});
  EXPECT_EQ(c.model.spec.total_params(), 134105856);
  loom::Session s(c);
  const double gib = static_cast<double>(loom::probe(s).memory_plan().total_bytes()) / static_cast<double>(GiB);
  EXPECT_GT(gib, 3.3);
  EXPECT_LT(gib, 3.6);
}

// The peak resident memory of this process so far.
size_t peak_rss_bytes() {
  std::ifstream st("/proc/self/status");
  for (std::string line; std::getline(st, line);)
    if (line.rfind("VmHWM:", 0) == 0) return static_cast<size_t>(std::stoull(line.substr(6))) * 1024;
  return 0;
}

// The plan's floor (loom::plan_floor, what is compared before any layer or
// expert exists) is a lower bound of the detailed plan, for every kind of
// model: dense and MoE, native and fused layers (with and without a head
// chunk), tied embeddings, recompute: it never refuses a run that fits.
TEST(ReliabilityMemory, PlanFloorIsALowerBoundOfTheDetailedPlan) {
  const fs::path dir = fresh_dir("memory_floor");
  const std::string moe = "model.ffn=\"moe\"";
  for (const std::vector<std::string>& ov : std::vector<std::vector<std::string>>{
           {},
           {"model.layers=\"fused\""},
           {"model.layers=\"fused\"", "model.head_chunk=16"},
           {"model.tied_embeddings=true", "model.recompute=\"full\""},
           {moe, "model.num_experts=8", "model.top_k=2"},
           {moe, "model.num_experts=64", "model.top_k=8", "model.layers=\"fused\"", "model.recompute=\"full\""},
           {"train.micro_batch=64", "train.seq_len=64", "model.vocab_size=5000"}}) {
    std::string trace;
    for (const auto& o : ov) trace += o + " ";
    SCOPED_TRACE(trace);
    loom::Session s(loom::parse_config_string(tiny_config(dir / "run"), "floor.toml", ov));
    const loom::PlanFloor f = loom::plan_floor(s.config(), s.spec(), loom::probe(s).precision().dtypes(), 1);
    EXPECT_EQ(f.params, static_cast<long double>(s.spec().total_params()));
    EXPECT_GT(f.plan, 0.0L);
    EXPECT_LE(f.plan, static_cast<long double>(loom::probe(s).memory_plan().total_bytes()));
    EXPECT_LE(f.state, static_cast<long double>(loom::probe(s).memory_plan().category_bytes(loom::MemCategory::params) +
                                                loom::probe(s).memory_plan().category_bytes(loom::MemCategory::grads) +
                                                loom::probe(s).memory_plan().category_bytes(loom::MemCategory::optimizer) +
                                                loom::probe(s).memory_plan().category_bytes(loom::MemCategory::master)));
    EXPECT_LE(f.activations, static_cast<long double>(loom::probe(s).memory_plan().category_bytes(loom::MemCategory::activations)));
  }
}

// A config whose state cannot fit this machine's memory is refused from its
// numbers, before any layer or expert is built: the process does not grow by
// the gigabytes that describing a million experts takes (before, 4096 layers
// of 4096 experts took 20 GB and 78 s to be refused by the detailed plan).
TEST(ReliabilityMemory, PlanThatCannotFitIsRefusedBeforeAnyLayerIsBuilt) {
  const fs::path dir = fresh_dir("memory_early");
  const size_t before = peak_rss_bytes();
  // 256 layers of 4096 experts: 32B parameters (about 480 GiB of fp32 state
  // and AdamW moments) in 3.1M tensors.
  loom::Config c = loom::parse_config_string(tiny_config(dir / "run"), "early.toml",
                                             {"model.ffn=\"moe\"", "model.num_experts=4096", "model.num_layers=256"});
  try {
    loom::Session s(std::move(c));
    const loom::MemoryBudget b = loom::host_memory_budget();
    if (!b.known() || b.available > 1024 * GiB) GTEST_SKIP() << "this machine could hold the plan";
    ADD_FAILURE() << "a plan of about 480 GiB was not refused";
  } catch (const loom::MemoryPlanError& e) {
    const std::string msg = e.what();
    EXPECT_CONTAINS(msg, "the memory plan cannot fit: before anything is planned in detail");
    EXPECT_CONTAINS(msg, "32.28B parameters x 16 bytes");
    EXPECT_CONTAINS(msg, "describing the 3147523 parameter tensors");
    EXPECT_CONTAINS(msg, "model.num_experts = 4096");
    EXPECT_CONTAINS(msg, "Nothing was built");
  }
  EXPECT_LT(peak_rss_bytes(), before + 256 * MiB) << "the layers were built before the refusal";
}

// In a 1 GiB cgroup: the empty config is refused with the plan and the fix
// (not OOM-killed); a small config trains in the same cgroup.
TEST(ReliabilityMemory, PlanLargerThanTheCgroupIsRefusedNotKilled) {
  MemoryCgroup cg(GiB);
  if (!cg.ok()) GTEST_SKIP() << "cannot make a 1 GiB memory cgroup (" << cg.why() << "); CI runs this as root";
  const fs::path dir = fresh_dir("memory_cgroup");
  std::ofstream(dir / "empty.toml") << "";
  for (const char* cmd : {"train", "check"}) {
    SCOPED_TRACE(cmd);
    const ProcResult r = run_shell("cd '" + dir.string() + "' && timeout 300 " +
                                   cg.run_inside(std::string("'") + LOOM_CLI + "' " + cmd + " empty.toml"));
    EXPECT_EQ(r.signal, 0) << r.out;
    EXPECT_EQ(r.code, 1) << r.out;
    // Its state alone (134M parameters of 16 bytes) exceeds the limit: refused
    // from the config's numbers, before the detailed plan.
    EXPECT_CONTAINS(r.out, "the memory plan cannot fit");
    EXPECT_CONTAINS(r.out, "134.11M parameters x 16 bytes");
    EXPECT_CONTAINS(r.out, "the memory cgroup");
    EXPECT_CONTAINS(r.out, "train.micro_batch (8)");
    EXPECT_CONTAINS(r.out, "model.hidden = 768");
    EXPECT_CONTAINS(r.out, "Nothing was built");
  }
  EXPECT_FALSE(fs::exists(dir / "runs" / "run" / "metrics.jsonl"));
  const fs::path cfg = dir / "small.toml";
  std::ofstream(cfg) << tiny_config(dir / "small", 3);
  const ProcResult ok = run_shell("timeout 300 " + cg.run_inside(std::string("'") + LOOM_CLI + "' train '" + cfg.string() + "'"));
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_EQ(count_lines(dir / "small" / "metrics.jsonl"), 3);
}
