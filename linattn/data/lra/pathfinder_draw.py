"""The drawing core of the Pathfinder generator: curves grown dash by dash on one flat grid of Python ints.

The grid is the image padded by ``margin`` cells on every side and flattened row-major (cell
``(y + margin) * W + x + margin``, ``W = size + 2 margin``); coordinates are kept in that padded frame, so
they stay positive and every pixel is one list index. A cell holds ``BLOCK`` (outside the border, or within
``link`` pixels, Chebyshev, of a drawn curve; mirrored in the numpy mask ``blocked``), ``FREE``, or the
index of the first dash of the curve being grown that came within ``link`` of it (dashes are marked so
lazily, once a later dash must keep away from them). A candidate pixel set fits dash ``k`` when no cell
under it holds a value ``<= k - exempt`` (``BLOCK`` when ``k < exempt``): one lookup per pixel tests the
border, the other curves and the curve's own older dashes at once. Scalar arithmetic on Python ints and
floats avoids numpy's per-call cost on arrays of a few elements, which would dominate the drawing.
"""

from __future__ import annotations

import math
import random
from itertools import permutations
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .pathfinder_gen import PathfinderConfig

BLOCK = -(1 << 30)
FREE = 1 << 30
INK = 255
SAMPLE_STEP = 0.25  # pixels between the points sampled along a dash
NUM_TURNS = 7  # headings tried per dash, evenly spread over [-max_turn, max_turn]
ORDERS = list(permutations(range(NUM_TURNS)))  # one uniform draw picks the order the turns are tried in


def _dilate(mask: np.ndarray, r: int) -> np.ndarray:
    """The cells of ``[H, W]`` ``mask`` within ``r`` (Chebyshev) of a True cell: the square, along y then x."""
    rows = mask.copy()
    for d in range(1, r + 1):
        rows[d:] |= mask[:-d]
        rows[:-d] |= mask[d:]
    out = rows.copy()
    for d in range(1, r + 1):
        out[:, d:] |= rows[:, :-d]
        out[:, :-d] |= rows[:, d:]
    return out


