#!/usr/bin/env python3
"""Decodes a PNG written by `loom plot` with nothing but zlib, independently of
Loom's writer: signature, every chunk's CRC-32, IHDR (8-bit RGB, the size
asked), IDAT inflated to exactly height rows of a filter byte and width RGB
pixels, IEND last; prints the number of distinct colours.

usage: check_png.py FILE WIDTH HEIGHT      exits 1 naming what is wrong
"""
import struct
import sys
import zlib

path, want_w, want_h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = open(path, "rb").read()
if data[:8] != b"\x89PNG\r\n\x1a\n":
    sys.exit(f"{path}: not a PNG signature")
pos, chunks, idat, ihdr = 8, [], b"", None
while pos < len(data):
    if pos + 12 > len(data):
        sys.exit(f"{path}: truncated chunk at byte {pos}")
    (n,) = struct.unpack(">I", data[pos:pos + 4])
    kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
    (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
    if len(body) != n or crc != zlib.crc32(kind + body) & 0xFFFFFFFF:
        sys.exit(f"{path}: bad CRC in chunk {kind!r} at byte {pos}")
    chunks.append(kind)
    if kind == b"IHDR":
        ihdr = struct.unpack(">IIBBBBB", body)
    elif kind == b"IDAT":
        idat += body
    pos += 12 + n
if not chunks or chunks[0] != b"IHDR" or chunks[-1] != b"IEND":
    sys.exit(f"{path}: chunks {chunks}: IHDR must come first and IEND last")
w, h, depth, colour, _, _, interlace = ihdr
if (w, h, depth, colour, interlace) != (want_w, want_h, 8, 2, 0):
    sys.exit(f"{path}: IHDR {ihdr}, expected {want_w}x{want_h} 8-bit RGB, not interlaced")
raw = zlib.decompress(idat)
stride = 1 + 3 * w
if len(raw) != h * stride:
    sys.exit(f"{path}: IDAT inflates to {len(raw)} bytes, expected {h * stride}")
if any(raw[r * stride] > 4 for r in range(h)):
    sys.exit(f"{path}: a row has a filter type above 4")
if any(raw[r * stride] != 0 for r in range(h)):
    print("note: filtered rows; colours counted on unfiltered rows only")
colours = {raw[r * stride + 1 + 3 * x:r * stride + 4 + 3 * x] for r in range(h) if raw[r * stride] == 0 for x in range(w)}
print(f"png OK: {w}x{h}, {len(colours)} colours")
