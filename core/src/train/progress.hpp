// What a run shows and writes about itself: one log line per logged step, a
// progress bar on a terminal, and metrics.jsonl (one JSON object per step).
#pragma once
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace loom {

struct StepLog {
  int64_t step = 0;  // 1-based: the number of optimizer steps done after this one
  double loss = 0, lr = 0, grad_norm = 0, step_ms = 0, tokens_per_s = 0, samples_per_s = 0;
  bool skipped = false;
  double mfu = 0;              // GPU only: model flops utilisation against kMfuPeakFlops (loom/precision.hpp)
  size_t peak_mem_bytes = 0;   // memory in use: the device's (cudaMemGetInfo) on GPU, the process's peak resident set on CPU
  bool has_val = false;
  double val_loss = 0;
  // Mixture of experts: the load-balancing loss (unweighted; the objective is
  // loss + router_aux_loss_coef x aux_loss), mean over micro-batches and ranks.
  bool has_aux = false;
  double aux_loss = 0;
  // Per-recipe scalars (an FP8 scale, a MoE aux loss): metrics.jsonl and TensorBoard (extra/<name>).
  std::vector<std::pair<std::string, double>> extras;
};

// Peak resident set of this process in bytes (getrusage), for the CPU's "mem" column.
size_t peak_resident_bytes();

// "1h02m", "3m05s", "42s".
std::string duration(double seconds);

// "step 12/100 | loss 3.2101 | lr 3.00e-04 | grad norm 0.812 | ... ms | MFU 41.2% | mem 12.31 GiB"
std::string log_line(const StepLog& s, int64_t total_steps);

// metrics.jsonl: appended to on resume, truncated otherwise. Rank 0 only.
class MetricsFile {
 public:
  void open(const std::string& path, bool append);
  void write(const StepLog& s);
  void write_validation(int64_t step, double val_loss);  // the evaluation before step 1
  bool is_open() const { return f_.is_open(); }

 private:
  void check(const char* what);  // throws naming the file when the last write failed
  std::ofstream f_;
  std::string path_;
};

// A one-line progress bar on stdout when a person watches it: stdout and stderr
// are terminals and no launcher started the process (mpirun gives ranks a
// pseudo-terminal, whose escape codes would end up in the job's log). Log
// lines (stderr) clear it first so the two never interleave on one line.
class ProgressBar {
 public:
  explicit ProgressBar(int64_t total);
  // Whether a bar would be drawn: both streams are terminals, TERM is not
  // "dumb", and no launcher variable (OMPI_COMM_WORLD_SIZE, PMI_RANK, PMIX_RANK, SLURM_PROCID) is set.
  static bool interactive();
  void clear();
  void draw(int64_t step, double loss, double eta_s);
  void finish();

 private:
  int64_t total_;
  bool tty_;
};

}  // namespace loom
