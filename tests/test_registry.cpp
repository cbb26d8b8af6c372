// Plugin registry: discovery order, every refusal's own message, the not-found
// message, instantiation of a real plugin, and `loom plugins` end to end.
// The plugins come from tests/plugins_broken (one real shared library per case).
#include <dlfcn.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "loom/data.hpp"
#include "loom/error.hpp"
#include "loom/registry.hpp"
#include "loom/version.hpp"
#include "plugin/registry_detail.hpp"

namespace fs = std::filesystem;

// gmock is not linked into the suites, so substring checks are spelled out;
// the whole text is printed on failure.
#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) \
    << "expected to find: " << (part) << "\nin: " << (text)
#define EXPECT_HAS_NOT(text, part) EXPECT_EQ(std::string(text).find(part), std::string::npos) \
    << "expected not to find: " << (part) << "\nin: " << (text)
#define EXPECT_MATCHES(text, re) EXPECT_TRUE(std::regex_search(std::string(text), std::regex(re))) \
    << "expected to match: " << (re) << "\nin: " << (text)

namespace {

const fs::path kBroken = LOOM_TEST_BROKEN_PLUGIN_DIR;

// Sets (or unsets) $LOOM_PLUGIN_PATH for one test and restores it after, so
// that the suite does not depend on the caller's environment.
class ScopedPluginPath {
 public:
  explicit ScopedPluginPath(const std::optional<std::string>& value) {
    if (const char* old = std::getenv("LOOM_PLUGIN_PATH")) old_ = old;
    if (value)
      ::setenv("LOOM_PLUGIN_PATH", value->c_str(), 1);
    else
      ::unsetenv("LOOM_PLUGIN_PATH");
  }
  ~ScopedPluginPath() {
    if (old_)
      ::setenv("LOOM_PLUGIN_PATH", old_->c_str(), 1);
    else
      ::unsetenv("LOOM_PLUGIN_PATH");
  }

 private:
  std::optional<std::string> old_;
};

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const loom::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a loom::Error";
  return "";
}

// Each broken file of tests/plugins_broken and what its message must say
// besides its own path. A scan of that directory must report exactly these.
struct BrokenCase {
  const char* file;
  std::vector<std::string> says;
};
std::vector<BrokenCase> broken_cases() {
  const std::string host_abi = loom::cat(LOOM_ABI_MAJOR, ".", LOOM_ABI_MINOR);
  const std::string ver = loom::version_string();
  return {
      {"libloom-data-garbage.so", {"is not a shared library (it does not start with an ELF header)",
                                   "remove it from the plugin path"}},
      {"libloom-data-plain.so", {"is not a Loom plugin: it exports no 'loom_plugin_entry'", "LOOM_PLUGIN"}},
      {"libloom-data-small.so", {"plugin descriptor is", "this loom needs at least", "Rebuild it against loom " + ver}},
      {"libloom-data-alien.so", {"unknown plugin kind 77"}},
      {"libloom-data-abi_major.so",
       {loom::cat("was built for plugin ABI ", LOOM_ABI_MAJOR + 1, ".0, this loom speaks ", host_abi,
                  ": rebuild the plugin against loom ", ver)}},
      {"libloom-data-abi_minor.so",
       {loom::cat("needs plugin ABI ", LOOM_ABI_MAJOR, ".", LOOM_ABI_MINOR + 7, ", this loom speaks only ", host_abi),
        "upgrade loom"}},
      {"libloom-data-build_id.so",
       {"incompatible toolchain", "the compiler differs", "plugin build id 'othercc-1;",
        loom::cat("this loom's build id '", loom::build_id(), "'")}},
      {"libloom-data-wrong_kind.so", {"the file name says kind 'data' but its descriptor says 'attention'"}},
      {"libloom-data-misnamed.so", {"the file name says plugin 'misnamed' but its descriptor says 'other'"}},
      {"libloom-widget-gadget.so", {"unknown plugin kind 'widget'"}},
  };
}

