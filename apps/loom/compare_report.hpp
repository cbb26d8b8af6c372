// The output side of `loom compare`: one CompareRow per run (a sharding
// strategy or a config, trained for the same steps from the same seed),
// reported as an aligned text table, CSV files and a PNG chart. Pure
// reporting: nothing here runs training, so it is tested on made-up rows.
#pragma once
#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "drawing.hpp"

namespace loom::report {

// The order of CompareRow::bytes_per_step, and the names the table and CSV use.
// all_to_all is the token exchange of expert parallelism (MoE blocks).
enum Collective : int { kAllReduce = 0, kReduceScatter = 1, kAllGather = 2, kBroadcast = 3, kAllToAll = 4 };
inline constexpr std::array<const char*, 5> kCollectiveNames = {"all_reduce", "reduce_scatter", "all_gather",
                                                                 "broadcast", "all_to_all"};

struct CompareRow {
  std::string label;                       // "zero3" or a config name
  int ranks = 1;
  double step_ms = 0;                      // median step time
  double tokens_per_s_per_gpu = 0;
  // Model TFLOP/s per GPU as NeMo counts them (causal attention: 6N + 6LhS
  // per token) and MFU (docs/ARCHITECTURE.md "MFU": 6N + 12LhS over 989 TFLOP/s), both from
  // tokens_per_s_per_gpu and the compared model (peers run the same shape).
  double model_tflops = 0;
  double mfu = 0;
  double peak_mem_bytes = 0;               // per GPU (or per rank on CPU: arena bytes)
  double planned_mem_bytes = 0;            // the memory plan per rank
  std::array<double, kCollectiveNames.size()> bytes_per_step{};  // per rank and step, indexed by Collective
  std::vector<double> losses;              // per step, index 0 = step 1
  std::vector<std::pair<long long, double>> val_losses;  // (step, validation loss) when the run evaluated
  double max_rel_val_diff = 0;             // filled by compute_diffs: max |val - rows[0].val| / |rows[0].val|
  double final_loss = 0;
  double max_loss_diff = 0;                // filled by compute_diffs
  double max_rel_loss_diff = 0;            // filled by compute_diffs
  std::string note;                        // e.g. "peer", or the error text of a failed run

  // A run without a single loss failed before finishing its first step: the
  // chart draws no curve for it and its bars as "failed".
  bool failed() const { return losses.empty(); }
};

// Fills max_loss_diff (max |loss - rows[0].loss|) and max_rel_loss_diff (the
// same divided by |rows[0].loss|) over the steps both runs have. A step where
// exactly one of the two losses is NaN/inf counts as an infinite difference;
// one where both are is skipped. With no step to compare (a failed run) both
// are NaN, which the table prints as "-". rows[0] gets 0 against itself.
// Validation losses are compared the same way at the steps both runs evaluated
// (max_rel_val_diff; NaN when there is none in common).
void compute_diffs(std::vector<CompareRow>& rows);

// An aligned text table, one line per row under a header line and a rule,
// with human units (ms, K tok/s, GiB/MiB for memory, MB/GB for traffic),
// then a line saying what the byte and loss-difference columns are relative to.
std::string format_table(const std::vector<CompareRow>& rows);

// Writes `path` (the summary: a header and one line per row, raw numbers
// without units) and losses_csv_path(path) (a `step` column, then one column
// per row label; empty where a run has no loss for that step), and, when any
// run evaluated, val_losses_csv_path(path) in the same shape. Numbers are
// written so that they read back exactly; NaN and infinities as nan, inf, -inf.
// Throws loom::Error naming the file that could not be written.
void write_csv(const std::string& path, const std::vector<CompareRow>& rows);
// "out/cmp.csv" -> "out/cmp_losses.csv": the stem of `path` plus "_losses.csv".
std::string losses_csv_path(const std::string& path);
// "out/cmp.csv" -> "out/cmp_val_losses.csv".
std::string val_losses_csv_path(const std::string& path);

// The rows of a --peer file: the PEER_JSON lines of benchmarks/torch_fsdp.py,
// hf_llama.py or hf_mixtral.py (the "PEER_JSON " prefix is optional; other
// lines are passed over). Each row must be a JSON object with either "error"
// (a peer that failed: a failed row) or a positive "median_step_ms" and a
// "tokens_per_s_per_gpu" or "tokens_per_s"; "mode", "world", "final_loss",
// "losses" and "peak_reserved_bytes" are read when present and must have
// their types. Throws loom::Error naming the file, the line and what is
// missing or wrong, and for a file that holds no row at all.
std::vector<CompareRow> read_peer_rows(const std::string& path);

// A 1200x800 RGB PNG: loss curves on the left, bar charts of tokens/s per GPU
// and peak memory per GPU on the right. Throws loom::Error naming the path
// when the file cannot be written (the directory is not created).
void write_png(const std::string& path, const std::vector<CompareRow>& rows, const std::string& title);

// Numbers as the table and chart print them, with three significant digits.
std::string format_count(double v);             // 850 -> "850", 12345 -> "12.3K", 1.5e6 -> "1.50M"
std::string format_bytes_binary(double bytes);  // 512 MiB -> "512 MiB", 2.5 GiB -> "2.50 GiB"
std::string format_bytes_decimal(double bytes); // 2.5e8 -> "250 MB", 1.5e9 -> "1.50 GB"

// The chart write_png encodes, with where its parts were drawn; for tests and
// for callers that want the pixels rather than a file.
Rgb row_color(size_t index);  // the colour of row `index`'s curve and bars
struct Chart {
  Drawing drawing;
  Rect loss_plot;                    // the plot area of the loss curves
  std::vector<Rect> throughput_bars; // one per row, in row order; h == 0 for a failed or zero value
  std::vector<Rect> memory_bars;
};
Chart render_chart(const std::vector<CompareRow>& rows, const std::string& title);

}  // namespace loom::report
