// `loom plugins` next to broken libraries (docs/RELIABILITY.md "Plugins"): a
// scan loads each candidate file in a child process, so a library whose own
// load-time code crashes, hangs or exits is reported as that file's problem,
// and the listing (the good plugins, the other problems) goes on.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <csignal>

#include "loom/error.hpp"
#include "config/run_config.hpp"
#include "loom/registry.hpp"
#include "reliability_util.hpp"
#include "train/session.hpp"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

const fs::path kMisbehave = fs::path(LOOM_TEST_BROKEN_PLUGIN_DIR) / "misbehave";

// LOOM_PLUGIN_PATH unset (and restored) so that only the given directories count.
struct NoPluginPathEnv {
  std::string saved;
  bool had = false;
  NoPluginPathEnv() {
    if (const char* v = std::getenv("LOOM_PLUGIN_PATH")) {
      had = true;
      saved = v;
    }
    ::unsetenv("LOOM_PLUGIN_PATH");
    ::setenv("LOOM_PLUGIN_PROBE_TIMEOUT", "2", 1);
  }
  ~NoPluginPathEnv() {
    if (had) ::setenv("LOOM_PLUGIN_PATH", saved.c_str(), 1);
    ::unsetenv("LOOM_PLUGIN_PROBE_TIMEOUT");
  }
};

}  // namespace

// In-process: scan() survives every misbehaving file and reports each.
TEST(ReliabilityPlugins, ScanReportsCrashHangAndExitAsTheFilesProblems) {
  NoPluginPathEnv env;
  loom::PluginRegistry reg({kMisbehave});
  reg.scan();  // this process is still here: nothing was loaded into it
  // (The search path also holds the build's own plugins: look at this directory's.)
  std::vector<loom::PluginRecord> here;
  for (const auto& r : reg.records())
    if (r.file.parent_path() == kMisbehave) here.push_back(r);
  ASSERT_EQ(here.size(), 1u);
  EXPECT_EQ(here[0].name, "fine");
  EXPECT_EQ(here[0].version, "2.0.0");
  std::string all;
  int problems_here = 0;
  for (const auto& p : reg.problems()) {
    all += p + "\n";
    if (has(p, kMisbehave.string() + "/")) ++problems_here;
  }
  EXPECT_EQ(problems_here, 3) << all;
  EXPECT_CONTAINS(all, (kMisbehave / "libloom-data-crash.so").string() + ": loading it crashed the process (signal " +
                           std::to_string(SIGSEGV));
  EXPECT_CONTAINS(all, (kMisbehave / "libloom-data-hang.so").string() + ": loading it did not finish within 2 s");
  EXPECT_CONTAINS(all, (kMisbehave / "libloom-data-quit.so").string() + ": loading it ended the process (exit status 7)");
}

// The command: exit 0, the good plugins listed (the build's own and 'fine'),
// every misbehaving file under Problems.
TEST(ReliabilityPlugins, LoomPluginsListsEverythingDespiteACrashingLibrary) {
  NoPluginPathEnv env;
  const ProcResult r = run_shell(std::string("'") + LOOM_CLI + "' plugins --path '" + kMisbehave.string() +
                                 "' --path '" + LOOM_TEST_PLUGIN_DIR + "'");
  EXPECT_EQ(r.signal, 0) << r.out;
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "Problems (3 files not loaded)");
  EXPECT_CONTAINS(r.out, "libloom-data-crash.so: loading it crashed the process");
  EXPECT_CONTAINS(r.out, "libloom-data-hang.so: loading it did not finish");
  EXPECT_CONTAINS(r.out, "libloom-data-quit.so: loading it ended the process");
  for (const char* good : {"fine", "synthetic", "tokens", "naive", "fp32", "zero3"}) EXPECT_CONTAINS(r.out, good);
}

