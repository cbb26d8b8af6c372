// What a run writes for people to look at: TensorBoard event files (read back
// with the `tensorboard` package by tests/metrics/read_tensorboard.py),
// `loom plot` of runs' metrics.jsonl, memory in every log line, and a progress
// bar only on a terminal that no launcher owns.
#include <gtest/gtest.h>

#include <poll.h>
#include <pty.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "compare_report.hpp"
#include "run_plot.hpp"
#include "test_util.hpp"
#include "train/progress.hpp"
#include "train/session.hpp"
#include "train/tensorboard.hpp"

namespace fs = std::filesystem;
using loom::test::expect_error;
using loom::test::TmpDir;

namespace {

std::string config(const fs::path& out, const std::string& run_extra = "", const std::string& train_extra = "") {
  std::ostringstream s;
  s << "[run]\nname = \"" << out.filename().string() << "\"\nout_dir = \"" << out.string() << "\"\nseed = 3\nthreads = 2\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n" << run_extra
    << "[model]\nhidden = 32\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 2\nffn_hidden = 64\n"
    << "vocab_size = 64\nmax_seq_len = 16\n"
    << "[train]\nsteps = 8\nmicro_batch = 2\nseq_len = 16\nlr = 1e-2\nvalidation_every = 4\nvalidation_batches = 1\n"
    << train_extra << "[checkpoint]\nresume = \"none\"\n[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return s.str();
}

std::string run_cmd(const std::string& cmd, int* rc = nullptr) {
  const std::string out = "/tmp/loom_run_outputs_" + std::to_string(getpid()) + ".txt";
  const int r = std::system((cmd + " > " + out + " 2>&1").c_str());
  if (rc) *rc = r;
  std::ifstream in(out);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  fs::remove(out);
  return s;
}

// Runs argv on a pseudo-terminal (as a person at a terminal, or mpirun's
// forwarding, sees it) with `env` added; returns everything it printed.
std::string on_pty(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  // The parent keeps its own descriptor of the terminal's slave side open, so
  // the master never reports a hang-up while the child's last lines are still
  // in the kernel's terminal buffers (under load, reading until EIO loses the
  // tail of the output). It reads until the child has exited and the terminal
  // has been quiet for a moment.
  int master = -1, slave = -1;
  if (openpty(&master, &slave, nullptr, nullptr, nullptr) != 0) return "openpty failed";
  const pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    close(master);
    setsid();
    ioctl(slave, TIOCSCTTY, 0);
    for (int fd = 0; fd <= 2; ++fd) dup2(slave, fd);
    if (slave > 2) close(slave);
    setenv("TERM", "xterm", 1);
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("PMI_RANK");
    unsetenv("PMIX_RANK");
    unsetenv("SLURM_PROCID");
    for (auto& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> a;
    for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execv(a[0], a.data());
    _exit(127);
  }
  std::string out;
  char buf[4096];
  bool exited = false;
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (;;) {
    pollfd p{master, POLLIN, 0};
    const int ready = poll(&p, 1, exited ? 300 : 50);
    if (ready > 0 && (p.revents & POLLIN)) {
      const ssize_t n = read(master, buf, sizeof buf);
      if (n > 0) { out.append(buf, static_cast<size_t>(n)); continue; }
    }
    if (exited) break;  // quiet for 300 ms after the child ended: everything is read
    if (waitpid(pid, &status, WNOHANG) == pid) exited = true;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      out += "\n[on_pty: the command did not end within 120 s]";
      break;
    }
  }
  close(slave);
  close(master);
  return out;
}

}  // namespace

TEST(TensorBoard, Crc32cAndMasking) {
  EXPECT_EQ(loom::crc32c("123456789", 9), 0xe3069283u);  // the CRC-32C check value
  EXPECT_EQ(loom::crc32c("", 0), 0u);
}

