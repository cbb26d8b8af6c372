#include "run_plot.hpp"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "compare_report.hpp"
#include "loom/error.hpp"
#include "util/files.hpp"

namespace loom::report {
namespace {

constexpr int kWidth = 1200, kHeight = 820;
constexpr double kCaption = 17, kLegend = 15, kSmallest = 9;

using Series = std::pair<const std::vector<double>*, const std::vector<double>*>;  // x, y

// One panel: its title, the frame over all runs' finite points, each run's
// curve (a NaN, such as a skipped step's loss, leaves a gap), with a dot at
// every point when `dots` (sparse validation losses) or where a point has no
// finite neighbour.
void panel(Drawing& d, const Rect& p, const std::string& title, const std::vector<Series>& series, bool dots) {
  d.text(p.x, p.y - 22, title, kInk, kCaption, Align::kLeft, true);
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  for (auto [xs, ys] : series)
    for (size_t i = 0; i < xs->size() && i < ys->size(); ++i)
      if (std::isfinite((*xs)[i]) && std::isfinite((*ys)[i])) {
        xlo = std::min(xlo, (*xs)[i]), xhi = std::max(xhi, (*xs)[i]);
        ylo = std::min(ylo, (*ys)[i]), yhi = std::max(yhi, (*ys)[i]);
      }
  if (!(xlo <= xhi)) {
    d.outline({p.x - 1, p.y - 1, p.w + 2, p.h + 2}, kMuted);
    d.text(p.cx(), p.cy(), "no data", kMuted, kCaption, Align::kCenter);
    return;
  }
  const Frame f{p, nice_axis(xlo, xhi, 5, 1), nice_axis(ylo, yhi)};
  draw_frame(d, f, "step");
  for (size_t r = 0; r < series.size(); ++r) {
    const auto& xs = *series[r].first;
    const auto& ys = *series[r].second;
    const Rgb col = row_color(r);
    std::vector<Point> run;
    auto flush = [&] {
      if (run.size() == 1 && !dots) d.dot(run[0], 3, col);
      d.polyline(run, col, 2);
      run.clear();
    };
    for (size_t i = 0; i < xs.size() && i < ys.size(); ++i) {
      if (!std::isfinite(xs[i]) || !std::isfinite(ys[i])) {
        flush();
        continue;
      }
      run.push_back({f.px(xs[i]), f.py(ys[i])});
      if (dots) d.dot(run.back(), 3.5, col);
    }
    flush();
  }
}

// The legend across the top: each run's colour and name, in rows of the
// page's width; what does not fit in three rows is counted ("+4 more").
void legend(Drawing& d, const std::vector<RunCurves>& runs) {
  constexpr int kLeft = 20, kRight = kWidth - 20, kRowHeight = 24, kRows = 3, kSwatch = 24;
  constexpr double kMaxName = 360;
  double x = kLeft;
  int row = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    const auto name = d.fit(runs[r].name, kMaxName, kLegend, kSmallest);
    const double w = kSwatch + 6 + d.text_width(name.text, name.size) + 28;
    if (x > kLeft && x + w > kRight && row + 1 < kRows) x = kLeft, ++row;
    const int mid = 22 + row * kRowHeight;
    // On the last row each entry leaves room for the count of those after it.
    const double reserve = r + 1 < runs.size() ? d.text_width(cat("+", runs.size() - r - 1, " more"), kLegend) : 0;
    if (row == kRows - 1 && x + w + reserve > kRight) {
      d.text(x, mid, cat("+", runs.size() - r, " more"), kMuted, kLegend);
      return;
    }
    d.fill({static_cast<int>(x), mid - 3, kSwatch, 6}, row_color(r));
    d.text(x + kSwatch + 6, mid, name.text, kInk, name.size);
    x += w;
  }
}

}  // namespace

RunCurves read_run_curves(const std::string& run_dir) {
  const std::filesystem::path file = std::filesystem::path(run_dir) / "metrics.jsonl";
  std::error_code ec;
  if (!std::filesystem::exists(file, ec))
    throw Error(cat("'", run_dir, "' has no metrics.jsonl; give run directories (run.out_dir) that loom train wrote"));
  // A FIFO there would block the read for ever, a device never end it.
  require_regular_file(file.string(), "metrics file");
  std::ifstream in(file);
  if (!in) throw Error(cat("cannot read ", file.string(), ": ", std::strerror(errno)));
  RunCurves r;
  r.name = std::filesystem::path(run_dir).lexically_normal().filename().string();
  if (r.name.empty() || r.name == ".") r.name = std::filesystem::path(run_dir).lexically_normal().parent_path().filename().string();
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw Error(cat(file.string(), ":", n, ": not a JSON object (", e.what(), "); metrics.jsonl holds one per line"));
    }
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number())
      throw Error(cat(file.string(), ":", n, ": a line without a \"step\"; is this a loom metrics.jsonl?"));
    const double step = j["step"].get<double>();
    auto num = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : std::nan(""); };
    // A resumed run appends to metrics.jsonl from its checkpoint's step, so
    // the steps logged after that checkpoint by the run it replaces come
    // again: the later lines win (as TensorBoard drops the abandoned points),
    // and a curve never runs back in steps.
    auto supersede = [&](std::vector<double>& steps, std::vector<std::vector<double>*> ys) {
      std::size_t keep = steps.size();
      while (keep > 0 && steps[keep - 1] >= step) --keep;
      steps.resize(keep);
      for (auto* y : ys) y->resize(keep);
    };
    if (j.contains("loss")) {
      supersede(r.step, {&r.loss, &r.lr, &r.tokens_per_s});
      r.step.push_back(step);
      r.loss.push_back(num("loss"));
      r.lr.push_back(num("lr"));
      r.tokens_per_s.push_back(num("tokens_per_s"));
    }
    if (j.contains("val_loss")) {
      supersede(r.val_step, {&r.val_loss});
      r.val_step.push_back(step);
      r.val_loss.push_back(num("val_loss"));
    }
  }
  if (r.step.empty() && r.val_step.empty())
    throw Error(cat(file.string(), " holds no steps yet; plot a run that has logged at least one step"));
  return r;
}

RunPlot render_run_plot(const std::vector<RunCurves>& runs) {
  if (runs.empty()) throw Error("loom plot needs at least one run directory");
  RunPlot out{Drawing(kWidth, kHeight, kBackground), {}};
  Drawing& d = out.drawing;
  legend(d, runs);
  out.panels[0] = {90, 120, 460, 250};
  out.panels[1] = {690, 120, 460, 250};
  out.panels[2] = {90, 510, 460, 250};
  out.panels[3] = {690, 510, 460, 250};
  std::vector<Series> loss, val, lr, tps;
  for (const auto& r : runs) {
    loss.push_back({&r.step, &r.loss});
    val.push_back({&r.val_step, &r.val_loss});
    lr.push_back({&r.step, &r.lr});
    tps.push_back({&r.step, &r.tokens_per_s});
  }
  panel(d, out.panels[0], "training loss", loss, false);
  panel(d, out.panels[1], "validation loss", val, true);
  panel(d, out.panels[2], "learning rate", lr, false);
  panel(d, out.panels[3], "tokens/s", tps, false);
  return out;
}

void write_run_plot(const std::string& path, const std::vector<RunCurves>& runs) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(cat("--out '", path, "' is a directory; give a file name, e.g. --out ",
                    (std::filesystem::path(path) / "plot.png").string()));
  render_run_plot(runs).drawing.write_png(path);
}

}  // namespace loom::report
