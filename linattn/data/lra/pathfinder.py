"""Pathfinder / Path-X loader: ``<data_dir>/pathfinder<size>/<difficulty>/`` in the release layout.

Every ``metadata/<batch>.npy`` (a text file despite its name) lists one image a line:
``<folder> <file> <index> <label> ...``; the image is ``<folder>/<file>`` under the difficulty folder.
Batches are read in numeric order; as in LRA the first 80% of the images are train, the next 10%
val, the last 10% test. An image is ``size * size`` pixel tokens, row by row; each split is decoded once into
``tokens-cache/`` beside ``metadata/`` and memory-mapped after (:mod:`.image_cache`; ``cache=False`` decodes on
access instead).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np

from linattn.errors import DataError

from .dataset import LRADataset
from .files import RELEASE, check_not_empty, check_split, parse_label, require
from .image_cache import cached_tokens
from .pathfinder_gen import DIFFICULTIES
from .png import read_png
from .vocab import PIXEL_VOCAB

SPLIT_FRACTIONS = {"train": (0.0, 0.8), "val": (0.8, 0.9), "test": (0.9, 1.0)}
NUM_CLASSES = 2  # 1 = the markers are connected


def _read_grey(path: Path) -> np.ndarray:
    """An 8-bit PNG as greyscale ``[H, W]`` uint8 (Pillow when installed: faster; else our codec)."""
    try:
        from PIL import Image
    except ImportError:
        return read_png(path)
    with Image.open(path) as im:
        return np.asarray(im.convert("L"), dtype=np.uint8)


def pixel_tokens(path: Path, size: int) -> np.ndarray:
    """The pixel tokens of the ``size`` x ``size`` image at ``path``, int16 ``[size * size]``."""
    if not path.is_file():
        raise DataError(f"{path}: image listed in the metadata is missing")
    img = _read_grey(path)
    if img.shape != (size, size):
        raise ValueError(f"{path}: expected a {size}x{size} image, got {list(img.shape)}")
    return PIXEL_VOCAB.encode_values(img.reshape(-1))


class ImageTokens:
    """``ImageTokens(paths, size)(i)``: the pixel tokens of image ``paths[i]`` (a picklable loader, so
    DataLoader workers can be spawned)."""

    def __init__(self, paths: list[Path], size: int) -> None:
        self.paths, self.size = paths, size

    def __call__(self, i: int) -> np.ndarray:
        return pixel_tokens(self.paths[i], self.size)


def read_metadata(folder: Path) -> list[tuple[Path, int]]:
    """(image path, label) of every line of ``folder/metadata/*.npy``, batches in numeric order; DataError
    naming the file and line for a malformed line or a label other than 0/1."""
    def order(p: Path) -> tuple[int, int, str]:
        return (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.stem)

    files = sorted((folder / "metadata").glob("*.npy"), key=order)
    out = []
    for meta in files:
        for n, line in enumerate(meta.read_text().splitlines(), start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 4:
                raise DataError(f"{meta}, line {n}: expected '<folder> <file> <index> <label> ...', got {line!r}")
            out.append((folder / fields[0] / fields[1], parse_label(fields[3], NUM_CLASSES, f"{meta}, line {n}")))
    return out


def load_pathfinder(data_dir: str | Path, split: str = "train", size: int = 32,
                    difficulty: str = "curv_contour_length_14", cache: bool = True) -> LRADataset:
    """Pathfinder (``size`` 32) or Path-X (``size`` 128) at ``difficulty``; 2 classes (1 = connected).
    ``cache``: decode the split once into ``tokens-cache/`` and memory-map it (module docstring)."""
    split = check_split(split)
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {', '.join(DIFFICULTIES)}; got {difficulty!r}")
    folder = Path(data_dir) / f"pathfinder{size}" / difficulty
    require(f"pathfinder{size}", [folder / "metadata"],
            f"Put the release's pathfinder{size}/{difficulty}/{{imgs,metadata}} under {data_dir} (from {RELEASE}) "
            f"or generate them: linattn.data.lra.write_pathfinder({str(data_dir)!r}, "
            f"pathfinder_config({size}, {difficulty!r}), {difficulty!r}).")
    items = read_metadata(folder)
    check_not_empty(len(items), f"{folder / 'metadata'}/*.npy", "image listed")
    lo, hi = SPLIT_FRACTIONS[split]
    listed = len(items)
    items = items[int(round(lo * listed)): int(round(hi * listed))]
    check_not_empty(len(items), f"{folder / 'metadata'}/*.npy",
                    f"image in split {split!r} ({listed} listed; {split} takes {hi - lo:.0%} of them)")
    name = "pathfinder32" if size == 32 else ("pathx" if size == 128 else f"pathfinder{size}")
    labels = [lab for _, lab in items]
    if cache:
        tokens = cached_tokens(folder, split, items, size * size, partial(pixel_tokens, size=size))
        return LRADataset(name, split, PIXEL_VOCAB, NUM_CLASSES, labels, seqs=tokens)
    return LRADataset(name, split, PIXEL_VOCAB, NUM_CLASSES, labels, load=ImageTokens([p for p, _ in items], size))