TEST(TensorBoard, EventFileReadsBackWithTheTensorboardPackage) {
  TmpDir d;
  const fs::path run = d.path / "tb";
  {
    loom::Session s(loom::parse_config_string(config(run, "tensorboard = true\n"), "tb.toml", {}));
    s.train();
  }
  int rc = 0;
  const std::string out =
      run_cmd(loom::cat("python3 ", LOOM_SOURCE_DIR, "/tests/metrics/read_tensorboard.py ", run.string()), &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("tensorboard OK"), std::string::npos) << out;
  EXPECT_NE(out.find("val/loss"), std::string::npos) << out;
  EXPECT_NE(out.find("perf/memory_gib"), std::string::npos) << out;

  // The reader is not a rubber stamp: a flipped byte in a payload is caught.
  fs::path file;
  for (auto& e : fs::directory_iterator(run / "tensorboard")) file = e.path();
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(fs::file_size(file) - 10));
  f.put('\x7f');
  f.close();
  const std::string bad =
      run_cmd(loom::cat("python3 ", LOOM_SOURCE_DIR, "/tests/metrics/read_tensorboard.py ", run.string()), &rc);
  EXPECT_NE(rc, 0) << bad;
  EXPECT_NE(bad.find("bad payload CRC"), std::string::npos) << bad;
}