loom::PluginInit init_for(int rank = 0, int world = 1) {
  loom::PluginInit init;
  init.rank = rank;
  init.world = world;
  return init;
}

// The file an object's code lives in, read from its vtable pointer: proves
// which of two same-named plugins a registry instantiated.
std::string library_of(const void* obj) {
  Dl_info info{};
  const void* vtable = *static_cast<const void* const*>(obj);
  if (!dladdr(vtable, &info) || !info.dli_fname) return "";
  return fs::canonical(info.dli_fname).string();
}

}  // namespace

TEST(RegistryFiles, ParsesPluginFileNames) {
  auto p = loom::detail::parse_plugin_file_name("libloom-attention-cudnn.so");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->kind, loom::PluginKind::attention);
  EXPECT_EQ(p->name, "cudnn");
  p = loom::detail::parse_plugin_file_name("libloom-precision-bf16_pure.so");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->kind, loom::PluginKind::precision);
  EXPECT_EQ(p->name, "bf16_pure");
  p = loom::detail::parse_plugin_file_name("libloom-widget-x.so");
  ASSERT_TRUE(p);
  EXPECT_FALSE(p->kind);
  EXPECT_EQ(p->kind_text, "widget");
  EXPECT_FALSE(loom::detail::parse_plugin_file_name("libloom.so"));
  EXPECT_FALSE(loom::detail::parse_plugin_file_name("libloom-data.so"));
  EXPECT_FALSE(loom::detail::parse_plugin_file_name("libloom-data-.so"));
  EXPECT_FALSE(loom::detail::parse_plugin_file_name("libloom-data-x.so.1"));
}

TEST(RegistryFiles, BuildIdComparesCompilerAbiAndLoomMajorMinor) {
  using loom::detail::build_id_mismatch;
  EXPECT_EQ(build_id_mismatch("gcc-12;cxx11abi-1;loom-0.1", "gcc-12;cxx11abi-1;loom-0.1"), "");
  EXPECT_EQ(build_id_mismatch(loom::build_id(), loom::build_id()), "");
  // Fields a later SDK appends do not make an otherwise equal id incompatible.
  EXPECT_EQ(build_id_mismatch("gcc-12;cxx11abi-1;loom-0.1;cuda-12", "gcc-12;cxx11abi-1;loom-0.1"), "");
  EXPECT_HAS(build_id_mismatch("clang-17;cxx11abi-1;loom-0.1", "gcc-12;cxx11abi-1;loom-0.1"), "compiler");
  EXPECT_HAS(build_id_mismatch("gcc-13;cxx11abi-1;loom-0.1", "gcc-12;cxx11abi-1;loom-0.1"), "compiler");
  EXPECT_HAS(build_id_mismatch("gcc-12;cxx11abi-0;loom-0.1", "gcc-12;cxx11abi-1;loom-0.1"), "C++ library");
  EXPECT_HAS(build_id_mismatch("gcc-12;cxx11abi-1;loom-0.2", "gcc-12;cxx11abi-1;loom-0.1"), "major.minor");
  EXPECT_HAS(build_id_mismatch("gcc-12", "gcc-12;cxx11abi-1;loom-0.1"), "malformed");
}

TEST(RegistryFiles, NearestNameSuggestsCloseNamesOnly) {
  EXPECT_EQ(loom::detail::edit_distance("goood", "good"), 1u);
  EXPECT_EQ(loom::detail::edit_distance("", "abc"), 3u);
  EXPECT_EQ(loom::detail::nearest_name("goood", {"plain", "good", "small"}), "good");
  EXPECT_EQ(loom::detail::nearest_name("cudn", {"naive", "cudnn"}), "cudnn");
  EXPECT_EQ(loom::detail::nearest_name("zzzzzz", {"naive", "cudnn"}), "");
}

