// The comparison chart: loss curves on the left, bar charts of throughput and
// peak memory on the right, drawn with cairo (drawing.hpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "compare_report.hpp"
#include "loom/error.hpp"

namespace loom::report {
namespace {

constexpr int kWidth = 1200, kHeight = 800;
// Plot areas: the loss panel takes the left 60%, the two bar charts share the rest.
constexpr Rect kLossPlot{90, 100, 620, 610};
constexpr Rect kThroughputPlot{780, 110, 390, 250};
constexpr Rect kMemoryPlot{780, 480, 390, 250};
// Font sizes in pixels: the title, panel captions, legend and bar labels, and
// the smallest any label shrinks to before it is cut.
constexpr double kTitle = 22, kCaption = 17, kLabel = 14, kSmallest = 9;

// Distinct, saturated colours that stay apart from the greys of axes and grid.
constexpr Rgb kPalette[] = {{31, 102, 196}, {226, 94, 24},  {42, 158, 64},  {205, 35, 60},
                            {128, 77, 190}, {20, 160, 170}, {214, 71, 170}, {150, 110, 40}};

// The step axis: integer ticks from step 1 to the longest run. One step gets
// a range around it so its point is drawn mid-plot.
Axis step_axis(size_t max_steps) {
  if (max_steps <= 1) return {0.5, 1.5, 1, {1.0}, 0};
  const double hi = static_cast<double>(max_steps);
  Axis a = nice_axis(1, hi, 6, 1);
  a.lo = 1;
  a.hi = hi;  // the curves fill the width; ticks outside it are dropped
  a.ticks.clear();
  for (double t = std::ceil(1 / a.step) * a.step; t <= hi && a.ticks.size() < 50; t += a.step) a.ticks.push_back(t);
  if (a.ticks.empty() || a.ticks.front() > 1) a.ticks.insert(a.ticks.begin(), 1.0);
  a.decimals = 0;
  return a;
}

// Consecutive finite points are joined; a NaN or inf loss leaves a gap, and a
// finite point without a finite neighbour is drawn as a dot so it is not lost.
void draw_curve(Drawing& d, const Frame& f, const std::vector<double>& losses, Rgb color) {
  std::vector<Point> run;
  auto flush = [&] {
    if (run.size() == 1) d.dot(run[0], 3.5, color);
    d.polyline(run, color, 2);
    run.clear();
  };
  for (size_t i = 0; i < losses.size(); ++i) {
    if (std::isfinite(losses[i]))
      run.push_back({f.px(static_cast<double>(i + 1)), f.py(losses[i])});
    else
      flush();
  }
  flush();
}

// Top-right inside the plot, over the curves on a filled box so it stays
// readable; as many entries as fit, then a count of the rest.
void draw_legend(Drawing& d, const Rect& p, const std::vector<CompareRow>& rows) {
  if (rows.empty()) return;
  constexpr int kRow = 20, kPad = 6, kSwatch = 22;
  const size_t fits = static_cast<size_t>((p.h - 2 * kPad - 16) / kRow);
  const size_t shown = rows.size() <= fits ? rows.size() : fits - 1;
  std::vector<Drawing::Fitted> texts;
  double widest = 0;
  for (size_t i = 0; i < shown; ++i) {
    const std::string s = rows[i].label + (rows[i].failed() ? " (failed)" : "");
    texts.push_back(d.fit(s, p.w / 2 - kSwatch - 3 * kPad, kLabel, kSmallest));
    widest = std::max(widest, d.text_width(texts.back().text, texts.back().size));
  }
  if (shown < rows.size()) {
    texts.push_back({cat("+", rows.size() - shown, " more"), kLabel});
    widest = std::max(widest, d.text_width(texts.back().text, kLabel));
  }
  const int w = static_cast<int>(std::ceil(widest)) + kSwatch + 3 * kPad;
  const Rect box{p.x + p.w - w - 8, p.y + 8, w, static_cast<int>(texts.size()) * kRow + kPad};
  d.fill(box, kBackground);
  d.outline(box, kMuted);
  for (size_t i = 0; i < texts.size(); ++i) {
    const int mid = box.y + kPad + static_cast<int>(i) * kRow + kRow / 2 - 1;
    const bool real_row = i < shown;
    if (real_row) d.fill({box.x + kPad, mid - 1, kSwatch, 3}, row_color(i));
    const Rgb ink = real_row && !rows[i].failed() ? kInk : kMuted;
    d.text(box.x + 2 * kPad + kSwatch, mid, texts[i].text, ink, texts[i].size);
  }
}

void draw_loss_panel(Drawing& d, const std::vector<CompareRow>& rows) {
  const Rect& p = kLossPlot;
  d.text(p.x, p.y - 24, "loss", kInk, kCaption, Align::kLeft, true);
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  size_t max_steps = 0;
  for (const auto& r : rows) {
    max_steps = std::max(max_steps, r.losses.size());
    for (double l : r.losses)
      if (std::isfinite(l)) lo = std::min(lo, l), hi = std::max(hi, l);
  }
  const bool any = lo <= hi;
  const Frame f{p, step_axis(max_steps), any ? nice_axis(lo, hi, 6) : nice_axis(0, 1, 6)};
  draw_frame(d, f, "step");
  if (!any) d.text(p.cx(), p.cy(), "no loss data", kMuted, kCaption, Align::kCenter);
  for (size_t i = 0; i < rows.size(); ++i) draw_curve(d, f, rows[i].losses, row_color(i));
  draw_legend(d, p, rows);
}

struct Bar {
  double value = 0;
  std::string text;  // printed above the bar
};

// One bar per row scaled to the largest value (headroom left for the value
// text), the value above each bar, the row label under the baseline.
std::vector<Rect> draw_bars(Drawing& d, const Rect& p, const std::string& caption, const std::vector<CompareRow>& rows,
                            const std::vector<Bar>& bars) {
  d.text(p.x, p.y - 40, caption, kInk, kCaption, Align::kLeft, true);
  const int baseline = p.y + p.h;
  d.fill({p.x, baseline, p.w, 2}, kInk);
  if (bars.empty()) return {};
  double vmax = 0;
  for (const auto& b : bars)
    if (std::isfinite(b.value)) vmax = std::max(vmax, b.value);
  const int n = static_cast<int>(bars.size());
  const int slot = p.w / n, bar_w = std::max(2, slot * 3 / 5);
  const int room = p.h - 24;  // the value's text stays inside the plot above the tallest bar
  std::vector<Rect> rects;
  for (int i = 0; i < n; ++i) {
    const double v = std::isfinite(bars[i].value) && bars[i].value > 0 ? bars[i].value : 0;
    const int h = vmax > 0 ? static_cast<int>(std::lround(v / vmax * room)) : 0;
    const Rect bar{p.x + i * slot + (slot - bar_w) / 2, baseline - h, bar_w, h};
    d.fill(bar, row_color(i));
    rects.push_back(bar);
    const auto value = d.fit(bars[i].text, slot - 4, kLabel, kSmallest);
    d.text(bar.cx(), bar.y - 12, value.text, rows[i].failed() ? kMuted : kInk, value.size, Align::kCenter);
    const auto label = d.fit(rows[i].label, slot - 4, kLabel, kSmallest);
    d.text(bar.cx(), baseline + 14, label.text, kInk, label.size, Align::kCenter);
  }
  return rects;
}

// The bars of one chart; failed runs show 0 and "failed", whatever was measured.
std::vector<Bar> bars_of(const std::vector<CompareRow>& rows, double (*value)(const CompareRow&),
                         std::string (*text)(double)) {
  std::vector<Bar> bars;
  for (const auto& r : rows) bars.push_back(r.failed() ? Bar{0, "failed"} : Bar{value(r), text(value(r))});
  return bars;
}

double throughput(const CompareRow& r) { return r.tokens_per_s_per_gpu; }
double peak_gib(const CompareRow& r) { return r.peak_mem_bytes / (1024.0 * 1024.0 * 1024.0); }
std::string gib_text(double gib) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", gib);
  return buf;
}

}  // namespace

Rgb row_color(size_t index) { return kPalette[index % std::size(kPalette)]; }

Chart render_chart(const std::vector<CompareRow>& rows, const std::string& title) {
  Chart chart{Drawing(kWidth, kHeight, kBackground), kLossPlot, {}, {}};
  Drawing& d = chart.drawing;
  const auto t = d.fit(title, kWidth - 40, kTitle, 12, true);
  d.text(kWidth / 2.0, 30, t.text, kInk, t.size, Align::kCenter, true);
  draw_loss_panel(d, rows);
  chart.throughput_bars =
      draw_bars(d, kThroughputPlot, "tokens/s per GPU", rows, bars_of(rows, throughput, format_count));
  chart.memory_bars =
      draw_bars(d, kMemoryPlot, "peak memory per GPU (GiB)", rows, bars_of(rows, peak_gib, gib_text));
  return chart;
}

}  // namespace loom::report