TEST(TensorBoard, AResumeFromAnOlderCheckpointShowsOneCurve) {
  // Steps 1..8 with checkpoints at 4 and 8, then the run resumed from 4:
  // metrics.jsonl holds steps 5..8 twice; TensorBoard must show each once
  // (the second event file's START marker drops the first one's 5..8), and
  // the resumed run in the same process and second must not overwrite the
  // first event file.
  TmpDir d;
  const fs::path run = d.path / "tbr";
  for (const char* resume : {"none", "4"}) {
    // As if the first run had died before its step-8 checkpoint.
    fs::remove_all(run / "checkpoints" / "step_00000008");
    loom::Session s(loom::parse_config_string(config(run, "tensorboard = true\n"), "tb.toml",
                                              {"checkpoint.every=4", std::string("checkpoint.resume=") + resume}));
    s.train();
  }
  int files = 0;
  for (auto& e : fs::directory_iterator(run / "tensorboard")) files += e.path().filename().string().rfind("events.", 0) == 0;
  EXPECT_EQ(files, 2);
  int rc = 0;
  const std::string out =
      run_cmd(loom::cat("python3 ", LOOM_SOURCE_DIR, "/tests/metrics/read_tensorboard.py ", run.string(), " 2"), &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("tensorboard OK"), std::string::npos) << out;
  // loom plot reads the same file as one curve: steps 1..8, the later lines winning.
  const auto curves = loom::report::read_run_curves(run.string());
  EXPECT_EQ(curves.step, (std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(curves.val_step, (std::vector<double>{0, 4, 8}));
}

TEST(TensorBoard, NonFiniteScalarsReadBack) {
  TmpDir d;
  {
    loom::TensorBoardWriter w((d.path / "tb").string());
    w.scalars(1, {{"x", std::nan("")}, {"y", 1.0}});
    w.scalars(2, {{"x", INFINITY}, {"y", -INFINITY}});
    w.scalars(3, {{"x", 1e39}, {"y", -0.0}});  // beyond float: +inf
  }
  const std::string script = loom::cat(
      "import math\nfrom tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n",
      "a = EventAccumulator('", (d.path / "tb").string(), "', size_guidance={'scalars': 0}); a.Reload()\n",
      "x = [e.value for e in a.Scalars('x')]; y = [e.value for e in a.Scalars('y')]\n",
      "assert math.isnan(x[0]) and x[1] == math.inf and x[2] == math.inf, x\n",
      "assert y == [1.0, -math.inf, 0.0], y\n", "print('nonfinite OK')\n");
  std::ofstream(d.path / "check.py") << script;
  int rc = 0;
  const std::string out = run_cmd(loom::cat("python3 ", (d.path / "check.py").string()), &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("nonfinite OK"), std::string::npos) << out;
}

TEST(TensorBoard, TwoWritersInOneSecondKeepBothFiles) {
  TmpDir d;
  loom::TensorBoardWriter a((d.path / "tb").string());
  loom::TensorBoardWriter b((d.path / "tb").string());
  EXPECT_NE(a.path(), b.path());
  EXPECT_LT(a.path(), b.path());  // read in the order written
  a.scalars(1, {{"x", 1.0}});
  EXPECT_GT(fs::file_size(a.path()), 0u);
  EXPECT_GT(fs::file_size(b.path()), 0u);
}

// Runs of every shape `loom plot` meets: a single step, validation only,
// skipped steps with a null loss, steps logged again after a resume, runs of
// different lengths in one chart; each PNG decoded by tests/metrics/check_png.py.
TEST(Plot, EveryShapeOfRunGivesAValidPng) {
  TmpDir d;
  auto run = [&](const std::string& name, const std::string& lines) {
    fs::create_directories(d.path / name);
    std::ofstream(d.path / name / "metrics.jsonl") << lines;
    return (d.path / name).string();
  };
  auto line = [](int step, const std::string& loss) {
    return loom::cat("{\"step\": ", step, ", \"loss\": ", loss, ", \"lr\": 0.001, \"tokens_per_s\": 1000}\n");
  };
  const std::string one = run("one", line(1, "4.0"));
  const std::string val = run("valonly", "{\"step\": 0, \"val_loss\": 5.0}\n{\"step\": 4, \"val_loss\": 4.0}\n");
  const std::string skipped = run("skipped", line(1, "4.0") + line(2, "null").insert(1, "\"skipped\": true, ") + line(3, "3.0"));
  const std::string resumed = run("resumed", line(1, "4.0") + line(2, "3.0") + line(3, "2.0") + line(2, "3.5") +
                                                 line(3, "2.5") + line(4, "2.2"));
  std::string long_lines;
  for (int i = 1; i <= 500; ++i) long_lines += line(i, loom::cat(5.0 / i));
  const std::string longer = run("long", long_lines);
  const auto r = loom::report::read_run_curves(resumed);
  EXPECT_EQ(r.step, (std::vector<double>{1, 2, 3, 4}));
  EXPECT_EQ(r.loss, (std::vector<double>{4.0, 3.5, 2.5, 2.2}));
  const auto s = loom::report::read_run_curves(skipped);
  ASSERT_EQ(s.loss.size(), 3u);
  EXPECT_TRUE(std::isnan(s.loss[1]));
  for (const std::string& dirs : {one, val, skipped, resumed, loom::cat(one, " ", val, " ", skipped, " ", resumed, " ", longer)}) {
    SCOPED_TRACE(dirs);
    const std::string png = (d.path / "p.png").string();
    fs::remove(png);
    int rc = 0;
    std::string out = run_cmd(loom::cat(LOOM_CLI, " plot ", dirs, " --out ", png), &rc);
    ASSERT_EQ(rc, 0) << out;
    out = run_cmd(loom::cat("python3 ", LOOM_SOURCE_DIR, "/tests/metrics/check_png.py ", png, " 1200 820"), &rc);
    EXPECT_EQ(rc, 0) << out;
    EXPECT_NE(out.find("png OK"), std::string::npos) << out;
  }
  // Where the PNG cannot go, one message names it.
  int rc = 0;
  std::string out = run_cmd(loom::cat(LOOM_CLI, " plot ", one, " --out ", d.path.string()), &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("is a directory; give a file name"), std::string::npos) << out;
  out = run_cmd(loom::cat(LOOM_CLI, " plot ", one, " --out ", (d.path / "no" / "such" / "p.png").string()), &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("cannot write"), std::string::npos) << out;
  EXPECT_EQ(out.find("internal error"), std::string::npos) << out;
  // An empty metrics.jsonl is named.
  run("empty", "");
  out = run_cmd(loom::cat(LOOM_CLI, " plot ", (d.path / "empty").string(), " --out ", (d.path / "e.png").string()), &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("holds no steps yet"), std::string::npos) << out;
}

TEST(Plot, DrawsEveryRunInEveryPanel) {
  TmpDir d;
  for (const char* name : {"runA", "runB"}) {
    loom::Session s(loom::parse_config_string(config(d.path / name), "p.toml",
                                              {"train.lr=" + std::string(name[3] == 'A' ? "1e-2" : "3e-3")}));
    s.train();
  }
  const std::vector<loom::report::RunCurves> runs = {loom::report::read_run_curves((d.path / "runA").string()),
                                                     loom::report::read_run_curves((d.path / "runB").string())};
  EXPECT_EQ(runs[0].name, "runA");
  EXPECT_EQ(runs[0].step.size(), 8u);
  EXPECT_EQ(runs[0].val_step, (std::vector<double>{0, 4, 8}));
  const auto plot = loom::report::render_run_plot(runs);
  // Each run's colour appears inside each of the four panels: at least 20
  // pixels of it (the curves are antialiased; 2 pixels wide where whole).
  for (int p = 0; p < 4; ++p)
    for (size_t r = 0; r < runs.size(); ++r) {
      const auto& rect = plot.panels[p];
      int found = 0;
      for (int y = rect.y; y < rect.y + rect.h; ++y)
        for (int x = rect.x; x < rect.x + rect.w; ++x) found += plot.drawing.at(x, y) == loom::report::row_color(r);
      EXPECT_GE(found, 20) << "run " << r << " not drawn in panel " << p;
    }

  // The command writes a PNG of the chart's size.
  const std::string png = (d.path / "plot.png").string();
  int rc = 0;
  const std::string out = run_cmd(loom::cat(LOOM_CLI, " plot ", (d.path / "runA").string(), " ",
                                            (d.path / "runB").string(), " --out ", png), &rc);
  ASSERT_EQ(rc, 0) << out;
  std::ifstream in(png, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 33u);
  EXPECT_EQ(bytes.substr(0, 8), "\x89PNG\r\n\x1a\n");
  auto be32 = [&](size_t at) {
    return (static_cast<uint32_t>(static_cast<unsigned char>(bytes[at])) << 24) |
           (static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + 1])) << 16) |
           (static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + 2])) << 8) | static_cast<unsigned char>(bytes[at + 3]);
  };
  EXPECT_EQ(be32(16), static_cast<uint32_t>(plot.drawing.width()));
  EXPECT_EQ(be32(20), static_cast<uint32_t>(plot.drawing.height()));

  // Bad inputs are named.
  expect_error([&] { loom::report::read_run_curves((d.path / "nope").string()); }, {"nope", "has no metrics.jsonl"});
  fs::create_directories(d.path / "bad");
  std::ofstream(d.path / "bad" / "metrics.jsonl") << "{\"step\": 1, \"loss\": 2}\nnot json\n";
  expect_error([&] { loom::report::read_run_curves((d.path / "bad").string()); }, {"metrics.jsonl:2", "not a JSON object"});
  const std::string none = run_cmd(loom::cat(LOOM_CLI, " plot"), &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(none.find("needs at least one RUN_DIR"), std::string::npos) << none;
}

