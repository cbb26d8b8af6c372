#include "png_writer.hpp"

#include <algorithm>
#include <array>
#include <string_view>

#include "loom/error.hpp"

namespace loom::png {
namespace {

// One entry per byte value: the CRC register after shifting that byte through.
std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[n] = c;
  }
  return table;
}

void put_u32_be(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

void put_u16_le(std::vector<uint8_t>& out, uint32_t v) {
  out.push_back(static_cast<uint8_t>(v & 0xFF));
  out.push_back(static_cast<uint8_t>((v >> 8) & 0xFF));
}

// A chunk is length, type, data, and a CRC over type and data (not the length).
void put_chunk(std::vector<uint8_t>& out, std::string_view type, std::span<const uint8_t> data) {
  put_u32_be(out, static_cast<uint32_t>(data.size()));
  const size_t type_at = out.size();
  out.insert(out.end(), type.begin(), type.end());
  out.insert(out.end(), data.begin(), data.end());
  put_u32_be(out, crc32(std::span<const uint8_t>(out).subspan(type_at)));
}

// The scanlines as PNG wants them: each row prefixed by its filter type, 0
// (none), since stored blocks would gain nothing from prediction.
std::vector<uint8_t> filtered_rows(int width, int height, std::span<const uint8_t> rgb) {
  const size_t row_bytes = static_cast<size_t>(width) * 3;
  std::vector<uint8_t> raw;
  raw.reserve(static_cast<size_t>(height) * (row_bytes + 1));
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);
    const auto row = rgb.subspan(static_cast<size_t>(y) * row_bytes, row_bytes);
    raw.insert(raw.end(), row.begin(), row.end());
  }
  return raw;
}

// A zlib stream (RFC 1950) whose deflate data (RFC 1951) is a run of stored
// blocks of at most 65535 bytes each, then the Adler-32 of the input.
std::vector<uint8_t> zlib_stored(std::span<const uint8_t> data) {
  constexpr size_t kMaxBlock = 65535;
  std::vector<uint8_t> out;
  out.reserve(data.size() + data.size() / kMaxBlock * 5 + 16);
  out.push_back(0x78);  // deflate, 32 KiB window
  out.push_back(0x01);  // no dictionary, "fastest"; 0x7801 is a multiple of 31 as required
  size_t at = 0;
  do {  // an empty input still needs one (final, empty) block
    const size_t len = std::min(kMaxBlock, data.size() - at);
    const bool final = at + len == data.size();
    out.push_back(final ? 1 : 0);  // BFINAL bit, BTYPE 00; the rest of the byte is padding
    put_u16_le(out, static_cast<uint32_t>(len));
    put_u16_le(out, static_cast<uint32_t>(~len & 0xFFFF));
    out.insert(out.end(), data.begin() + at, data.begin() + at + len);
    at += len;
  } while (at < data.size());
  put_u32_be(out, adler32(data));
  return out;
}

}  // namespace

uint32_t crc32(std::span<const uint8_t> bytes, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  uint32_t c = crc ^ 0xFFFFFFFFu;
  for (uint8_t b : bytes) c = table[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t adler32(std::span<const uint8_t> bytes) {
  constexpr uint32_t kMod = 65521;
  // 5552 is the longest run for which the sums cannot overflow 32 bits before reduction.
  constexpr size_t kRun = 5552;
  uint32_t a = 1, b = 0;
  for (size_t at = 0; at < bytes.size(); at += kRun) {
    const size_t end = std::min(bytes.size(), at + kRun);
    for (size_t i = at; i < end; ++i) {
      a += bytes[i];
      b += a;
    }
    a %= kMod;
    b %= kMod;
  }
  return (b << 16) | a;
}

std::vector<uint8_t> encode_rgb(int width, int height, std::span<const uint8_t> rgb) {
  if (width <= 0 || height <= 0)
    throw Error(cat("PNG: image size must be positive, got ", width, "x", height));
  const size_t expected = static_cast<size_t>(width) * static_cast<size_t>(height) * 3;
  if (rgb.size() != expected)
    throw Error(cat("PNG: ", width, "x", height, " RGB needs ", expected, " bytes, got ", rgb.size()));
  // All pixel data goes into one IDAT chunk, whose length is limited to 2^31 - 1;
  // the margin covers the filter bytes and 5 bytes of header per stored block.
  if (expected + static_cast<size_t>(height) > 0x7F000000u)
    throw Error(cat("PNG: ", width, "x", height, " is too large for this encoder"));

  std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> ihdr;
  put_u32_be(ihdr, static_cast<uint32_t>(width));
  put_u32_be(ihdr, static_cast<uint32_t>(height));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8 bits, RGB, deflate, adaptive filters, no interlace
  put_chunk(out, "IHDR", ihdr);
  put_chunk(out, "IDAT", zlib_stored(filtered_rows(width, height, rgb)));
  put_chunk(out, "IEND", {});
  return out;
}

}  // namespace loom::png
