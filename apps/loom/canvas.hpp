// An RGB pixel buffer with the few drawing operations the comparison charts
// need: filled rectangles, thick lines and text in a built-in 5x7 bitmap font.
// Everything is clipped to the canvas, so callers may draw partly outside it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom::report {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};

struct Rect {
  int x = 0, y = 0, w = 0, h = 0;  // top-left corner and size in pixels
  int cx() const { return x + w / 2; }
  int cy() const { return y + h / 2; }
};

class Canvas {
 public:
  Canvas(int width, int height, Rgb background);

  int width() const { return width_; }
  int height() const { return height_; }
  // Rows top to bottom, 3 bytes per pixel: what png::encode_rgb takes.
  const std::vector<uint8_t>& rgb() const { return rgb_; }

  Rgb at(int x, int y) const;
  void pixel(int x, int y, Rgb c);
  void fill(const Rect& r, Rgb c);
  void outline(const Rect& r, Rgb c);
  // A line from (x0, y0) to (x1, y1), both ends included, `thickness` pixels wide.
  void line(int x0, int y0, int x1, int y1, Rgb c, int thickness = 1);
  // Text with its top-left corner at (x, y), each font pixel drawn as a
  // scale x scale square. Characters outside ASCII 32..126 are drawn as '?'.
  void text(int x, int y, const std::string& s, Rgb c, int scale = 1);

  static int text_width(const std::string& s, int scale);
  // Cap height: what layouts align on. Descenders of g, j, p, q and y reach
  // 2 * scale pixels further down.
  static int text_height(int scale);

 private:
  int width_, height_;
  std::vector<uint8_t> rgb_;
};

}  // namespace loom::report