TEST(Registry, GoodPluginIsInspectedCreatedAndWorks) {
  ScopedPluginPath env(std::nullopt);
  const fs::path file = kBroken / "libloom-data-good.so";
  loom::PluginRecord rec = loom::PluginRegistry::inspect(file);
  EXPECT_EQ(rec.kind, loom::PluginKind::data);
  EXPECT_EQ(rec.name, "good");
  EXPECT_EQ(rec.version, "1.2.3");
  EXPECT_EQ(rec.build_id, loom::build_id());
  EXPECT_EQ(rec.abi_major, static_cast<uint32_t>(LOOM_ABI_MAJOR));
  EXPECT_EQ(rec.file, file);

  loom::PluginRegistry reg({kBroken});
  auto src = reg.create_as<loom::PluginKind::data>("good", init_for(1, 2));
  ASSERT_TRUE(src);
  loom::DataSpec spec;
  spec.batch = 2;
  spec.seq_len = 3;
  spec.vocab_size = 10;
  spec.rank = 1;
  spec.world = 2;
  src->open(spec);
  std::array<int32_t, 8> tok{};
  src->next(loom::Split::train, tok.data());
  // rank 1 of 2, first batch: rows start at (0*2+1)*2 + r = 2, 3.
  EXPECT_EQ(tok, (std::array<int32_t, 8>{2, 3, 4, 5, 3, 4, 5, 6}));
  const std::string after_one = src->state();
  src->next(loom::Split::train, tok.data());
  const std::array<int32_t, 8> second = tok;
  src->restore(after_one);
  src->next(loom::Split::train, tok.data());
  EXPECT_EQ(tok, second);
  // Objects are destroyed through Plugin's virtual destructor, in the plugin's code.
  src.reset();
}

TEST(Registry, ExplicitFileBypassesTheSearch) {
  ScopedPluginPath env(std::nullopt);
  loom::PluginRegistry reg;  // the broken dir is not on its search path
  auto obj = reg.create(loom::PluginKind::data, "good", init_for(), kBroken / "libloom-data-good.so");
  EXPECT_NE(dynamic_cast<loom::DataSource*>(obj.get()), nullptr);
}

TEST(Registry, EachBrokenFileHasItsOwnMessage) {
  ScopedPluginPath env(std::nullopt);
  for (const auto& c : broken_cases()) {
    SCOPED_TRACE(c.file);
    const fs::path file = kBroken / c.file;
    ASSERT_TRUE(fs::exists(file)) << "tests/plugins_broken did not build " << file;
    std::string msg = error_of([&] { loom::PluginRegistry::inspect(file); });
    EXPECT_HAS(msg, file.string());
    for (const auto& s : c.says) EXPECT_HAS(msg, s);
    // No message may come from another check.
    for (const auto& other : broken_cases()) {
      if (std::string(other.file) != c.file) {
        EXPECT_HAS_NOT(msg, other.says.front());
      }
    }
  }
}

TEST(Registry, CreateRefusesBrokenFilesBeforeCallingTheirFactory) {
  ScopedPluginPath env(std::nullopt);
  loom::PluginRegistry reg({kBroken});
  for (const auto& c : broken_cases()) {
    auto parsed = loom::detail::parse_plugin_file_name(c.file);
    ASSERT_TRUE(parsed);
    if (parsed->kind != loom::PluginKind::data) continue;
    SCOPED_TRACE(c.file);
    std::string msg = error_of([&] { reg.create(loom::PluginKind::data, parsed->name, init_for()); });
    EXPECT_HAS(msg, (kBroken / c.file).string());
    EXPECT_HAS(msg, c.says.front());
    EXPECT_HAS_NOT(msg, "factory of a broken test plugin was called");
  }
}