// cairo is loaded to draw a chart, not linked: loom has no start-up need of
// it (GPU nodes often lack it), and where it is missing `loom plot` says what
// to install. The missing library is played by an empty file mounted over
// cairo's in a mount namespace of its own, where one can be made (root).
TEST(Plot, LoomStartsWithoutCairoAndPlotSaysWhatToInstall) {
  int rc = 0;
  const std::string needed = run_cmd(loom::cat("readelf -d ", LOOM_CLI), &rc);
  ASSERT_EQ(rc, 0) << needed;
  EXPECT_NE(needed.find("libloom.so"), std::string::npos) << needed;  // the listing is what it should be
  EXPECT_EQ(needed.find("libcairo"), std::string::npos) << needed;
  loom::report::require_cairo();  // here it loads: find which file it is
  std::string cairo;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line) && cairo.empty();)
    if (const auto at = line.find('/'); at != std::string::npos && line.find("libcairo.so.2", at) != std::string::npos)
      cairo = line.substr(at);
  ASSERT_FALSE(cairo.empty()) << "libcairo.so.2 is not mapped after require_cairo()";
  TmpDir d;
  fs::create_directories(d.path / "run");
  std::ofstream(d.path / "run" / "metrics.jsonl") << "{\"step\": 1, \"loss\": 4.0}\n";
  std::ofstream(d.path / "empty");
  if (run_cmd("unshare --mount true", &rc), rc != 0) GTEST_SKIP() << "no mount namespace here (not root?)";
  const std::string out = run_cmd(loom::cat("unshare --mount sh -c 'mount --bind ", (d.path / "empty").string(), " ", cairo,
                                            " && ", LOOM_CLI, " version && ", LOOM_CLI, " plot ", (d.path / "run").string(),
                                            " --out ", (d.path / "p.png").string(), "'"), &rc);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("loom 0."), std::string::npos) << "loom did not start:\n" << out;
  EXPECT_NE(out.find("drawing a chart needs cairo (libcairo.so.2)"), std::string::npos) << out;
  EXPECT_NE(out.find("apt install libcairo2"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(d.path / "p.png"));
}

