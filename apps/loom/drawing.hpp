// The 2-D drawing the charts of `loom plot` and `loom compare` are made of,
// done by cairo: an RGB image, antialiased lines, text in a real font
// (fontconfig's "sans-serif"; cairo's built-in font where a machine has
// none) and cairo's PNG writer. The charts' layout (axes with ticks,
// legends, bars) is theirs; nothing here draws pixels by hand.
//
// cairo is loaded (dlopen) when the first Drawing is made, not linked, so
// that loom starts where cairo is missing and only drawing needs it. It
// stays out of this header, so that its users need not find cairo.h.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct _cairo;
struct _cairo_surface;

namespace loom::report {

inline constexpr const char* kCairoLibrary = "libcairo.so.2";
// Loads cairo (`library`: its file name, for tests) unless loaded already.
// Throws loom::Error naming the library, why it cannot be loaded and what to
// do; callers check it before work whose result includes a chart.
void require_cairo(const char* library = kCairoLibrary);

struct Cairo;  // the cairo calls, loaded

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};

struct Rect {
  int x = 0, y = 0, w = 0, h = 0;  // top-left corner and size in pixels
  int cx() const { return x + w / 2; }
  int cy() const { return y + h / 2; }
};

// The charts' colours: text and axes, secondary text and frames, grid lines, the page.
inline constexpr Rgb kInk{40, 40, 40}, kMuted{130, 130, 130}, kGrid{228, 228, 228}, kBackground{255, 255, 255};

enum class Align { kLeft, kCenter, kRight };  // where x is on the text: its left end, middle, right end

struct Point {
  double x = 0, y = 0;
};

class Drawing {
 public:
  // A width x height image filled with `background`. Throws loom::Error
  // naming the size when cairo cannot make it (a non-positive size, or
  // memory), and require_cairo's error when cairo cannot be loaded.
  Drawing(int width, int height, Rgb background);
  ~Drawing();
  Drawing(Drawing&&) noexcept;
  Drawing& operator=(Drawing&&) noexcept;
  Drawing(const Drawing&) = delete;
  Drawing& operator=(const Drawing&) = delete;

  int width() const { return width_; }
  int height() const { return height_; }

  // A pixel of the image as drawn so far; black outside it.
  Rgb at(int x, int y) const;
  // All pixels, rows top to bottom, 3 bytes per pixel (what a PNG decoder gives back).
  std::vector<uint8_t> rgb() const;

  // A filled rectangle on whole pixels: every pixel inside has exactly `c`.
  void fill(const Rect& r, Rgb c);
  // A 1-pixel frame just inside r.
  void outline(const Rect& r, Rgb c);
  // A polyline through `points`, `width` pixels wide, antialiased, with round
  // joins and caps. Fewer than two points draw nothing.
  void polyline(const std::vector<Point>& points, Rgb c, double width);
  void dot(Point centre, double radius, Rgb c);

  // Text of `size` pixels (the font's em) whose capitals' middle is at y, so
  // that labels centre on the tick or swatch beside them. Invalid UTF-8 and
  // control characters are drawn as U+FFFD rather than stopping the drawing.
  void text(double x, double y, std::string_view s, Rgb c, double size, Align align = Align::kLeft, bool bold = false);
  double text_width(std::string_view s, double size, bool bold = false);
  // The height of capitals at `size`: what layouts leave room for.
  double cap_height(double size);
  // `s` at the largest size from max_size down to min_size whose width is at
  // most max_width; at min_size, cut and ended with "…" when still too wide.
  struct Fitted {
    std::string text;
    double size = 0;
  };
  Fitted fit(std::string_view s, double max_width, double max_size, double min_size, bool bold = false);

  // The image as a PNG file (8-bit RGB), encoded by cairo. Throws loom::Error
  // naming `path` when it cannot be written, and naming cairo's status when a
  // drawing call failed.
  void write_png(const std::string& path) const;

 private:
  void check(const char* what) const;
  void set_font(double size, bool bold);
  int width_ = 0, height_ = 0;
  const Cairo* c_ = nullptr;
  _cairo_surface* surface_ = nullptr;
  _cairo* cr_ = nullptr;
};

// Text as cairo's text calls take it: valid UTF-8 without control characters,
// each byte of an ill-formed sequence and each control character a U+FFFD.
std::string printable(std::string_view s);

// An axis: its range, the ticks on it (1, 2 or 5 times a power of ten) and
// the digits their labels need.
struct Axis {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> ticks;
  int decimals = 0;
  std::string label(double v) const;  // a tick's text: fixed decimals, or 1.5e-05 for very small or large values
};
// 1, 2 or 5 times a power of ten, at least `raw` (> 0): a step people can read.
double nice_step(double raw);
// About `target` ticks spanning [lo, hi], the range widened to whole ticks,
// and none closer than `min_step` (1 for steps, which are whole numbers).
// A flat range (one value, or all equal) is widened around the value first,
// so that nothing divides by a zero span; non-finite or absurd bounds are clamped.
Axis nice_axis(double lo, double hi, int target = 5, double min_step = 0);

// A plot area with its axes: what maps data to pixels, and draws the frame.
struct Frame {
  Rect area;
  Axis x, y;
  double px(double v) const;  // data to pixel, clamped far outside so no overflow
  double py(double v) const;
};
// Grid lines at the ticks, the axis lines, tick labels left of and under the
// area, and `x_title` centred under the tick labels.
void draw_frame(Drawing& d, const Frame& f, const std::string& x_title);

}  // namespace loom::report
