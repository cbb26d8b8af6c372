// `loom plot`: the curves of one or several runs from their metrics.jsonl —
// training loss, validation loss, learning rate and throughput against the
// step — drawn with cairo (drawing.hpp) in the comparison chart's palette.
#pragma once
#include <string>
#include <vector>

#include "drawing.hpp"

namespace loom::report {

struct RunCurves {
  std::string name;  // the run directory's name
  std::vector<double> step, loss, lr, tokens_per_s;  // one entry per logged step
  std::vector<double> val_step, val_loss;
};

// Reads RUN_DIR/metrics.jsonl. Throws loom::Error naming the file (and line)
// when it is missing, empty or not JSON lines.
RunCurves read_run_curves(const std::string& run_dir);

struct RunPlot {
  Drawing drawing;
  Rect panels[4];  // loss, validation loss, learning rate, tokens/s
};
RunPlot render_run_plot(const std::vector<RunCurves>& runs);
// Renders and writes the PNG; throws loom::Error naming `path` when it cannot be written.
void write_run_plot(const std::string& path, const std::vector<RunCurves>& runs);

}  // namespace loom::report
