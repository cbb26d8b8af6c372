#include "run_plot.hpp"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "compare_report.hpp"
#include "loom/error.hpp"
#include "util/files.hpp"
#include "png_writer.hpp"

namespace loom::report {
namespace {

constexpr int kWidth = 1200, kHeight = 820;
constexpr Rgb kInk{40, 40, 40}, kGrid{228, 228, 228}, kMuted{130, 130, 130};

struct Range1 {
  double lo = std::numeric_limits<double>::infinity(), hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  bool empty() const { return !(hi >= lo); }
};

// Ticks at 1, 2 or 5 times a power of ten, about five of them.
std::vector<double> ticks(double& lo, double& hi) {
  if (!(hi - lo > 1e-12 * std::max(std::fabs(lo), std::fabs(hi)))) {
    const double pad = lo != 0 ? std::fabs(lo) * 0.05 : 0.5;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag, step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
  lo = std::floor(lo / step) * step;
  hi = std::ceil(hi / step) * step;
  std::vector<double> t;
  for (int k = 0; k < 40 && lo + k * step <= hi + step * 1e-6; ++k) t.push_back(lo + k * step);
  return t;
}

std::string label(double v) {
  char b[32];
  const double a = std::fabs(v);
  if (a != 0 && (a < 1e-2 || a >= 1e5)) std::snprintf(b, sizeof b, "%.1e", v);
  else if (a >= 100) std::snprintf(b, sizeof b, "%.0f", v);
  else std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

using Series = std::pair<const std::vector<double>*, const std::vector<double>*>;  // x, y

void panel(Canvas& c, const Rect& p, const std::string& title, const std::vector<Series>& series, bool dots) {
  c.text(p.x, p.y - 26, title, kInk, 2);
  Range1 xr, yr;
  for (auto [xs, ys] : series)
    for (size_t i = 0; i < xs->size() && i < ys->size(); ++i)
      if (std::isfinite((*ys)[i])) xr.add((*xs)[i]), yr.add((*ys)[i]);
  c.outline({p.x - 1, p.y - 1, p.w + 2, p.h + 2}, kMuted);
  if (xr.empty() || yr.empty()) {
    c.text(p.cx() - Canvas::text_width("no data", 2) / 2, p.cy(), "no data", kMuted, 2);
    return;
  }
  double xlo = xr.lo, xhi = xr.hi, ylo = yr.lo, yhi = yr.hi;
  const auto xt = ticks(xlo, xhi), yt = ticks(ylo, yhi);
  auto px = [&](double x) { return p.x + static_cast<int>(std::lround((x - xlo) / (xhi - xlo) * (p.w - 1))); };
  auto py = [&](double y) { return p.y + p.h - 1 - static_cast<int>(std::lround((y - ylo) / (yhi - ylo) * (p.h - 1))); };
  for (double t : yt) {
    c.fill({p.x, py(t), p.w, 1}, kGrid);
    const std::string s = label(t);
    c.text(p.x - 6 - Canvas::text_width(s, 1), py(t) - 3, s, kInk, 1);
  }
  for (double t : xt) {
    c.fill({px(t), p.y, 1, p.h}, kGrid);
    const std::string s = label(t);
    c.text(px(t) - Canvas::text_width(s, 1) / 2, p.y + p.h + 6, s, kInk, 1);
  }
  for (size_t r = 0; r < series.size(); ++r) {
    const auto& xs = *series[r].first;
    const auto& ys = *series[r].second;
    const Rgb col = row_color(r);
    for (size_t i = 0; i < xs.size() && i < ys.size(); ++i) {
      if (!std::isfinite(ys[i])) continue;
      if (dots || xs.size() == 1) c.fill({px(xs[i]) - 3, py(ys[i]) - 3, 7, 7}, col);
      if (i > 0 && std::isfinite(ys[i - 1])) c.line(px(xs[i - 1]), py(ys[i - 1]), px(xs[i]), py(ys[i]), col, 2);
    }
  }
  c.text(p.x + p.w - Canvas::text_width("step", 1), p.y + p.h + 18, "step", kMuted, 1);
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
  RunPlot out{Canvas(kWidth, kHeight, kBackground), {}};
  Canvas& c = out.canvas;
  // The legend across the top: each run's colour and name.
  int x = 20;
  for (size_t r = 0; r < runs.size(); ++r) {
    c.fill({x, 20, 24, 6}, row_color(r));
    c.text(x + 30, 16, runs[r].name, kInk, 2);
    x += 30 + Canvas::text_width(runs[r].name, 2) + 30;
  }
  out.panels[0] = {90, 110, 460, 260};
  out.panels[1] = {690, 110, 460, 260};
  out.panels[2] = {90, 500, 460, 260};
  out.panels[3] = {690, 500, 460, 260};
  std::vector<Series> loss, val, lr, tps;
  for (const auto& r : runs) {
    loss.push_back({&r.step, &r.loss});
    val.push_back({&r.val_step, &r.val_loss});
    lr.push_back({&r.step, &r.lr});
    tps.push_back({&r.step, &r.tokens_per_s});
  }
  panel(c, out.panels[0], "training loss", loss, false);
  panel(c, out.panels[1], "validation loss", val, true);
  panel(c, out.panels[2], "learning rate", lr, false);
  panel(c, out.panels[3], "tokens/s", tps, false);
  return out;
}

void write_run_plot(const std::string& path, const std::vector<RunCurves>& runs) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(cat("--out '", path, "' is a directory; give a file name, e.g. --out ",
                    (std::filesystem::path(path) / "plot.png").string()));
  const RunPlot p = render_run_plot(runs);
  const std::vector<uint8_t> png = png::encode_rgb(p.canvas.width(), p.canvas.height(), p.canvas.rgb());
  std::ofstream o(path, std::ios::binary);
  o.write(reinterpret_cast<const char*>(png.data()), static_cast<std::streamsize>(png.size()));
  o.close();
  if (!o) throw Error(cat("cannot write '", path, "'; check that its directory exists and is writable"));
}

}  // namespace loom::report
