"""Pathfinder generator (Linsley et al. 2018; LRA's Pathfinder and Path-X), written from the task's
description: two dashed curves of ``contour_length`` dashes, two round markers, short dashed
distractor curves. Positive (label 1): both markers sit on the two ends of one curve. Negative
(label 0): one marker on an end of each curve. Curves bend by at most ``max_turn`` degrees per dash.

Curves are grown dash by dash with rejection: every pixel of a curve (markers included) stays more
than ``link`` pixels (Chebyshev) away from every other curve, and a curve never comes back within
``link`` of its own earlier dashes, where ``link = floor(gap + 1/4) + 1`` is the largest pixel step across
the gap between two consecutive dashes. So two marked pixels are connected in the image, linking
lit pixels at most ``link`` apart, exactly when they are on one curve: the label can be read off the
drawn image (the tests do so).

``write_pathfinder`` writes the release layout: ``<root>/pathfinder<size>/<difficulty>/imgs/<b>/
sample_<i>.png`` and ``metadata/<b>.npy``, a text file with one line per image: ``imgs/<b> sample_<i>.png
<i> <label> <max_turn> <contour_length> <distractor_length> <dash_length> <thickness> <gap> 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from linattn.data.base import check_float, check_int

from .png import write_png

DIFFICULTIES = {"curv_baseline": 6, "curv_contour_length_9": 9, "curv_contour_length_14": 14}
INK = 255
SAMPLE_STEP = 0.25  # pixels between the points sampled along a dash


@dataclass(frozen=True)
class PathfinderConfig:
    """Drawing parameters (pixels). ``pathfinder_config(size, difficulty)`` gives the presets."""

    size: int = 32
    contour_length: int = 14
    dash_length: float = 2.0
    gap: float = 1.0
    thickness: int = 1
    marker_radius: float = 1.5
    max_turn: float = 30.0
    distractor_length: int = 4
    num_distractors: int = 5
    border: int = 1
    max_tries: int = 200

    def __post_init__(self) -> None:
        check_int("size", self.size, 8)
        check_int("contour_length", self.contour_length, 1)
        check_float("dash_length", self.dash_length, 1.0, self.size)
        check_float("gap", self.gap, 0.5, self.size)
        check_int("thickness", self.thickness, 1, 2)
        check_float("marker_radius", self.marker_radius, 1.0, self.size / 4)
        check_float("max_turn", self.max_turn, 0.0, 90.0)
        check_int("distractor_length", self.distractor_length, 1)
        check_int("num_distractors", self.num_distractors, 0)
        check_int("border", self.border, 0, self.size // 4)
        check_int("max_tries", self.max_tries, 1)

    @property
    def link(self) -> int:
        """The largest Chebyshev step between lit pixels of consecutive dashes of one curve."""
        return int(math.floor(self.gap + SAMPLE_STEP)) + 1

    @property
    def exempt(self) -> int:
        """A dash may come within ``link`` of its own curve's last ``exempt - 1`` dashes only."""
        return 1 + math.ceil((self.link + 2 + self.marker_radius) / (self.dash_length + self.gap))


