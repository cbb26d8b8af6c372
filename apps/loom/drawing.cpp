#include "drawing.hpp"

#include <cairo.h>
#include <dlfcn.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numbers>

#include "loom/error.hpp"

namespace loom::report {

// The cairo calls the charts make. cairo is loaded when the first chart is
// drawn, not linked: `loom train` and `loom bench` then start on machines
// without it (GPU nodes often have no 2-D graphics stack), and only drawing
// a chart needs it. cairo.h gives each call's type.
#define LOOM_CAIRO_CALLS(X)                                                                                  \
  X(cairo_image_surface_create) X(cairo_image_surface_get_data) X(cairo_image_surface_get_stride)            \
  X(cairo_surface_status) X(cairo_surface_flush) X(cairo_surface_destroy) X(cairo_surface_write_to_png_stream) \
  X(cairo_create) X(cairo_destroy) X(cairo_status) X(cairo_status_to_string) X(cairo_set_source_rgb)         \
  X(cairo_paint) X(cairo_rectangle) X(cairo_fill) X(cairo_stroke) X(cairo_set_line_width)                    \
  X(cairo_set_line_join) X(cairo_set_line_cap) X(cairo_move_to) X(cairo_line_to) X(cairo_new_sub_path)       \
  X(cairo_arc) X(cairo_select_font_face) X(cairo_set_font_size) X(cairo_text_extents) X(cairo_show_text)

struct Cairo {
#define LOOM_CAIRO_MEMBER(f) decltype(&::f) f = nullptr;
  LOOM_CAIRO_CALLS(LOOM_CAIRO_MEMBER)
#undef LOOM_CAIRO_MEMBER
};

namespace {

Cairo load_cairo(const char* library) {
  const std::string what = cat("drawing a chart needs cairo (", library, ")");
  const std::string fix = "install it (Debian/Ubuntu: apt install libcairo2) or run this command on a machine that has it";
  // Never closed: the library stays for the process, as plugins do.
  void* h = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (!h) throw Error(cat(what, ", which cannot be loaded: ", dlerror(), "; ", fix));
  Cairo c;
#define LOOM_CAIRO_LOAD(f)                                                                              \
  c.f = reinterpret_cast<decltype(c.f)>(dlsym(h, #f));                                                  \
  if (!c.f) throw Error(cat(what, ", but ", library, " has no ", #f, " (a cairo without PNG support?); ", fix));
  LOOM_CAIRO_CALLS(LOOM_CAIRO_LOAD)
#undef LOOM_CAIRO_LOAD
  return c;
}

// Loaded once; a failed load is tried again (and named again) by the next chart.
const Cairo& cairo() {
  static const Cairo c = load_cairo(kCairoLibrary);
  return c;
}

void set_source(const Cairo& c, cairo_t* cr, Rgb rgb) {
  c.cairo_set_source_rgb(cr, rgb.r / 255.0, rgb.g / 255.0, rgb.b / 255.0);
}

// The length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no
// overlongs, no surrogates, nothing above U+10FFFF), or 0 when it is not one.
std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  std::size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
  else return 0;
  if (i + n > s.size() || b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if (b(i + k) < 0x80 || b(i + k) > 0xBF) return 0;
  return n;
}

}  // namespace

void require_cairo(const char* library) {
  if (std::strcmp(library, kCairoLibrary) == 0) cairo();
  else load_cairo(library);
}

std::string printable(std::string_view s) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_length(s, i);
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const bool control = n == 1 ? c < 0x20 || c == 0x7F : n == 2 && c == 0xC2 && static_cast<unsigned char>(s[i + 1]) < 0xA0;
    if (n == 0 || control) {
      out += kReplacement;
      i += n == 0 ? 1 : n;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

Drawing::Drawing(int width, int height, Rgb background) : width_(width), height_(height) {
  if (width <= 0 || height <= 0) throw Error(cat("a chart of ", width, "x", height, " pixels cannot be drawn"));
  c_ = &cairo();
  surface_ = c_->cairo_image_surface_create(CAIRO_FORMAT_RGB24, width, height);
  if (const cairo_status_t st = c_->cairo_surface_status(surface_); st != CAIRO_STATUS_SUCCESS) {
    c_->cairo_surface_destroy(surface_);
    throw Error(cat("cairo_image_surface_create(RGB24, ", width, ", ", height, ") failed: ", c_->cairo_status_to_string(st)));
  }
  cr_ = c_->cairo_create(surface_);
  if (const cairo_status_t st = c_->cairo_status(cr_); st != CAIRO_STATUS_SUCCESS) {
    c_->cairo_destroy(cr_);
    c_->cairo_surface_destroy(surface_);
    throw Error(cat("cairo_create on a ", width, "x", height, " image failed: ", c_->cairo_status_to_string(st)));
  }
  set_source(*c_, cr_, background);
  c_->cairo_paint(cr_);
}

Drawing::~Drawing() {
  if (cr_) c_->cairo_destroy(cr_);
  if (surface_) c_->cairo_surface_destroy(surface_);
}

Drawing::Drawing(Drawing&& o) noexcept
    : width_(o.width_), height_(o.height_), c_(o.c_), surface_(std::exchange(o.surface_, nullptr)),
      cr_(std::exchange(o.cr_, nullptr)) {}

// A swap: `o` takes this image and frees it when it goes.
Drawing& Drawing::operator=(Drawing&& o) noexcept {
  std::swap(width_, o.width_);
  std::swap(height_, o.height_);
  std::swap(c_, o.c_);
  std::swap(surface_, o.surface_);
  std::swap(cr_, o.cr_);
  return *this;
}

// Any cairo call that failed left the context in an error state (and made
// every later call a no-op): report it once, with what was being done.
void Drawing::check(const char* what) const {
  if (const cairo_status_t st = c_->cairo_status(cr_); st != CAIRO_STATUS_SUCCESS)
    throw Error(cat(what, ": cairo's drawing failed: ", c_->cairo_status_to_string(st)));
}

Rgb Drawing::at(int x, int y) const {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return {};
  c_->cairo_surface_flush(surface_);
  const unsigned char* row =
      c_->cairo_image_surface_get_data(surface_) + static_cast<std::size_t>(y) * c_->cairo_image_surface_get_stride(surface_);
  uint32_t px;  // RGB24: one native-endian 0x00RRGGBB word per pixel
  std::memcpy(&px, row + 4 * static_cast<std::size_t>(x), 4);
  return {static_cast<uint8_t>(px >> 16), static_cast<uint8_t>(px >> 8), static_cast<uint8_t>(px)};
}

std::vector<uint8_t> Drawing::rgb() const {
  c_->cairo_surface_flush(surface_);
  const unsigned char* data = c_->cairo_image_surface_get_data(surface_);
  const std::size_t stride = static_cast<std::size_t>(c_->cairo_image_surface_get_stride(surface_));
  std::vector<uint8_t> out;
  out.reserve(static_cast<std::size_t>(width_) * height_ * 3);
  for (int y = 0; y < height_; ++y)
    for (int x = 0; x < width_; ++x) {
      uint32_t px;
      std::memcpy(&px, data + y * stride + 4 * static_cast<std::size_t>(x), 4);
      out.insert(out.end(), {static_cast<uint8_t>(px >> 16), static_cast<uint8_t>(px >> 8), static_cast<uint8_t>(px)});
    }
  return out;
}

void Drawing::fill(const Rect& r, Rgb c) {
  if (r.w <= 0 || r.h <= 0) return;
  set_source(*c_, cr_, c);
  c_->cairo_rectangle(cr_, r.x, r.y, r.w, r.h);
  c_->cairo_fill(cr_);
}

void Drawing::outline(const Rect& r, Rgb c) {
  if (r.w <= 0 || r.h <= 0) return;
  set_source(*c_, cr_, c);
  c_->cairo_set_line_width(cr_, 1);
  c_->cairo_rectangle(cr_, r.x + 0.5, r.y + 0.5, r.w - 1, r.h - 1);  // on pixel centres: a crisp 1-pixel line
  c_->cairo_stroke(cr_);
}

void Drawing::polyline(const std::vector<Point>& points, Rgb c, double width) {
  if (points.size() < 2) return;
  set_source(*c_, cr_, c);
  c_->cairo_set_line_width(cr_, width);
  c_->cairo_set_line_join(cr_, CAIRO_LINE_JOIN_ROUND);
  c_->cairo_set_line_cap(cr_, CAIRO_LINE_CAP_ROUND);
  c_->cairo_move_to(cr_, points[0].x, points[0].y);
  for (std::size_t i = 1; i < points.size(); ++i) c_->cairo_line_to(cr_, points[i].x, points[i].y);
  c_->cairo_stroke(cr_);
}

void Drawing::dot(Point centre, double radius, Rgb c) {
  set_source(*c_, cr_, c);
  c_->cairo_new_sub_path(cr_);
  c_->cairo_arc(cr_, centre.x, centre.y, radius, 0, 2 * std::numbers::pi);
  c_->cairo_fill(cr_);
}

void Drawing::set_font(double size, bool bold) {
  c_->cairo_select_font_face(cr_, "sans-serif", CAIRO_FONT_SLANT_NORMAL,
                             bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  c_->cairo_set_font_size(cr_, size);
}

double Drawing::text_width(std::string_view s, double size, bool bold) {
  set_font(size, bold);
  cairo_text_extents_t e;
  c_->cairo_text_extents(cr_, printable(s).c_str(), &e);
  return e.x_advance;
}

double Drawing::cap_height(double size) {
  set_font(size, false);
  cairo_text_extents_t e;
  c_->cairo_text_extents(cr_, "H", &e);
  return -e.y_bearing;
}

void Drawing::text(double x, double y, std::string_view s, Rgb c, double size, Align align, bool bold) {
  const std::string t = printable(s);
  if (t.empty()) return;
  const double w = align == Align::kLeft ? 0 : text_width(t, size, bold);
  const double cap = cap_height(size);
  set_font(size, bold);
  set_source(*c_, cr_, c);
  c_->cairo_move_to(cr_, x - (align == Align::kCenter ? w / 2 : align == Align::kRight ? w : 0), y + cap / 2);
  c_->cairo_show_text(cr_, t.c_str());
}

Drawing::Fitted Drawing::fit(std::string_view s, double max_width, double max_size, double min_size, bool bold) {
  std::string t = printable(s);
  for (double size = max_size; size >= min_size; size -= 1)
    if (text_width(t, size, bold) <= max_width) return {t, size};
  // Still too wide at the smallest size: drop whole characters from the end.
  static constexpr std::string_view kEllipsis = "\xE2\x80\xA6";
  while (!t.empty() && text_width(t + std::string(kEllipsis), min_size, bold) > max_width) {
    while (!t.empty() && (static_cast<unsigned char>(t.back()) & 0xC0) == 0x80) t.pop_back();  // continuation bytes
    if (!t.empty()) t.pop_back();  // and the character's first byte
  }
  if (t.empty()) return {"", min_size};
  return {t + std::string(kEllipsis), min_size};
}

void Drawing::write_png(const std::string& path) const {
  check(("drawing " + path).c_str());
  std::string bytes;
  auto append = [](void* closure, const unsigned char* data, unsigned int n) {
    static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), n);
    return CAIRO_STATUS_SUCCESS;
  };
  c_->cairo_surface_flush(surface_);
  if (const cairo_status_t st = c_->cairo_surface_write_to_png_stream(surface_, append, &bytes); st != CAIRO_STATUS_SUCCESS)
    throw Error(cat("cairo_surface_write_to_png_stream for '", path, "' (", width_, "x", height_,
                    ") failed: ", c_->cairo_status_to_string(st)));
  errno = 0;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (f) f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (f) f.close();
  if (!f)
    throw Error(cat("cannot write '", path, "': ", errno ? std::strerror(errno) : "I/O error",
                    "; check that its directory exists and is writable"));
}

// ---------------------------------------------------------------------------
// Axes
// ---------------------------------------------------------------------------
double nice_step(double raw) {
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

Axis nice_axis(double lo, double hi, int target, double min_step) {
  if (!(lo <= hi)) lo = 0, hi = 1;                           // nothing finite: an empty frame
  lo = std::clamp(lo, -1e300, 1e300), hi = std::clamp(hi, -1e300, 1e300);  // keeps hi - lo finite
  if (!(hi - lo > 1e-9 * std::max(std::fabs(lo), std::fabs(hi)))) {
    const double pad = lo != 0 ? std::fabs(lo) * 0.05 : 0.5;
    lo -= pad;
    hi += pad;
  }
  const double step = std::max(nice_step((hi - lo) / std::max(target, 1)), min_step);
  Axis a;
  a.step = step;
  a.lo = std::floor(lo / step) * step;
  a.hi = std::ceil(hi / step) * step;
  // A bounded loop: rounding must never turn into an endless or huge tick list.
  for (int k = 0; k < 50; ++k) {
    const double t = a.lo + k * step;
    if (t > a.hi + step * 1e-6) break;
    a.ticks.push_back(std::fabs(t) < step * 1e-6 ? 0.0 : t);  // no "-0.00"
  }
  a.decimals = std::clamp(-static_cast<int>(std::floor(std::log10(step) + 1e-9)), 0, 20);
  return a;
}

// Fixed decimals ("0.0025", "250000"), or the exponent form ("3.0e-05",
// "1.25e+07") where that is shorter for the axis's widest value; either way
// with the digits that tell ticks `step` apart. One form for all of an axis's labels.
std::string Axis::label(double v) const {
  char fixed[400], exp[64];
  const double big = std::max(std::fabs(lo), std::fabs(hi));
  const int digits = std::clamp(static_cast<int>(std::floor(std::log10(big)) - std::floor(std::log10(step) + 1e-9)), 0, 15);
  const int fixed_len = std::snprintf(fixed, sizeof fixed, "%.*f", decimals, -big);
  const int exp_len = std::snprintf(exp, sizeof exp, "%.*e", digits, -big);
  if (fixed_len <= exp_len || v == 0) std::snprintf(fixed, sizeof fixed, "%.*f", v == 0 && fixed_len > exp_len ? 0 : decimals, v);
  else std::snprintf(fixed, sizeof fixed, "%.*e", digits, v);
  return fixed;
}

double Frame::px(double v) const {
  const double p = area.x + (v - x.lo) / (x.hi - x.lo) * (area.w - 1);
  return std::isfinite(p) ? std::clamp(p, -1e6, 1e6) : area.x;
}

double Frame::py(double v) const {
  const double p = area.y + area.h - 1 - (v - y.lo) / (y.hi - y.lo) * (area.h - 1);
  return std::isfinite(p) ? std::clamp(p, -1e6, 1e6) : area.y + area.h - 1;
}

void draw_frame(Drawing& d, const Frame& f, const std::string& x_title) {
  constexpr double kTick = 13, kMinTick = 9;
  const Rect& a = f.area;
  for (double t : f.y.ticks) {
    const double y = f.py(t);
    d.fill({a.x, static_cast<int>(std::lround(y)), a.w, 1}, kGrid);
    const auto label = d.fit(f.y.label(t), a.x - 14, kTick, kMinTick);  // the left margin holds it
    d.text(a.x - 8, y, label.text, kInk, label.size, Align::kRight);
  }
  const double cap = d.cap_height(kTick);
  for (double t : f.x.ticks) {
    const int x = static_cast<int>(std::lround(f.px(t)));
    d.fill({x, a.y, 1, a.h}, kGrid);
    d.fill({x, a.y + a.h, 1, 5}, kInk);
    d.text(x, a.y + a.h + 10 + cap / 2, f.x.label(t), kInk, kTick, Align::kCenter);
  }
  d.fill({a.x - 1, a.y, 1, a.h + 1}, kInk);      // y axis
  d.fill({a.x - 1, a.y + a.h, a.w + 1, 1}, kInk);  // x axis
  d.text(a.cx(), a.y + a.h + 32, x_title, kMuted, kTick, Align::kCenter);
}

}  // namespace loom::report