// `loom bench` on the CPU: its report describes the timed steps, and only
// them (the warm-up and the step queued after the last timed one, whose start
// closes that one's period, are not in it).
TEST(Bench, ReportsTheTimedSteps) {
  TmpDir d;
  const fs::path cfg = d.path / "c.toml", json = d.path / "bench.json";
  std::ofstream(cfg) << config(d.path / "run");
  int rc = 0;
  const std::string out =
      run_cmd(loom::cat(LOOM_CLI, " bench ", cfg.string(), " --steps=5 --warmup=2 --json=", json.string()), &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto j = nlohmann::json::parse(std::ifstream(json));
  EXPECT_EQ(j.at("steps").get<int>(), 5);
  EXPECT_EQ(j.at("warmup_steps").get<int>(), 2);
  const double med = j.at("median_step_ms"), lo = j.at("min_step_ms"), hi = j.at("max_step_ms");
  EXPECT_GT(lo, 0.0);
  EXPECT_LE(lo, med);
  EXPECT_LE(med, hi);
  // tokens/s is the batch's tokens (2 x 16) over the median step.
  EXPECT_NEAR(j.at("tokens_per_s").get<double>(), 32.0 / (med * 1e-3), 1e-6 * 32.0 / (med * 1e-3));
  EXPECT_TRUE(std::isfinite(j.at("final_loss").get<double>()));
  EXPECT_NE(out.find("BENCH_JSON"), std::string::npos) << out;

  // One warm-up step, and more timed steps than the default step-log ring
  // (16 rows) holds: still exactly the timed steps.
  const std::string many =
      run_cmd(loom::cat(LOOM_CLI, " bench ", cfg.string(), " --steps=20 --warmup=1 --json=", json.string()), &rc);
  ASSERT_EQ(rc, 0) << many;
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(json)).at("steps").get<int>(), 20);

  // Nothing but positive step counts.
  const std::string bad = run_cmd(loom::cat(LOOM_CLI, " bench ", cfg.string(), " --steps=0"), &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(bad.find("--steps"), std::string::npos) << bad;
}

// The files `loom bench --json` and `loom compare --out` write come at the
// end of their work: a place that cannot hold them is refused before any
// step runs, naming the flag, the path and why (not "cannot write" after the
// whole measurement, nor a bare "Not a directory") — walked as run.out_dir
// is: a link to nowhere, /proc, /sys and /dev refused alike. A missing
// folder is made.
TEST(Bench, OutputPathsAreCheckedBeforeAnyStep) {
  TmpDir d;
  const fs::path cfg = d.path / "c.toml";
  std::ofstream(cfg) << config(d.path / "run");
  std::ofstream(d.path / "afile") << "x";
  fs::create_symlink(d.path / "nowhere" / "target", d.path / "dangling");
  const std::string base = loom::cat(LOOM_CLI, " bench ", cfg.string(), " --steps 2 --warmup 1 ");
  const std::string cmp = loom::cat(LOOM_CLI, " compare ", cfg.string(), " --strategies=none --steps 2 --warmup 0 ");
  struct Case { std::string cmd, says; };
  const std::string afile = (d.path / "afile").string(), dangling = (d.path / "dangling").string();
  for (const Case& c : std::vector<Case>{
           {base + "--json=", "--json= is empty: give it a file name"},
           {base + "--json=" + afile + "/x.json", "--json=" + afile + "/x.json: '" + afile + "' is a file, where a folder is needed"},
           {base + "--json " + d.path.string(), "--json=" + d.path.string() + ": '" + d.path.string() + "' is a folder"},
           {base + "--json=" + dangling + "/x.json", "'" + dangling + "' is a link to '" + (d.path / "nowhere" / "target").string() +
                                                         "', which does not exist"},
           {base + "--json=/proc/self/x.json", "--json=/proc/self/x.json: '/proc/self' (that is, '/proc/"},
           {base + "--json=/sys/x.json", "--json=/sys/x.json: '/sys' is under /sys"},
           {base + "--json=/dev/loom_bench_test/x.json", "--json=/dev/loom_bench_test/x.json: '/dev' is under /dev"},
           {cmp + "--out=" + afile, "--out=" + afile + ": '" + afile + "' is a file, where a folder is needed"},
           {cmp + "--out " + afile + "/sub", "--out=" + afile + "/sub: '" + afile + "' is a file, where a folder is needed"},
           {cmp + "--out=/proc/self/cmp", "--out=/proc/self/cmp: '/proc/self' (that is, '/proc/"},
           {cmp + "--out=" + dangling, "--out=" + dangling + ": '" + dangling + "' is a link to '" +
                                           (d.path / "nowhere" / "target").string() + "', which does not exist"},
           {cmp + "--out=", "--out= is empty"}}) {
    SCOPED_TRACE(c.cmd);
    int rc = 0;
    const std::string out = run_cmd(c.cmd, &rc);
    EXPECT_NE(rc, 0) << out;
    EXPECT_NE(out.find(c.says), std::string::npos) << out;
    EXPECT_EQ(out.find("BENCH_JSON"), std::string::npos) << "the steps ran before the refusal:\n" << out;
    EXPECT_EQ(out.find("compare: none ("), std::string::npos) << "a run ran before the refusal:\n" << out;
  }
  std::error_code ec;
  EXPECT_FALSE(fs::exists("/dev/loom_bench_test", ec));
  fs::remove_all("/dev/loom_bench_test", ec);
  // A folder that does not exist yet is made, in either form of the flag.
  int rc = 0;
  const fs::path json = d.path / "new" / "sub" / "b.json";
  const std::string out = run_cmd(base + "--json " + json.string(), &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(json)).at("steps").get<int>(), 2);
}

