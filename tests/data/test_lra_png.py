"""The PNG codec: exact round trips, every row filter, colour types, Pillow agreement, bad input."""

import struct
import zlib

import numpy as np
import pytest

from linattn.data.lra.png import SIGNATURE, decode_png, encode_png, read_png, write_png


def _chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _paeth(a, b, c):
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def filtered_png(px, filters, colour):
    """Encode ``px`` [H, W, C] uint8 with the given per-row filter types (forward filtering, by the spec)."""
    H, W, C = px.shape
    rows = px.reshape(H, W * C).astype(int)
    out = bytearray()
    for y in range(H):
        f, cur = filters[y % len(filters)], rows[y]
        prev = rows[y - 1] if y else np.zeros_like(cur)
        out.append(f)
        for i in range(W * C):
            a = cur[i - C] if i >= C else 0
            c = prev[i - C] if i >= C else 0
            pred = [0, a, prev[i], (a + prev[i]) // 2, _paeth(a, prev[i], c)][f]
            out.append((cur[i] - pred) % 256)
    ihdr = struct.pack(">IIBBBBB", W, H, 8, colour, 0, 0, 0)
    return SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(bytes(out))) + _chunk(b"IEND", b"")


def test_round_trip(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, (13, 9), dtype=np.uint8)
    write_png(tmp_path / "a.png", img)
    assert np.array_equal(read_png(tmp_path / "a.png"), img)


@pytest.mark.parametrize("filters", [[0], [1], [2], [3], [4], [0, 1, 2, 3, 4]])
def test_every_filter(filters):
    px = np.random.default_rng(1).integers(0, 256, (7, 6, 1), dtype=np.uint8)
    assert np.array_equal(decode_png(filtered_png(px, filters, 0)), px[:, :, 0])


@pytest.mark.parametrize("colour,channels", [(4, 2), (2, 3), (6, 4)])
def test_colour_types(colour, channels):
    px = np.random.default_rng(2).integers(0, 256, (5, 4, channels), dtype=np.uint8)
    got = decode_png(filtered_png(px, [4, 1, 3], colour))
    if channels == 2:
        want = px[:, :, 0]
    else:
        want = np.clip(np.rint(px[:, :, :3] @ np.array([0.299, 0.587, 0.114])), 0, 255).astype(np.uint8)
    assert np.array_equal(got, want)


def test_agrees_with_pillow():
    Image = pytest.importorskip("PIL.Image")
    import io

    img = np.random.default_rng(3).integers(0, 256, (16, 11), dtype=np.uint8)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(encode_png(img)))), img)
    buf = io.BytesIO()
    Image.fromarray(np.tile(np.arange(40, dtype=np.uint8), (12, 1))).save(buf, "PNG")
    assert np.array_equal(decode_png(buf.getvalue()), np.tile(np.arange(40, dtype=np.uint8), (12, 1)))


def test_bad_input():
    with pytest.raises(TypeError, match="image must be"):
        encode_png(np.zeros((4, 4), dtype=np.float32))
    with pytest.raises(TypeError, match="image must be"):
        encode_png(np.zeros((4, 4, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="signature"):
        decode_png(b"GIF89a" + bytes(20))
    sixteen_bit = SIGNATURE + _chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 16, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="bit depth 16"):
        decode_png(sixteen_bit)