TEST(Registry, ScanReportsExactlyTheBrokenFiles) {
  ScopedPluginPath env(std::nullopt);
  loom::PluginRegistry reg({kBroken});
  reg.scan();
  std::vector<std::string> good;
  for (const auto& r : reg.records())
    if (r.file.parent_path() == kBroken) good.push_back(r.name);
  EXPECT_EQ(good, std::vector<std::string>{"good"});

  std::vector<std::string> ours;
  for (const auto& p : reg.problems())
    if (p.find(kBroken.string() + "/") != std::string::npos) ours.push_back(p);
  const auto cases = broken_cases();
  ASSERT_EQ(ours.size(), cases.size()) << ::testing::PrintToString(ours);
  for (const auto& c : cases) {
    int hits = 0;
    for (const auto& p : ours)
      if (p.find((kBroken / c.file).string()) != std::string::npos && p.find(c.says.front()) != std::string::npos)
        ++hits;
    EXPECT_EQ(hits, 1) << c.file;
  }
}

TEST(Registry, NotFoundListsWhatWasFoundAndWhereItLooked) {
  ScopedPluginPath env(std::nullopt);
  const fs::path missing = kBroken / "no_such_dir";
  loom::PluginRegistry reg({missing, kBroken});
  std::string msg = error_of([&] { reg.create(loom::PluginKind::data, "goood", init_for()); });
  EXPECT_HAS(msg, "no data plugin named 'goood'");
  EXPECT_HAS(msg, "Did you mean 'good'?");
  EXPECT_HAS(msg, "Found data plugins:");
  // name -> file, for the files of the asked kind only
  EXPECT_MATCHES(msg, "\n  good +" + (kBroken / "libloom-data-good.so").string());
  EXPECT_HAS(msg, (kBroken / "libloom-data-plain.so").string());
  EXPECT_HAS_NOT(msg, "libloom-widget-gadget.so");
  EXPECT_HAS(msg, "Searched, in this order:");
  EXPECT_HAS(msg, "\n  " + missing.string() + "   (does not exist)");
  EXPECT_HAS(msg, "\n  " + kBroken.string() + "\n");
  EXPECT_LT(msg.find(missing.string()), msg.find("\n  " + kBroken.string() + "\n"));
  EXPECT_HAS(msg, "libloom-data-goood.so");
}

TEST(Registry, NotFoundNamesTheKindThatHasTheName) {
  ScopedPluginPath env(std::nullopt);
  loom::PluginRegistry reg({kBroken});
  std::string msg = error_of([&] { reg.create(loom::PluginKind::attention, "good", init_for()); });
  EXPECT_HAS(msg, "no attention plugin named 'good'");
  EXPECT_HAS(msg, "A plugin of that name exists for kind data (" +
                             (kBroken / "libloom-data-good.so").string() + ")");
}

TEST(Registry, KindAskedForMustMatchTheFile) {
  ScopedPluginPath env(std::nullopt);
  loom::PluginRegistry reg;
  const fs::path file = kBroken / "libloom-data-good.so";
  std::string msg = error_of([&] { reg.create(loom::PluginKind::attention, "good", init_for(), file); });
  EXPECT_HAS(msg, file.string() + " is a data plugin, but an attention plugin was asked for");
  msg = error_of([&] { reg.create(loom::PluginKind::data, "other", init_for(), file); });
  EXPECT_HAS(msg, "holds the data plugin 'good', but 'other' was asked for");
  msg = error_of([&] { reg.create(loom::PluginKind::data, "good", init_for(), kBroken / "libloom-data-nope.so"); });
  EXPECT_HAS(msg, "libloom-data-nope.so does not exist");
  msg = error_of([&] { reg.create(loom::PluginKind::data, "../good", init_for()); });
  EXPECT_HAS(msg, "'../good' is not a valid data plugin name");
}

TEST(Registry, PluginConstructorErrorsNameThePlugin) {
  ScopedPluginPath env(std::nullopt);
  loom::PluginRegistry reg({kBroken});
  std::string msg = error_of([&] { reg.create(loom::PluginKind::data, "good", init_for(3, 2)); });
  EXPECT_HAS(msg, "data plugin 'good': rank 3 is outside the world of 2 ranks");
}

