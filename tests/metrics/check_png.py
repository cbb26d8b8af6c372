#!/usr/bin/env python3
"""Decodes a PNG written by `loom plot` or `loom compare` with nothing but
zlib, independently of the writer (cairo's, through libpng): signature, every
chunk's CRC-32, IHDR (8-bit RGB, not interlaced, the size asked), IDAT
inflated to exactly height rows of a filter byte and width RGB pixels, every
row unfiltered (None, Sub, Up, Average, Paeth), IEND last. Then what a chart
must show: mostly background (white), ink in at least 1% of the pixels, and
antialiased text and lines (many grey levels, not a handful of flat colours).
Prints the number of distinct colours.

usage: check_png.py FILE WIDTH HEIGHT [--raw OUT]   exits 1 naming what is wrong
       --raw OUT  also writes the decoded pixels to OUT: rows top to bottom, 3 bytes a pixel
"""
import struct
from collections import Counter
import sys
import zlib

args = sys.argv[1:]
raw_out = None
if "--raw" in args:
    i = args.index("--raw")
    raw_out = args[i + 1]
    del args[i:i + 2]
if len(args) != 3:
    sys.exit(__doc__)
path, want_w, want_h = args[0], int(args[1]), int(args[2])
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
if b"IDAT" not in chunks:
    sys.exit(f"{path}: no IDAT chunk")
w, h, depth, colour, _, _, interlace = ihdr
if (w, h, depth, colour, interlace) != (want_w, want_h, 8, 2, 0):
    sys.exit(f"{path}: IHDR {ihdr}, expected {want_w}x{want_h} 8-bit RGB, not interlaced")
raw = zlib.decompress(idat)
stride = 1 + 3 * w
if len(raw) != h * stride:
    sys.exit(f"{path}: IDAT inflates to {len(raw)} bytes, expected {h * stride}")

# Unfiltering (PNG spec 9.2), 3 bytes per pixel: a = left, b = above, c = above-left.
LOW, HIGH = int.from_bytes(b"\x7f" * 3 * w, "little"), int.from_bytes(b"\x80" * 3 * w, "little")


def add_bytes(x, y):
    """x + y byte by byte, modulo 256, in one big-integer operation (no carry crosses a byte)."""
    a, b = int.from_bytes(x, "little"), int.from_bytes(y, "little")
    return bytearray((((a & LOW) + (b & LOW)) ^ ((a ^ b) & HIGH)).to_bytes(len(x), "little"))


pixels = bytearray(h * 3 * w)
prev = bytearray(3 * w)
for r in range(h):
    ftype, line = raw[r * stride], bytearray(raw[r * stride + 1:(r + 1) * stride])
    if ftype == 1:
        for i in range(3, len(line)):
            line[i] = (line[i] + line[i - 3]) & 0xFF
    elif ftype == 2:
        line = add_bytes(line, prev)
    elif ftype == 3:
        for i in range(len(line)):
            line[i] = (line[i] + ((line[i - 3] if i >= 3 else 0) + prev[i]) // 2) & 0xFF
    elif ftype == 4:
        for i in range(len(line)):
            a = line[i - 3] if i >= 3 else 0
            b = prev[i]
            c = prev[i - 3] if i >= 3 else 0
            pa, pb, pc = b - c, a - c, a + b - c - c  # |p - a|, |p - b|, |p - c| with p = a + b - c, before abs
            pa, pb, pc = pa if pa >= 0 else -pa, pb if pb >= 0 else -pb, pc if pc >= 0 else -pc
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    elif ftype != 0:
        sys.exit(f"{path}: row {r} has filter type {ftype}, above 4")
    pixels[r * 3 * w:(r + 1) * 3 * w] = line
    prev = line
if raw_out:
    open(raw_out, "wb").write(pixels)

counts = Counter(zip(pixels[0::3], pixels[1::3], pixels[2::3]))
white = counts[(255, 255, 255)]
if white < 0.5 * w * h:
    sys.exit(f"{path}: only {white} of {w * h} pixels are the white background")
if w * h - white < 0.01 * w * h:
    sys.exit(f"{path}: only {w * h - white} pixels are not background: nothing was drawn")
greys = {px for px in counts if px[0] == px[1] == px[2]}
if len(greys) < 16:
    sys.exit(f"{path}: {len(greys)} grey levels; antialiased text has many more")
print(f"png OK: {w}x{h}, {len(counts)} colours")