TEST(Progress, MemoryInEveryLogLine) {
  loom::StepLog s;
  s.step = 3;
  s.loss = 2.5;
  s.peak_mem_bytes = size_t{3} << 29;  // 1.5 GiB
  EXPECT_NE(loom::log_line(s, 10).find("| mem 1.50 GiB"), std::string::npos) << loom::log_line(s, 10);
  EXPECT_GT(loom::peak_resident_bytes(), size_t{1} << 20);
}

// Every log step gets its console line, also the one queued just before a
// step whose read is forced (validation every 4, a checkpoint every 3, the
// last step): those reads return two steps at once.
TEST(Progress, EveryLogStepIsPrintedAlsoBeforeAForcedRead) {
  TmpDir d;
  for (const int log_every : {1, 2}) {
    SCOPED_TRACE(log_every);
    const std::string cfg = (d.path / "c.toml").string();
    std::ofstream(cfg) << config(d.path / "run", "overwrite = true\n", loom::cat("log_every = ", log_every, "\n"));
    int rc = 0;
    const std::string out = run_cmd(loom::cat(LOOM_CLI, " train ", cfg, " --set checkpoint.every=3"), &rc);
    ASSERT_EQ(rc, 0) << out;
    for (int step = 1; step <= 8; ++step) {
      const std::string line = loom::cat("step ", step, "/8 |");
      const bool want = step % log_every == 0 || step == 8 || step % 4 == 0;
      size_t n = 0;
      for (size_t at = out.find(line); at != std::string::npos; at = out.find(line, at + 1)) ++n;
      EXPECT_EQ(n, want ? 1u : 0u) << line << "\n" << out;
    }
  }
}

TEST(Progress, BarOnlyOnATerminalNoLauncherOwns) {
  TmpDir d;
  const std::string cfg = (d.path / "c.toml").string();
  // Three runs into one folder: each replaces the last on purpose.
  std::ofstream(cfg) << config(d.path / "run", "overwrite = true\n", "log_every = 4\n");
  const std::vector<std::string> argv = {LOOM_CLI, "train", cfg};
  const std::string alone = on_pty(argv, {});
  EXPECT_NE(alone.find("\033[2K"), std::string::npos) << "a person at a terminal sees the bar:\n" << alone;
  EXPECT_NE(alone.find("] 8/8"), std::string::npos) << alone;
  const std::string mpi = on_pty(argv, {"OMPI_COMM_WORLD_SIZE=1", "OMPI_COMM_WORLD_RANK=0",
                                        "OMPI_COMM_WORLD_LOCAL_RANK=0", "OMPI_COMM_WORLD_LOCAL_SIZE=1"});
  EXPECT_EQ(mpi.find("\033["), std::string::npos) << "under mpirun no escape code reaches the log:\n" << mpi;
  EXPECT_NE(mpi.find("step 8/8"), std::string::npos) << mpi;
  EXPECT_NE(mpi.find("mem "), std::string::npos) << mpi;
  // Not a terminal (a file, a pipe): no bar either.
  int rc = 0;
  const std::string piped = run_cmd(loom::cat(LOOM_CLI, " train ", cfg), &rc);
  EXPECT_EQ(rc, 0) << piped;
  EXPECT_EQ(piped.find("\033["), std::string::npos) << piped;
}
