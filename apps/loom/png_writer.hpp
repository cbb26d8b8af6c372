// A minimal PNG encoder: 8-bit RGB, no interlace, the pixel data in stored
// (uncompressed) deflate blocks. Files are larger than a compressing encoder's,
// but every byte is easy to check and to decode; charts are the only user.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace loom::png {

// CRC-32 as PNG chunks use it (ISO-HDLC: reflected 0xEDB88320, init and final
// xor 0xFFFFFFFF). Pass a previous result as `crc` to continue over more bytes.
uint32_t crc32(std::span<const uint8_t> bytes, uint32_t crc = 0);

// Adler-32 as the zlib stream trailer uses it.
uint32_t adler32(std::span<const uint8_t> bytes);

// The complete PNG file for a width x height image; `rgb` holds the rows top
// to bottom, 3 bytes per pixel. Throws loom::Error on empty or mismatched sizes.
std::vector<uint8_t> encode_rgb(int width, int height, std::span<const uint8_t> rgb);

}  // namespace loom::png
