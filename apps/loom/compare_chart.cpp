// The comparison chart: loss curves on the left, bar charts of throughput and
// peak memory on the right, drawn on a Canvas that write_png encodes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "compare_report.hpp"
#include "loom/error.hpp"

namespace loom::report {
namespace {

constexpr int kWidth = 1200, kHeight = 800;
constexpr Rgb kInk{40, 40, 40}, kMuted{130, 130, 130}, kGrid{228, 228, 228};
// Plot areas: the loss panel takes the left 60%, the two bar charts share the rest.
constexpr Rect kLossPlot{90, 100, 620, 610};
constexpr Rect kThroughputPlot{780, 110, 390, 250};
constexpr Rect kMemoryPlot{780, 480, 390, 250};
constexpr int kLineHeight2 = 14;  // text at scale 2

// Distinct, saturated colours that stay apart from the greys of axes and grid.
constexpr Rgb kPalette[] = {{31, 102, 196}, {226, 94, 24},  {42, 158, 64},  {205, 35, 60},
                            {128, 77, 190}, {20, 160, 170}, {214, 71, 170}, {150, 110, 40}};

// Text and the scale it fits at: scale `max_scale` down to 1, then cut with "..".
struct Fitted {
  std::string text;
  int scale = 1;
  int width() const { return Canvas::text_width(text, scale); }
};

Fitted fit(const std::string& s, int max_width, int max_scale = 2) {
  for (int scale = max_scale; scale >= 1; --scale)
    if (Canvas::text_width(s, scale) <= max_width) return {s, scale};
  std::string cut = s;
  while (!cut.empty() && Canvas::text_width(cut + "..", 1) > max_width) cut.pop_back();
  return {cut.empty() ? "" : cut + "..", 1};
}

void centered(Canvas& c, int cx, int top, const Fitted& f, Rgb color) {
  c.text(cx - f.width() / 2, top, f.text, color, f.scale);
}

// An axis range snapped to whole tick steps, with the ticks and the decimals their labels need.
struct Axis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
  int decimals = 0;
};

// 1, 2 or 5 times a power of ten, at least `raw`: ticks people can read.
double nice_step(double raw) {
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

Axis snapped_axis(double lo, double hi, double step) {
  Axis a;
  a.lo = std::floor(lo / step) * step;
  a.hi = std::ceil(hi / step) * step;
  // A bounded loop: rounding must never turn into an endless or huge tick list.
  for (int k = 0; k < 50; ++k) {
    const double t = a.lo + k * step;
    if (t > a.hi + step * 1e-6) break;
    a.ticks.push_back(std::fabs(t) < step * 1e-6 ? 0.0 : t);  // no "-0.00"
  }
  a.decimals = std::clamp(-static_cast<int>(std::floor(std::log10(step) + 1e-9)), 0, 9);
  return a;
}

// The loss axis. A flat range (all losses equal, or a single point) is widened
// first so the curve sits mid-plot instead of dividing by a zero span.
Axis loss_axis(double lo, double hi) {
  lo = std::max(lo, -1e300);  // keeps hi - lo finite for absurd but finite losses
  hi = std::min(hi, 1e300);
  if (!(hi - lo > 1e-9 * std::max(std::fabs(lo), std::fabs(hi)))) {
    const double pad = lo != 0 ? std::fabs(lo) * 0.05 : 0.5;
    lo -= pad;
    hi += pad;
  }
  return snapped_axis(lo, hi, nice_step((hi - lo) / 6));
}

// The step axis: integer ticks from step 1 to the longest run. One step gets
// a range around it so its point is drawn mid-plot.
Axis step_axis(size_t max_steps) {
  if (max_steps <= 1) return {0.5, 1.5, {1.0}, 0};
  const double hi = static_cast<double>(max_steps);
  const double step = std::max(1.0, nice_step((hi - 1) / 6));
  Axis a = snapped_axis(1, hi, step);
  a.lo = 1;
  a.hi = hi;  // the curves fill the width; ticks outside it are dropped
  std::erase_if(a.ticks, [&](double t) { return t < 1 || t > hi; });
  a.decimals = 0;
  return a;
}

// v on an axis [lo, hi] to a pixel between p0 (at lo) and p1 (at hi); clamped
// so that no value can overflow the int conversion.
int to_px(double v, const Axis& a, int p0, int p1) {
  double p = p0 + (v - a.lo) / (a.hi - a.lo) * (p1 - p0);
  if (!std::isfinite(p)) p = p0;
  return static_cast<int>(std::lround(std::clamp(p, -1e6, 1e6)));
}

int x_px(double step, const Axis& x, const Rect& p) { return to_px(step, x, p.x, p.x + p.w - 1); }
int y_px(double loss, const Axis& y, const Rect& p) { return to_px(loss, y, p.y + p.h - 1, p.y); }

std::string tick_label(double t, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, t);
  return buf;
}

// Grid lines, axis lines and tick labels of the loss plot.
void draw_axes(Canvas& c, const Rect& p, const Axis& x, const Axis& y) {
  // y labels right-aligned in the left margin, at scale 1 if the widest does not fit at 2.
  int widest = 0;
  for (double t : y.ticks) widest = std::max(widest, Canvas::text_width(tick_label(t, y.decimals), 2));
  const int y_scale = widest <= p.x - 14 ? 2 : 1;
  for (double t : y.ticks) {
    const int py = y_px(t, y, p);
    c.fill({p.x, py, p.w, 1}, kGrid);
    const std::string s = tick_label(t, y.decimals);
    c.text(p.x - 8 - Canvas::text_width(s, y_scale), py - Canvas::text_height(y_scale) / 2, s, kInk, y_scale);
  }
  for (double t : x.ticks) {
    const int px = x_px(t, x, p);
    c.fill({px, p.y, 1, p.h}, kGrid);
    c.fill({px, p.y + p.h, 1, 5}, kInk);
    centered(c, px, p.y + p.h + 8, {tick_label(t, 0), 2}, kInk);
  }
  c.fill({p.x - 1, p.y, 2, p.h + 1}, kInk);    // y axis
  c.fill({p.x - 1, p.y + p.h, p.w + 1, 2}, kInk);  // x axis
  centered(c, p.cx(), p.y + p.h + 32, {"step", 2}, kInk);
}

// Consecutive finite points are joined; a NaN or inf loss leaves a gap, and a
// finite point without a finite neighbour is drawn as a dot so it is not lost.
void draw_curve(Canvas& c, const Rect& p, const Axis& x, const Axis& y, const std::vector<double>& losses, Rgb color) {
  auto finite_at = [&](size_t i) { return i < losses.size() && std::isfinite(losses[i]); };
  auto px = [&](size_t i) { return x_px(static_cast<double>(i + 1), x, p); };
  auto py = [&](size_t i) { return y_px(losses[i], y, p); };
  for (size_t i = 0; i < losses.size(); ++i) {
    if (!finite_at(i)) continue;
    if (i > 0 && finite_at(i - 1))
      c.line(px(i - 1), py(i - 1), px(i), py(i), color, 2);
    else if (!finite_at(i + 1))
      c.fill({px(i) - 2, py(i) - 2, 5, 5}, color);
  }
}

// Top-right inside the plot, over the curves on a filled box so it stays
// readable; as many entries as fit, then a count of the rest.
void draw_legend(Canvas& c, const Rect& p, const std::vector<CompareRow>& rows) {
  if (rows.empty()) return;
  constexpr int kRow = 20, kPad = 6, kSwatch = 22;
  const size_t fits = static_cast<size_t>((p.h - 2 * kPad - 16) / kRow);
  const size_t shown = rows.size() <= fits ? rows.size() : fits - 1;
  std::vector<Fitted> texts;
  int widest = 0;
  for (size_t i = 0; i < shown; ++i) {
    const std::string s = rows[i].label + (rows[i].failed() ? " (failed)" : "");
    texts.push_back(fit(s, p.w / 2 - kSwatch - 3 * kPad));
    widest = std::max(widest, texts.back().width());
  }
  if (shown < rows.size()) texts.push_back({cat("+", rows.size() - shown, " more"), 2});
  widest = std::max(widest, texts.back().width());

  const Rect box{p.x + p.w - widest - kSwatch - 3 * kPad - 8, p.y + 8, widest + kSwatch + 3 * kPad,
                 static_cast<int>(texts.size()) * kRow + kPad};
  c.fill(box, kBackground);
  c.outline(box, kMuted);
  for (size_t i = 0; i < texts.size(); ++i) {
    const int top = box.y + kPad + static_cast<int>(i) * kRow;
    const bool real_row = i < shown;
    if (real_row) c.fill({box.x + kPad, top + kLineHeight2 / 2 - 1, kSwatch, 3}, row_color(i));
    const Rgb ink = real_row && !rows[i].failed() ? kInk : kMuted;
    c.text(box.x + 2 * kPad + kSwatch, top + (kLineHeight2 - Canvas::text_height(texts[i].scale)) / 2,
           texts[i].text, ink, texts[i].scale);
  }
}

void draw_loss_panel(Canvas& c, const std::vector<CompareRow>& rows) {
  const Rect& p = kLossPlot;
  c.text(p.x, p.y - 30, "loss", kInk, 2);
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  size_t max_steps = 0;
  for (const auto& r : rows) {
    max_steps = std::max(max_steps, r.losses.size());
    for (double l : r.losses)
      if (std::isfinite(l)) {
        lo = std::min(lo, l);
        hi = std::max(hi, l);
      }
  }
  const bool any = lo <= hi;
  const Axis y = any ? loss_axis(lo, hi) : loss_axis(0, 1);
  const Axis x = step_axis(max_steps);
  draw_axes(c, p, x, y);
  if (!any) centered(c, p.cx(), p.cy(), {"no loss data", 2}, kMuted);
  for (size_t i = 0; i < rows.size(); ++i) draw_curve(c, p, x, y, rows[i].losses, row_color(i));
  draw_legend(c, p, rows);
}

struct Bar {
  double value = 0;
  std::string text;  // printed above the bar
};

// One bar per row scaled to the largest value (headroom left for the value
// text), the value above each bar, the row label under the baseline.
std::vector<Rect> draw_bars(Canvas& c, const Rect& p, const std::string& caption, const std::vector<CompareRow>& rows,
                            const std::vector<Bar>& bars) {
  c.text(p.x, p.y - 40, caption, kInk, 2);
  const int baseline = p.y + p.h;
  c.fill({p.x, baseline, p.w, 2}, kInk);
  if (bars.empty()) return {};
  double vmax = 0;
  for (const auto& b : bars)
    if (std::isfinite(b.value)) vmax = std::max(vmax, b.value);
  const int n = static_cast<int>(bars.size());
  const int slot = p.w / n, bar_w = std::max(2, slot * 3 / 5);
  const int room = p.h - kLineHeight2 - 8;
  std::vector<Rect> rects;
  for (int i = 0; i < n; ++i) {
    const double v = std::isfinite(bars[i].value) && bars[i].value > 0 ? bars[i].value : 0;
    const int h = vmax > 0 ? static_cast<int>(std::lround(v / vmax * room)) : 0;
    const Rect bar{p.x + i * slot + (slot - bar_w) / 2, baseline - h, bar_w, h};
    c.fill(bar, row_color(i));
    rects.push_back(bar);
    const Fitted value = fit(bars[i].text, slot - 4);
    centered(c, bar.cx(), bar.y - 6 - Canvas::text_height(value.scale), value, rows[i].failed() ? kMuted : kInk);
    centered(c, bar.cx(), baseline + 8, fit(rows[i].label, slot - 4), kInk);
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
std::string gib_text(double gib) { return tick_label(gib, 2); }

}  // namespace

Rgb row_color(size_t index) { return kPalette[index % std::size(kPalette)]; }

Chart render_chart(const std::vector<CompareRow>& rows, const std::string& title) {
  Chart chart{Canvas(kWidth, kHeight, kBackground), kLossPlot, {}, {}};
  Canvas& c = chart.canvas;
  centered(c, kWidth / 2, 18, fit(title, kWidth - 40, 3), kInk);
  draw_loss_panel(c, rows);
  chart.throughput_bars =
      draw_bars(c, kThroughputPlot, "tokens/s per GPU", rows, bars_of(rows, throughput, format_count));
  chart.memory_bars =
      draw_bars(c, kMemoryPlot, "peak memory per GPU (GiB)", rows, bars_of(rows, peak_gib, gib_text));
  return chart;
}

}  // namespace loom::report
