"""Pathfinder's label read off an image: are the two markers on one curve?

The generator keeps curves more than ``link`` pixels (Chebyshev) apart and bridges a curve's dash gaps
within ``link``, so linking lit pixels at most ``link`` apart splits the image into its curves; the
markers are the only blobs with a fully lit 3x3 core (curves are at most 2 px thick). This reads the
label from the pixels alone, so it checks any stage that carries an image: the generator, the PNG files,
and the token ids a model receives (``audit_pathfinder``).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from linattn.errors import DataError

from .dataset import LRADataset


def blobs(mask: np.ndarray, reach: int) -> tuple[np.ndarray, int]:
    """Connected components of bool ``mask`` [H, W], pixels at Chebyshev distance <= ``reach`` linked:
    (labels [H, W], -1 off the mask; number of components)."""
    label = np.full(mask.shape, -1)
    H, W = mask.shape
    n = 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if label[y0, x0] >= 0:
            continue
        label[y0, x0] = n
        todo = deque([(y0, x0)])
        while todo:
            y, x = todo.popleft()
            for yy in range(max(0, y - reach), min(H, y + reach + 1)):
                for xx in range(max(0, x - reach), min(W, x + reach + 1)):
                    if mask[yy, xx] and label[yy, xx] < 0:
                        label[yy, xx] = n
                        todo.append((yy, xx))
        n += 1
    return label, n


def find_markers(img: np.ndarray) -> list[tuple[int, int]]:
    """One pixel (y, x) of each marker of ``img`` [H, W]: the blobs of lit pixels whose whole 3x3
    neighbourhood is lit (an erosion that only the round markers survive)."""
    lit = np.pad(img > 0, 1)
    H, W = img.shape
    core = np.ones((H, W), dtype=bool)
    for dy in range(3):
        for dx in range(3):
            core &= lit[dy: dy + H, dx: dx + W]
    label, n = blobs(core, 1)
    return [tuple(int(v) for v in np.argwhere(label == i)[0]) for i in range(n)]


def image_label(img: np.ndarray, link: int) -> int:
    """1 if the two markers of ``img`` are on one curve (lit pixels linked across gaps of <= ``link``), else 0;
    DataError unless the image has exactly two markers."""
    found = find_markers(img)
    if len(found) != 2:
        raise DataError(f"a Pathfinder image has two markers; found {len(found)}")
    label, _ = blobs(img > 0, link)
    return int(label[found[0]] == label[found[1]])


def audit_pathfinder(data: LRADataset, link: int, indices: range | list[int] | None = None) -> list[int]:
    """The indices (of ``indices``, default all) whose label differs from the one read off the token ids
    the dataset hands a model (ids back to grey levels, reshaped to the square image)."""
    side = int(round(len(data.sequence(0)) ** 0.5))
    bad = []
    for i in range(len(data)) if indices is None else indices:
        item = data[i]
        img = (item["input_ids"].numpy() - data.vocab.offset).reshape(side, side)
        if image_label(img, link) != int(item["label"]):
            bad.append(i)
    return bad