// A plugin file that is a FIFO (named like a plugin) is refused without blocking.
TEST(ReliabilityPlugins, ExplicitPluginFileMustBeARegularFile) {
  const fs::path dir = fresh_dir("plugins_fifo");
  const fs::path fifo = dir / "libloom-data-pipe.so";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  loom::PluginInit init;
  loom::PluginRegistry reg;
  try {
    reg.create(loom::PluginKind::data, "pipe", init, fifo);
    ADD_FAILURE() << "a FIFO was accepted as a plugin file";
  } catch (const loom::Error& e) {
    EXPECT_CONTAINS(std::string(e.what()), "is a FIFO (named pipe), not a regular file");
  }
}

// A plugin file that is no shared library (text, empty, a truncated
// download) is said to be that, not given the loader's message with an errno
// left over from another call ("file too short): Bad file descriptor"); the
// scan lists it with the same reason.
TEST(ReliabilityPlugins, FileThatIsNoSharedLibraryIsSaidToBeOne) {
  const fs::path dir = fresh_dir("plugins_not_elf");
  std::ofstream(dir / "libloom-attention-text.so") << "not a library\n";
  std::ofstream(dir / "libloom-attention-empty.so") << "";
  for (const char* name : {"text", "empty"}) {
    SCOPED_TRACE(name);
    loom::PluginRegistry reg;
    const fs::path file = dir / (std::string("libloom-attention-") + name + ".so");
    try {
      reg.create(loom::PluginKind::attention, name, loom::PluginInit{}, file);
      ADD_FAILURE() << "accepted";
    } catch (const loom::Error& e) {
      const std::string msg = e.what();
      EXPECT_CONTAINS(msg, "plugin file " + file.string() + " is not a shared library (it does not start with an ELF header");
      EXPECT_FALSE(has(msg, "Bad file descriptor")) << msg;
    }
  }
  const ProcResult r = run_shell(std::string("timeout 60 '") + LOOM_CLI + "' plugins --path '" + dir.string() + "'");
  EXPECT_CONTAINS(r.out, "is not a shared library");
  EXPECT_FALSE(has(r.out, "Bad file descriptor")) << r.out;
}

// $LOOM_PLUGIN_PROBE_TIMEOUT that is no number of seconds is said once, with
// the default that is used instead (it was ignored without a word).
TEST(ReliabilityPlugins, ProbeTimeoutThatIsNoNumberIsSaidOnce) {
  const fs::path dir = fresh_dir("plugins_probe_timeout");
  for (const char* bad : {"abc", "5s", "0", "-3"}) {
    SCOPED_TRACE(bad);
    const ProcResult r = run_shell(std::string("LOOM_PLUGIN_PROBE_TIMEOUT='") + bad + "' timeout 60 '" + LOOM_CLI +
                                   "' plugins --path '" + LOOM_TEST_PLUGIN_DIR + "'");
    EXPECT_EQ(r.code, 0) << r.out;
    const std::string says = std::string("$LOOM_PLUGIN_PROBE_TIMEOUT = '") + bad + "' is not a number of seconds > 0";
    EXPECT_CONTAINS(r.out, says);
    EXPECT_EQ(r.out.find(says), r.out.rfind(says)) << "said more than once:\n" << r.out;
  }
  const ProcResult ok = run_shell(std::string("LOOM_PLUGIN_PROBE_TIMEOUT=30 timeout 60 '") + LOOM_CLI +
                                  "' plugins --path '" + LOOM_TEST_PLUGIN_DIR + "'");
  EXPECT_FALSE(has(ok.out, "LOOM_PLUGIN_PROBE_TIMEOUT")) << ok.out;
}

// A search folder that is a file, a FIFO or a device is listed as "not a
// folder", not as missing (and is not opened: a FIFO would block).
TEST(ReliabilityPlugins, SearchPathThatIsNotAFolderIsNamedSo) {
  NoPluginPathEnv env;
  const fs::path dir = fs::path(LOOM_BINARY_DIR) / "test_tmp" / "reliability" / "plugins_path_kinds";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "afile") << "x";
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0644), 0);
  const ProcResult r = run_shell(std::string("timeout 60 '") + LOOM_CLI + "' plugins --path /dev/null --path '" +
                                 (dir / "afile").string() + "' --path '" + (dir / "fifo").string() + "' --path '" +
                                 (dir / "missing").string() + "'");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const std::string p : {std::string("/dev/null"), (dir / "afile").string(), (dir / "fifo").string()})
    EXPECT_CONTAINS(r.out, "  " + p + "   (not a folder)");
  EXPECT_CONTAINS(r.out, "  " + (dir / "missing").string() + "   (does not exist)");
}

