"""Locating and checking LRA files: a missing data set raises an error that says which files to put where; a
bad label or an empty file raises a DataError naming the file (and the line)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from linattn.errors import DataError, MissingFileError
from linattn.validation import is_number

SPLITS = ("train", "val", "test")
RELEASE = "https://github.com/google-research/long-range-arena (lra_release.gz)"


def check_split(split: object) -> str:
    """``split`` must be one of train, val, test."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(repr(s) for s in SPLITS)}; got {split!r}")
    return str(split)


def require(task: str, paths: Sequence[Path], hint: str) -> None:
    """Raise MissingFileError (a FileNotFoundError) listing every missing path of ``task`` and how to get
    them (``hint``)."""
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise MissingFileError(
            f"LRA task {task!r}: data set not found. Missing: {', '.join(missing)}. {hint}"
        )


def parse_label(text: str, num_classes: int, where: str) -> int:
    """Label ``text`` of a data file as an int in [0, num_classes); "1.0" is read as 1 (the AAN release
    writes some labels so). DataError naming ``where`` (file, line) otherwise."""
    value = float(text) if is_number(text) else float("nan")
    if not (value.is_integer() and 0 <= value < num_classes):
        raise DataError(f"{where}: label must be an integer in [0, {num_classes}) (the task's classes), got {text!r}")
    return int(value)


def check_labels(labels: np.ndarray, num_classes: int, source: Path) -> np.ndarray:
    """Labels read from binary file ``source`` must lie in [0, num_classes); DataError naming the first bad one."""
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        i = int(bad[0])
        raise DataError(f"{source}: label must be an integer in [0, {num_classes}) (the task's classes), got "
                        f"{labels[i]} at item {i} ({bad.size} such labels)")
    return labels


def check_not_empty(count: int, source: str | Path, what: str = "examples") -> None:
    """A data file (or split) with no ``what`` is refused, naming it: an empty data set would only fail later,
    far from its cause (a batch of nothing, a mean over nothing)."""
    if count == 0:
        raise DataError(f"{source}: no {what}; an empty data set cannot be trained or evaluated on")