def pathfinder_config(size: int = 32, difficulty: str = "curv_contour_length_14", **overrides: object
                      ) -> PathfinderConfig:
    """Presets after LRA's generator settings: 32 px (dash 2, gap 1, marker radius 1.5, 20 distractor
    dashes) and 128 px, Path-X (dash 6, gap 3, thickness 2, marker radius 3, 35 distractor dashes);
    the difficulty sets the contour length (6, 9, 14 dashes), distractors have a third of it."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {', '.join(DIFFICULTIES)}; got {difficulty!r}")
    n = DIFFICULTIES[difficulty]
    dl = max(1, n // 3)
    if size == 32:
        cfg = PathfinderConfig(32, n, 2.0, 1.0, 1, 1.5, 30.0, dl, 20 // dl)
    elif size == 128:
        cfg = PathfinderConfig(128, n, 6.0, 3.0, 2, 3.0, 30.0, dl, 35 // dl, border=2)
    else:
        raise ValueError(f"size must be 32 (Pathfinder) or 128 (Path-X), got {size!r}")
    return replace(cfg, **overrides)


class _Canvas:
    """The curves drawn so far (``owner[y, x]`` = curve id, -1 empty) and the curve being grown: its
    lit pixels per dash (a start marker belongs to dash 0, an end marker to the last dash) and, per
    pixel, the first of its dashes that lit it (``first``, padded by ``link``; ``NONE`` if unlit)."""

    NONE = 1 << 30

    def __init__(self, cfg: PathfinderConfig) -> None:
        self.cfg = cfg
        self.owner = np.full((cfg.size, cfg.size), -1, np.int32)
        self.first = np.full((cfg.size + 2 * cfg.link,) * 2, self.NONE, np.int32)
        self.curve, self.dashes, self.blocked = -1, [], np.zeros_like(self.owner, dtype=bool)
        r = np.arange(-cfg.link, cfg.link + 1)
        self._dy, self._dx = (o.reshape(-1) for o in np.meshgrid(r, r, indexing="ij"))

    def begin(self, curve: int) -> None:
        """Start growing ``curve``: block every pixel within ``link`` of the other curves."""
        cfg, pad = self.cfg, self.cfg.link
        lit = np.pad(self.owner >= 0, pad)
        S = cfg.size
        self.blocked = np.zeros((S, S), dtype=bool)
        for dy in range(2 * pad + 1):
            for dx in range(2 * pad + 1):
                self.blocked |= lit[dy: dy + S, dx: dx + S]
        lo, hi = cfg.border, S - cfg.border
        edge = np.ones((S, S), dtype=bool)
        edge[lo:hi, lo:hi] = False
        self.blocked |= edge
        self.curve, self.dashes = curve, []
        self.first[:] = self.NONE

    def fits(self, pix: np.ndarray, k: int) -> np.ndarray:
        """For each candidate ``pix[c]`` ``[n, 2]`` (x, y) of ``pix`` ``[C, n, 2]``: can it join dash ``k``
        of the current curve? (inside the border, away from other curves and from own old dashes)"""
        S, L = self.cfg.size, self.cfg.link
        inside = ((pix >= 0) & (pix < S)).all(-1)
        xy = np.clip(pix, 0, S - 1)
        ok = inside.all(-1) & ~self.blocked[xy[..., 1], xy[..., 0]].any(-1)
        if k >= self.cfg.exempt and ok.any():
            cand = xy[ok]
            window = self.first[cand[:, :, 1, None] + L + self._dy, cand[:, :, 0, None] + L + self._dx]
            ok[np.flatnonzero(ok)] = ~(window <= k - self.cfg.exempt).any((1, 2))
        return ok

    def put(self, pix: np.ndarray, k: int) -> None:
        """Add ``pix`` to dash ``k`` (the next dash, or the last one)."""
        if k == len(self.dashes):
            self.dashes.append(pix)
        else:
            self.dashes[k] = np.concatenate([self.dashes[k], pix])
        ys, xs = pix[:, 1] + self.cfg.link, pix[:, 0] + self.cfg.link
        self.first[ys, xs] = np.minimum(self.first[ys, xs], k)

    def truncate(self, k: int) -> None:
        """Drop dashes k, k+1, ... of the current curve."""
        del self.dashes[k:]
        self.first[self.first >= k] = self.NONE

    def commit(self) -> None:
        """Draw the current curve."""
        pix = np.concatenate(self.dashes)
        self.owner[pix[:, 1], pix[:, 0]] = self.curve
        self.curve, self.dashes = -1, []
        self.first[:] = self.NONE

    def image(self) -> np.ndarray:
        return np.where(self.owner >= 0, INK, 0).astype(np.uint8)


def _dashes(a: np.ndarray, angles: np.ndarray, length: float, thickness: int) -> np.ndarray:
    """Lit pixels ``[C, n, 2]`` (x, y) of the dashes [a, a + length u_c) for the headings ``angles``,
    sampled every <= 1/4 px and drawn with a ``thickness`` square brush (repeated pixels are harmless)."""
    n = int(math.ceil(length / SAMPLE_STEP))
    u = np.stack([np.cos(angles), np.sin(angles)], -1)
    pts = a + (np.arange(n) * (length / n))[None, :, None] * u[:, None, :]
    pix = np.floor(pts + 0.5).astype(np.int64)
    if thickness == 2:
        pix = np.concatenate([pix + np.array(o) for o in ((0, 0), (1, 0), (0, 1), (1, 1))], axis=1)
    return pix


def _disc(r: float) -> np.ndarray:
    """Offsets (x, y) of the pixels whose centres lie within ``r`` of a pixel centre."""
    R = int(math.ceil(r))
    g = np.stack(np.meshgrid(np.arange(-R, R + 1), np.arange(-R, R + 1), indexing="xy"), -1).reshape(-1, 2)
    return g[(g ** 2).sum(1) <= r * r]


def _grow(canvas: _Canvas, curve: int, n: int, rng: np.random.Generator, start_marker: bool = False,
          end_marker: bool = False) -> bool:
    """Draw a curve of ``n`` dashes, with markers at its start / end if asked; False if it does not fit.

    From a random free start, dash by dash: a dash turns by at most ``max_turn`` (7 evenly spread
    turns, the first that fits in a random order is taken); when none fits the curve backs up one or
    two dashes; after ``3 n`` rounds it starts afresh elsewhere (``max_tries`` times)."""
    cfg = canvas.cfg
    canvas.begin(curve)
    free = np.flatnonzero(~canvas.blocked)
    if free.size == 0:
        return False
    turns = np.linspace(-1.0, 1.0, 7) * math.radians(cfg.max_turn)
    disc = _disc(cfg.marker_radius)
    for _ in range(cfg.max_tries):
        canvas.truncate(0)
        y, x = divmod(int(rng.choice(free)), cfg.size)
        start = np.array([x, y], dtype=np.float64)  # markers centred on pixels
        states = [(start, rng.uniform(0, 2 * math.pi))]  # (position, heading) before dash k
        if start_marker:
            if not canvas.fits((disc + [x, y])[None], 0)[0]:
                continue
            canvas.put(disc + [x, y], 0)
        budget = 3 * n
        while 0 < len(states) <= n and budget > 0:
            budget -= 1
            k = len(states) - 1
            pos, heading = states[k]
            angles = heading + rng.permutation(turns) if k else rng.uniform(0, 2 * math.pi, len(turns))
            pix = _dashes(pos, angles, cfg.dash_length, cfg.thickness)
            ends = pos + cfg.dash_length * np.stack([np.cos(angles), np.sin(angles)], -1)
            if end_marker and k == n - 1:
                marks = np.floor(ends + 0.5).astype(np.int64)[:, None, :] + disc[None]
                pix = np.concatenate([pix, marks], axis=1)
            ok = np.flatnonzero(canvas.fits(pix, k))
            if ok.size:
                c = ok[0]
                canvas.put(pix[c], k)
                u = (ends[c] - pos) / cfg.dash_length
                states.append((ends[c] + cfg.gap * u, angles[c]))
            else:
                back = int(rng.integers(1, 3))
                if k - back < 1:
                    break
                del states[k - back + 1:]
                canvas.truncate(k - back)
        if len(states) == n + 1:
            canvas.commit()
            return True
    canvas.truncate(0)
    return False


def draw_pathfinder(cfg: PathfinderConfig, label: int, rng: np.random.Generator) -> np.ndarray:
    """One image ``[size, size]`` uint8 of class ``label`` (1: the markers are connected)."""
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label!r}")
    for _ in range(cfg.max_tries):
        canvas = _Canvas(cfg)
        if not _grow(canvas, 0, cfg.contour_length, rng, start_marker=True, end_marker=label == 1):
            continue
        if not _grow(canvas, 1, cfg.contour_length, rng, start_marker=label == 0):
            continue
        for j in range(cfg.num_distractors):
            _grow(canvas, 2 + j, cfg.distractor_length, rng)
        return canvas.image()
    raise RuntimeError(f"could not place two curves of {cfg.contour_length} dashes in {cfg.max_tries} tries at "
                       f"size {cfg.size}; shorten the curves or the dashes")


def write_pathfinder(root: str | Path, cfg: PathfinderConfig | None = None,
                     difficulty: str = "curv_contour_length_14", num_batches: int = 1, batch_size: int = 100,
                     seed: int = 0, first_batch: int = 0) -> Path:
    """Generate batches ``first_batch .. first_batch + num_batches - 1`` of ``batch_size`` images each (half
    of each label, shuffled) into ``<root>/pathfinder<size>/<difficulty>/``; return that folder. Batch ``b``
    depends only on (``seed``, ``b``), so batches can be made in parallel. ``cfg`` defaults to the preset."""
    cfg = pathfinder_config(32, difficulty) if cfg is None else cfg
    check_int("num_batches", num_batches, 1)
    check_int("batch_size", batch_size, 1)
    check_int("seed", seed, 0)
    check_int("first_batch", first_batch, 0)
    out = Path(root) / f"pathfinder{cfg.size}" / difficulty
    (out / "metadata").mkdir(parents=True, exist_ok=True)
    for b in range(first_batch, first_batch + num_batches):
        rng = np.random.default_rng([seed, b])
        (out / "imgs" / str(b)).mkdir(parents=True, exist_ok=True)
        labels = rng.permutation(np.arange(batch_size) % 2)
        lines = []
        for i, label in enumerate(labels):
            write_png(out / "imgs" / str(b) / f"sample_{i}.png", draw_pathfinder(cfg, int(label), rng))
            lines.append(f"imgs/{b} sample_{i}.png {i} {label} {cfg.max_turn:g} {cfg.contour_length} "
                         f"{cfg.distractor_length} {cfg.dash_length:g} {cfg.thickness} {cfg.gap:g} 1\n")
        (out / "metadata" / f"{b}.npy").write_text("".join(lines))
    return out