// `loom train` and `loom check` refuse a run.plugin_path entry that is not a
// folder — missing, empty, a regular file, a device, a FIFO — naming the key,
// the entry and what it is, before any work (not even run.out_dir is made);
// Session refuses it too. A $LOOM_PLUGIN_PATH entry that is missing (the
// environment's, often shared by several machines) is a warning, and the run goes on.
TEST(ReliabilityPlugins, PluginPathEntryThatIsNoFolderIsRefusedBeforeAnyWork) {
  NoPluginPathEnv env;
  const fs::path dir = fresh_dir("plugins_path_config");
  std::ofstream(dir / "afile") << "x";
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0644), 0);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {(dir / "missing").string(), "does not exist"},
      {"", "is empty"},
      {(dir / "afile").string(), "is a regular file, not a folder"},
      {"/dev/null", "is a character device, not a folder"},
      {(dir / "fifo").string(), "is a FIFO (named pipe), not a folder"},
  };
  std::ofstream(dir / "set.toml") << tiny_config(dir / "run", 2);
  for (const auto& [entry, says] : cases) {
    SCOPED_TRACE(entry);
    const fs::path out = dir / "run";
    std::string text = tiny_config(out, 2);
    const std::string good = std::string("plugin_path = [\"") + LOOM_TEST_PLUGIN_DIR + "\"]";
    ASSERT_NE(text.find(good), std::string::npos);
    text.replace(text.find(good), good.size(),
                 std::string("plugin_path = [\"") + LOOM_TEST_PLUGIN_DIR + "\", \"" + entry + "\"]");
    const fs::path cfg = dir / "run.toml";
    std::ofstream(cfg) << text;
    for (const char* cmd : {"train", "check"}) {
      const ProcResult r = run_shell(std::string("timeout 60 '") + LOOM_CLI + "' " + cmd + " '" + cfg.string() + "'");
      EXPECT_EQ(r.code, 1) << r.out;
      // Located at the value (tiny_config's plugin_path is line 7).
      EXPECT_CONTAINS(r.out, cfg.string() + ":7:15: run.plugin_path[1] = \"" + entry + "\" " + says);
      EXPECT_FALSE(has(r.out, "internal error")) << r.out;
      EXPECT_FALSE(fs::exists(out)) << "work was done before the refusal";
    }
    try {
      loom::Session s(loom::parse_config_string(text, "run.toml", {}));
      ADD_FAILURE() << "Session accepted run.plugin_path entry '" << entry << "'";
    } catch (const loom::Error& e) {
      EXPECT_CONTAINS(std::string(e.what()), "run.toml:7:15: run.plugin_path[1] = \"" + entry + "\" " + says);
    }
    // From the command line, the message names the --set, not the file.
    const std::string set = std::string("run.plugin_path=[\"") + LOOM_TEST_PLUGIN_DIR + "\", \"" + entry + "\"]";
    const ProcResult r = run_shell(std::string("timeout 60 '") + LOOM_CLI + "' check '" + (dir / "set.toml").string() +
                                   "' --set '" + set + "'");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, "--set " + set + ": run.plugin_path[1] = \"" + entry + "\" " + says);
  }
  const fs::path cfg = dir / "good.toml";
  std::ofstream(cfg) << tiny_config(dir / "good", 2);
  const ProcResult r = run_shell("LOOM_PLUGIN_PATH='" + (dir / "missing").string() + "::" + (dir / "afile").string() +
                                 "' timeout 60 '" + LOOM_CLI + "' train '" + cfg.string() + "'");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "$LOOM_PLUGIN_PATH entry '" + (dir / "missing").string() + "' does not exist");
  EXPECT_CONTAINS(r.out, "$LOOM_PLUGIN_PATH entry '" + (dir / "afile").string() + "' is a regular file, not a folder");
}