TEST(RegistryOrder, ExtraDirsComeBeforeTheEnvironmentThenTheExeDir) {
  const fs::path a = kBroken / "order_a", b = kBroken / "order_b";
  ASSERT_TRUE(fs::exists(a / "libloom-data-echo.so"));
  ASSERT_TRUE(fs::exists(b / "libloom-data-echo.so"));
  const fs::path exe_dir = (fs::canonical("/proc/self/exe").parent_path() / ".." / "lib/loom/plugins").lexically_normal();

  {
    ScopedPluginPath env(b.string());
    loom::PluginRegistry reg({a});
    ASSERT_EQ(reg.search_path(), (std::vector<fs::path>{a, b, exe_dir}));
    reg.scan();
    std::vector<std::string> versions;
    for (const auto& r : reg.records())
      if (r.name == "echo") versions.push_back(r.version);
    EXPECT_EQ(versions, std::vector<std::string>{"1.0.0-a"});
    bool shadow_reported = false;
    for (const auto& p : reg.problems())
      if (p.find((b / "libloom-data-echo.so").string() + " is shadowed by " + (a / "libloom-data-echo.so").string()) !=
          std::string::npos)
        shadow_reported = true;
    EXPECT_TRUE(shadow_reported) << ::testing::PrintToString(reg.problems());
    auto obj = reg.create(loom::PluginKind::data, "echo", init_for());
    EXPECT_EQ(library_of(obj.get()), fs::canonical(a / "libloom-data-echo.so").string());
  }
  {
    // The same two directories the other way round: the config's dir still wins.
    ScopedPluginPath env(a.string());
    loom::PluginRegistry reg({b});
    auto obj = reg.create(loom::PluginKind::data, "echo", init_for());
    EXPECT_EQ(library_of(obj.get()), fs::canonical(b / "libloom-data-echo.so").string());
  }
  {
    // Only the environment: colon-separated, empty entries ignored, order kept.
    ScopedPluginPath env(":" + b.string() + "::" + a.string() + ":");
    loom::PluginRegistry reg;
    ASSERT_EQ(reg.search_path(), (std::vector<fs::path>{b, a, exe_dir}));
    auto obj = reg.create(loom::PluginKind::data, "echo", init_for());
    EXPECT_EQ(library_of(obj.get()), fs::canonical(b / "libloom-data-echo.so").string());
  }
  {
    // A directory named twice is searched once, at its first place.
    ScopedPluginPath env(a.string());
    loom::PluginRegistry reg({a, b});
    EXPECT_EQ(reg.search_path(), (std::vector<fs::path>{a, b, exe_dir}));
  }
  {
    ScopedPluginPath env(std::nullopt);
    loom::PluginRegistry reg;
    EXPECT_EQ(reg.search_path(), std::vector<fs::path>{exe_dir});
    EXPECT_THROW(reg.create(loom::PluginKind::data, "echo", init_for()), loom::Error);
  }
}

TEST(RegistryCli, LoomPluginsListsGoodAndReportsBroken) {
  ScopedPluginPath env(std::nullopt);
  const std::string cmd = std::string("\"") + LOOM_CLI + "\" plugins --path \"" + kBroken.string() + "\" 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  int status = ::pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;

  EXPECT_HAS(out, "KIND");
  EXPECT_MATCHES(out, "\ndata +good +1\\.2\\.3 +test source: [^\n]* +" +
                                            (kBroken / "libloom-data-good.so").string() + "\n");
  EXPECT_HAS(out, "Problems (");
  int problem_lines = 0;
  size_t pos = 0;
  while ((pos = out.find("\n  - ", pos)) != std::string::npos) {
    size_t end = out.find('\n', pos + 1);
    if (out.substr(pos, end - pos).find(kBroken.string() + "/") != std::string::npos) ++problem_lines;
    pos = end;
  }
  EXPECT_EQ(problem_lines, static_cast<int>(broken_cases().size())) << out;
  for (const auto& c : broken_cases()) {
    EXPECT_HAS(out, (kBroken / c.file).string());
    EXPECT_HAS(out, c.says.front());
  }
  EXPECT_HAS(out, "Search path (first match wins):\n  " + kBroken.string() + "\n");

  // A wrong argument is an error with usage, not a silent listing.
  FILE* bad = ::popen((std::string("\"") + LOOM_CLI + "\" plugins --bogus 2>&1").c_str(), "r");
  ASSERT_NE(bad, nullptr);
  std::string bad_out;
  while ((n = std::fread(buf.data(), 1, buf.size(), bad)) > 0) bad_out.append(buf.data(), n);
  status = ::pclose(bad);
  EXPECT_EQ(WEXITSTATUS(status), 1);
  EXPECT_HAS(bad_out, "unknown argument '--bogus'");
}