class Canvas:
    """The curves drawn so far (``image``, and ``BLOCK`` around them in ``grid``) and the curve being grown:
    its pixels per dash (a start marker belongs to dash 0, an end marker to the last dash) and, for its first
    ``len(marked)`` dashes, the grid cells each turned from ``FREE`` into its index (undone by ``truncate``)."""

    def __init__(self, cfg: PathfinderConfig) -> None:
        S, L, r = cfg.size, cfg.link, cfg.marker_radius
        self.cfg, self.exempt = cfg, cfg.exempt
        m = L + cfg.thickness + math.ceil(cfg.gap + cfg.dash_length + r) + 2  # > any excursion past the image
        W = S + 2 * m
        self.margin, self.width = m, W
        lo, hi = m + cfg.border, m + S - cfg.border
        self.blocked = np.ones((W, W), dtype=bool)
        self.blocked[lo:hi, lo:hi] = False
        self.grid = [BLOCK] * (W * W)
        for y in range(lo, hi):
            self.grid[y * W + lo: y * W + hi] = [FREE] * (hi - lo)
        self.image = np.zeros((S, S), np.uint8)
        self.span = range(-L, L + 1)
        R = math.ceil(r)
        self.disc = [dy * W + dx for dy in range(-R, R + 1) for dx in range(-R, R + 1) if dx * dx + dy * dy <= r * r]
        self.brush = [0, 1, W, W + 1] if cfg.thickness == 2 else None
        n = math.ceil(cfg.dash_length / SAMPLE_STEP)
        self.steps = [i * cfg.dash_length / n for i in range(n)]
        self.dashes: list[list[int]] = []
        self.marked: list[list[int]] = []

    def dash(self, x: float, y: float, ux: float, uy: float) -> set[int]:
        """Cells of the dash [p, p + dash_length u) from ``p = (x, y)`` (padded frame), sampled every <= 1/4 px,
        each sample rounded to its pixel and drawn with the ``thickness`` square brush."""
        W = self.width
        pix = {int(y + t * uy + 0.5) * W + int(x + t * ux + 0.5) for t in self.steps}  # int() floors: coords > 0
        return pix if self.brush is None else {p + o for p in pix for o in self.brush}

    def limit(self, k: int) -> int:
        """Cells holding a value ``<= limit(k)`` are closed to dash ``k``: outside the border, near other curves,
        or near the current curve's dashes older than ``k - exempt + 1``. Marks those dashes' neighbourhoods
        first: lazily, as most dashes are dropped or end the curve before any later dash must avoid them."""
        if k < self.exempt:
            return BLOCK
        while len(self.marked) <= k - self.exempt:
            self.marked.append([])
            self._mark(self.dashes[len(self.marked) - 1], len(self.marked) - 1)
        return k - self.exempt

    def fits(self, pix: set[int] | list[int], lim: int) -> bool:
        """Is every cell of ``pix`` open (``> lim``, see ``limit``)?"""
        return min(map(self.grid.__getitem__, pix)) > lim

    def _mark(self, pix: set[int] | list[int], k: int) -> None:
        """Mark the cells within ``link`` of ``pix`` with ``k`` where no older dash did (every marked dash has an
        index <= ``k``, so this keeps the minimum), and remember them in ``marked[k]``."""
        grid = self.grid
        new = [c for c in self.near(pix) if grid[c] == FREE]
        for c in new:
            grid[c] = k
        self.marked[k].extend(new)

    def put(self, pix: set[int] | list[int], k: int) -> None:
        """Add ``pix`` to dash ``k`` (the next dash, or the last one). Dash ``k`` is not marked yet: ``limit(k)``
        marks dashes up to ``k - exempt`` only."""
        if k == len(self.dashes):
            self.dashes.append([])
        self.dashes[k].extend(pix)

    def truncate(self, k: int) -> None:
        """Drop dashes k, k+1, ... of the current curve."""
        grid = self.grid
        for cells in self.marked[k:]:
            for c in cells:
                grid[c] = FREE
        del self.dashes[k:], self.marked[k:]

    def near(self, pix: set[int] | list[int]) -> set[int]:
        """The cells within ``link`` (Chebyshev) of ``pix``: the square window, applied along x, then along y."""
        W, span = self.width, self.span
        row = {p + d for p in pix for d in span}
        return {p + d * W for p in row for d in span}

    def commit(self) -> None:
        """Draw the current curve and block every cell within ``link`` of it."""
        cells = np.fromiter({p for d in self.dashes for p in d}, np.int64)
        self.truncate(0)
        y, x = np.divmod(cells, self.width)
        m, L = self.margin, self.cfg.link
        self.image[y - m, x - m] = INK
        lit = np.zeros_like(self.blocked)
        lit[y, x] = True
        grown = _dilate(lit, L) & ~self.blocked
        self.blocked |= grown
        grid = self.grid
        for c in np.flatnonzero(grown).tolist():
            grid[c] = BLOCK

    def grow(self, n: int, rnd: random.Random, start_marker: bool = False, end_marker: bool = False) -> bool:
        """Draw a curve of ``n`` dashes, with markers at its start / end if asked; False if it does not fit.

        From a random free start, dash by dash: a dash turns by at most ``max_turn`` (``NUM_TURNS`` evenly
        spread turns, the first that fits in a random order is taken; the first dash takes the first of as many
        uniform headings that fits); when none fits the curve backs up one or two dashes; after ``3 n`` rounds
        it starts afresh elsewhere (``max_tries`` times)."""
        cfg, W, disc, grid = self.cfg, self.width, self.disc, self.grid
        free = np.flatnonzero(~self.blocked).tolist()
        if not free:
            return False
        turn = math.radians(cfg.max_turn)
        turns = [turn * (2 * i / (NUM_TURNS - 1) - 1) for i in range(NUM_TURNS)]
        length, step, last = cfg.dash_length, cfg.dash_length + cfg.gap, self.steps[-1]
        for _ in range(cfg.max_tries):
            self.truncate(0)
            c = rnd.choice(free)
            states = [(float(c % W), float(c // W), 0.0)]  # (x, y, heading) before dash k; markers centred on pixels
            if start_marker:
                marker = [c + o for o in disc]
                if not self.fits(marker, self.limit(0)):
                    continue
                self.put(marker, 0)
            budget = 3 * n
            while 0 < len(states) <= n and budget > 0:
                budget -= 1
                k = len(states) - 1
                x, y, heading = states[k]
                order = ORDERS[int(rnd.random() * len(ORDERS))] if k else None
                lim = self.limit(k)
                with_marker = end_marker and k == n - 1
                for i in range(NUM_TURNS):
                    a = heading + turns[order[i]] if k else rnd.uniform(0.0, 2 * math.pi)
                    ux, uy = math.cos(a), math.sin(a)
                    if grid[int(y + last * uy + 0.5) * W + int(x + last * ux + 0.5)] <= lim:
                        continue  # the cheap test first: the dash's last sample hits something
                    pix = self.dash(x, y, ux, uy)
                    if with_marker:
                        centre = int(y + length * uy + 0.5) * W + int(x + length * ux + 0.5)
                        pix.update(centre + o for o in disc)
                    if self.fits(pix, lim):
                        self.put(pix, k)
                        states.append((x + step * ux, y + step * uy, a))
                        break
                else:
                    back = 1 + (rnd.random() < 0.5)
                    if k - back < 1:
                        break
                    del states[k - back + 1:]
                    self.truncate(k - back)
            if len(states) == n + 1:
                self.commit()
                return True
        self.truncate(0)
        return False
