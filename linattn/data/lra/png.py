"""A minimal PNG codec for 8-bit images (stdlib zlib + numpy), so Pillow is not needed.

``write_png`` writes 8-bit greyscale, non-interlaced, filter type 0. ``read_png`` reads any
non-interlaced 8-bit PNG (greyscale, grey+alpha, RGB, RGBA; all five row filters) and returns it as
greyscale ``[H, W]`` uint8 (alpha dropped; colour converted with the ITU-R 601 luma weights).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type -> samples per pixel


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(image: np.ndarray) -> bytes:
    """``image`` ``[H, W]`` uint8 as the bytes of a greyscale PNG."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 2 or 0 in image.shape:
        got = f"{image.dtype} {list(image.shape)}" if isinstance(image, np.ndarray) else type(image).__name__
        raise TypeError(f"image must be a non-empty uint8 numpy array [H, W], got {got}")
    H, W = image.shape
    raw = np.concatenate([np.zeros((H, 1), np.uint8), image], axis=1).tobytes()  # filter byte 0 per row
    header = struct.pack(">IIBBBBB", W, H, 8, 0, 0, 0, 0)
    return SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b"")


def write_png(path: str | Path, image: np.ndarray) -> None:
    """Write ``image`` ``[H, W]`` uint8 to ``path`` as a greyscale PNG."""
    Path(path).write_bytes(encode_png(image))


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def _unfilter(data: bytes, H: int, stride: int, bpp: int) -> np.ndarray:
    """Undo the per-row PNG filters; returns ``[H, stride]`` uint8."""
    if len(data) != H * (stride + 1):
        raise ValueError(f"PNG image data has {len(data)} bytes, expected {H * (stride + 1)}")
    rows = np.frombuffer(data, np.uint8).reshape(H, stride + 1)
    out = np.zeros((H, stride), np.uint8)
    prev = np.zeros(stride, np.uint8)
    for y in range(H):
        f, cur = int(rows[y, 0]), rows[y, 1:].astype(np.int64)
        if f == 0:
            row = cur
        elif f == 1:  # Sub: x[i] = raw[i] + x[i - bpp], a running sum per channel
            row = cur.reshape(-1, bpp).cumsum(axis=0).reshape(-1)
        elif f == 2:  # Up
            row = cur + prev
        elif f in (3, 4):  # Average, Paeth: sequential in i
            row = cur.copy()
            up = prev.astype(np.int64)
            for i in range(stride):
                a = int(row[i - bpp]) if i >= bpp else 0
                c = int(up[i - bpp]) if i >= bpp else 0
                pred = (a + int(up[i])) // 2 if f == 3 else _paeth(a, int(up[i]), c)
                row[i] = (row[i] + pred) & 0xFF
        else:
            raise ValueError(f"PNG row {y} has unknown filter type {f}")
        out[y] = (row & 0xFF).astype(np.uint8)
        prev = out[y]
    return out


def decode_png(blob: bytes) -> np.ndarray:
    """The bytes of an 8-bit non-interlaced PNG as greyscale ``[H, W]`` uint8."""
    if blob[:8] != SIGNATURE:
        raise ValueError("not a PNG file (bad signature)")
    pos, header, idat = 8, None, []
    while pos + 8 <= len(blob):
        (n,) = struct.unpack(">I", blob[pos: pos + 4])
        kind, data = blob[pos + 4: pos + 8], blob[pos + 8: pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", data)
        elif kind == b"IDAT":
            idat.append(data)
        elif kind == b"IEND":
            break
    if header is None:
        raise ValueError("PNG has no IHDR chunk")
    W, H, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in _CHANNELS or interlace != 0:
        raise ValueError(f"only 8-bit non-interlaced grey/RGB(A) PNGs are supported, got bit depth {depth}, "
                         f"colour type {colour}, interlace {interlace}")
    ch = _CHANNELS[colour]
    px = _unfilter(zlib.decompress(b"".join(idat)), H, W * ch, ch).reshape(H, W, ch)
    if ch <= 2:
        return np.ascontiguousarray(px[:, :, 0])
    grey = px[:, :, :3].astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    return np.clip(np.rint(grey), 0, 255).astype(np.uint8)


def read_png(path: str | Path) -> np.ndarray:
    """Read ``path`` (an 8-bit PNG) as greyscale ``[H, W]`` uint8."""
    return decode_png(Path(path).read_bytes())