TEST(ExamplePlugin, ArithRowsAreProgressionsAndResumeAcrossWorldSizes) {
  ScopedPluginPath env(std::nullopt);
  loom::PluginRegistry reg({kBroken / "example"});
  loom::DataSpec spec;
  spec.batch = 2;
  spec.seq_len = 6;
  spec.vocab_size = 50;
  const int64_t len = spec.seq_len + 1;
  auto make = [&](int rank, int world) {
    loom::PluginInit init = init_for(rank, world);
    init.seed = 1234;
    auto src = reg.create_as<loom::PluginKind::data>("arith", init);
    loom::DataSpec s = spec;
    s.rank = rank;
    s.world = world;
    src->open(s);
    return src;
  };

  // One rank, three steps: six rows, each start + t*step (mod vocab), step in 1..7.
  auto one = make(0, 1);
  std::vector<std::vector<int32_t>> rows;
  std::string state_after_one;
  for (int step = 0; step < 3; ++step) {
    std::vector<int32_t> tok(spec.batch * len);
    one->next(loom::Split::train, tok.data());
    if (step == 0) state_after_one = one->state();
    for (int64_t r = 0; r < spec.batch; ++r) rows.emplace_back(tok.begin() + r * len, tok.begin() + (r + 1) * len);
  }
  std::set<int32_t> steps;
  for (const auto& row : rows) {
    const int32_t d = (row[1] - row[0] + 50) % 50;
    EXPECT_GE(d, 1);
    EXPECT_LE(d, 7);
    steps.insert(d);
    for (int64_t t = 1; t < len; ++t) EXPECT_EQ(row[t], (row[t - 1] + d) % 50);
  }
  EXPECT_GT(steps.size(), 1u) << "rows should not all share one step";

  // Resume the one-rank state on two ranks: together they continue with rows 2..5.
  std::vector<std::vector<int32_t>> resumed;
  for (int rank = 0; rank < 2; ++rank) {
    auto src = make(rank, 2);
    src->restore(state_after_one);
    std::vector<int32_t> tok(spec.batch * len);
    src->next(loom::Split::train, tok.data());
    for (int64_t r = 0; r < spec.batch; ++r) resumed.emplace_back(tok.begin() + r * len, tok.begin() + (r + 1) * len);
  }
  EXPECT_EQ(resumed, std::vector<std::vector<int32_t>>(rows.begin() + 2, rows.end()));

  // Validation repeats after reset; a corrupt state is refused with the expected form.
  std::vector<int32_t> v1(spec.batch * len), v2(spec.batch * len);
  one->next(loom::Split::validation, v1.data());
  one->reset(loom::Split::validation);
  one->next(loom::Split::validation, v2.data());
  EXPECT_EQ(v1, v2);
  EXPECT_NE(std::vector<int32_t>(v1.begin(), v1.begin() + len), rows[0]) << "validation rows must differ from training rows";
  EXPECT_HAS(error_of([&] { one->restore("{}"); }), "expected {\"train_rows\":N,\"validation_rows\":M}");
}
