#include "train/progress.hpp"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/error.hpp"
#include "util/files.hpp"
#include "util/terminal.hpp"

namespace loom {

std::string duration(double s) {
  std::ostringstream os;
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) os << t / 3600 << "h" << std::setw(2) << std::setfill('0') << (t / 60) % 60 << "m";
  else if (t >= 60) os << t / 60 << "m" << std::setw(2) << std::setfill('0') << t % 60 << "s";
  else os << t << "s";
  return os.str();
}

std::string log_line(const StepLog& s, int64_t total_steps) {
  std::ostringstream line;
  line << "step " << s.step << "/" << total_steps << " | loss " << std::fixed << std::setprecision(4) << s.loss;
  if (s.has_aux) line << " | aux loss " << std::setprecision(4) << s.aux_loss;
  line << " | lr " << std::scientific << std::setprecision(2) << s.lr << " | grad norm " << std::fixed
       << std::setprecision(3) << s.grad_norm << " | " << std::setprecision(1) << s.samples_per_s << " samples/s | "
       << std::setprecision(0) << s.tokens_per_s << " tok/s | " << std::setprecision(1) << s.step_ms << " ms";
  if (s.mfu > 0) line << " | MFU " << std::setprecision(1) << 100.0 * s.mfu << "%";
  if (s.peak_mem_bytes > 0)
    line << " | mem " << std::setprecision(2) << static_cast<double>(s.peak_mem_bytes) / (1024.0 * 1024.0 * 1024.0)
         << " GiB";
  if (s.has_val) line << " | val loss " << std::setprecision(4) << s.val_loss;
  if (s.skipped) line << " | skipped (non-finite gradient norm)";
  return line.str();
}

void MetricsFile::open(const std::string& path, bool append) {
  path_ = path;
  // Appending to a FIFO would block the run until a reader comes; a device
  // would swallow the metrics. (A symbolic link to a regular file is fine.)
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw Error(cat("cannot write ", path, ": it is ", file_type_name(st.st_mode),
                    ", not a regular file; move it away, or choose another run.out_dir"));
  f_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!f_) throw Error(cat("cannot write ", path, ": ", std::strerror(errno), "; check run.out_dir"));
}

// Every line is flushed and checked: a full disk stops the run with the file
// named, instead of a run that "succeeds" with empty metrics.
void MetricsFile::check(const char* what) {
  if (f_) return;
  const int e = errno;
  throw Error(cat("writing ", what, " to ", path_, " failed: ", e ? std::strerror(e) : "I/O error",
                  e == ENOSPC || e == EDQUOT ? " (the disk or quota is full: free space, or choose another run.out_dir)"
                                             : "; check run.out_dir"));
}

void MetricsFile::write(const StepLog& s) {
  if (!f_.is_open()) return;
  nlohmann::json j = {{"step", s.step},       {"loss", s.loss},       {"lr", s.lr},
                      {"grad_norm", s.grad_norm}, {"step_ms", s.step_ms}, {"tokens_per_s", s.tokens_per_s},
                      {"samples_per_s", s.samples_per_s}};
  if (s.has_aux) j["aux_loss"] = s.aux_loss;
  if (s.has_val) j["val_loss"] = s.val_loss;
  if (s.skipped) j["skipped"] = true;
  if (s.mfu > 0) j["mfu"] = s.mfu;
  if (s.peak_mem_bytes > 0) j["peak_mem_bytes"] = s.peak_mem_bytes;
  for (const auto& [name, v] : s.extras) j[name] = v;
  errno = 0;
  f_ << j.dump() << "\n";
  f_.flush();
  check("a metrics line");
}

void MetricsFile::write_validation(int64_t step, double val_loss) {
  if (!f_.is_open()) return;
  errno = 0;
  f_ << nlohmann::json{{"step", step}, {"val_loss", val_loss}}.dump() << "\n";
  f_.flush();
  check("a metrics line");
}

size_t peak_resident_bytes() {
  struct rusage u {};
  if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return static_cast<size_t>(u.ru_maxrss) * 1024;  // kilobytes on Linux
}

bool ProgressBar::interactive() { return interactive_terminal(STDOUT_FILENO) && interactive_terminal(STDERR_FILENO); }

ProgressBar::ProgressBar(int64_t total) : total_(total), tty_(total > 0 && interactive()) {}

void ProgressBar::clear() {
  if (tty_) { std::fputs("\r\033[2K", stdout); std::fflush(stdout); }
}

void ProgressBar::draw(int64_t step, double loss, double eta_s) {
  if (!tty_) return;
  const int width = 30;
  const int filled = static_cast<int>(width * static_cast<double>(step) / static_cast<double>(total_));
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(width, '.');
  std::printf("\r[%s] %lld/%lld  loss %.4f  eta %s", bar.c_str(), static_cast<long long>(step),
              static_cast<long long>(total_), loss, duration(eta_s).c_str());
  std::fflush(stdout);
}

void ProgressBar::finish() {
  if (tty_) { std::fputs("\n", stdout); std::fflush(stdout); }
}

}  // namespace loom
