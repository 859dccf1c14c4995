"""Pathfinder generator (Linsley et al. 2018; LRA's Pathfinder and Path-X), written from the task's
description: two dashed curves of ``contour_length`` dashes, two round markers, short dashed
distractor curves. Positive (label 1): both markers sit on the two ends of one curve. Negative
(label 0): one marker on an end of each curve. Curves bend by at most ``max_turn`` degrees per dash.

Curves are grown dash by dash with rejection: every pixel of a curve (markers included) stays more
than ``link`` pixels (Chebyshev) away from every other curve, and a curve never comes back within
``link`` of its own earlier dashes, where ``link = floor(gap + 1/4) + 1`` is the largest pixel step across
the gap between two consecutive dashes. So two marked pixels are connected in the image, linking
lit pixels at most ``link`` apart, exactly when they are on one curve: the label can be read off the
drawn image (the tests do so). The drawing core (``Canvas``) is in ``pathfinder_draw``.

``write_pathfinder`` writes the release layout: ``<root>/pathfinder<size>/<difficulty>/imgs/<b>/
sample_<i>.png`` and ``metadata/<b>.npy``, a text file with one line per image: ``imgs/<b> sample_<i>.png
<i> <label> <max_turn> <contour_length> <distractor_length> <dash_length> <thickness> <gap> 1``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from linattn.data.base import check_float, check_int
from linattn.errors import GenerationError

from .pathfinder_draw import SAMPLE_STEP, Canvas
from .png import write_png

DIFFICULTIES = {"curv_baseline": 6, "curv_contour_length_9": 9, "curv_contour_length_14": 14}


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


def draw_pathfinder(cfg: PathfinderConfig, label: int, rng: np.random.Generator) -> np.ndarray:
    """One image ``[size, size]`` uint8 of class ``label`` (1: the markers are connected). Takes one draw from
    ``rng`` (it seeds the scalar generator that does the drawing), so the image is a function of ``rng``'s state."""
    if not isinstance(cfg, PathfinderConfig):
        raise TypeError(f"cfg must be a PathfinderConfig, got {type(cfg).__name__}")
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label!r}")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    rnd = random.Random(int(rng.integers(1 << 63)))
    for _ in range(cfg.max_tries):
        canvas = Canvas(cfg)
        if not canvas.grow(cfg.contour_length, rnd, start_marker=True, end_marker=label == 1):
            continue
        if not canvas.grow(cfg.contour_length, rnd, start_marker=label == 0):
            continue
        for _ in range(cfg.num_distractors):
            canvas.grow(cfg.distractor_length, rnd)
        return canvas.image
    raise GenerationError(f"could not place two curves of {cfg.contour_length} dashes in {cfg.max_tries} tries at "
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
