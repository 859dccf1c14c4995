"""Locating LRA files: a missing data set raises an error that says which files to put where."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

SPLITS = ("train", "val", "test")
RELEASE = "https://github.com/google-research/long-range-arena (lra_release.gz)"


def check_split(split: object) -> str:
    """``split`` must be one of train, val, test."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(repr(s) for s in SPLITS)}; got {split!r}")
    return str(split)


def require(task: str, paths: Sequence[Path], hint: str) -> None:
    """Raise FileNotFoundError listing every missing path of ``task`` and how to get them (``hint``)."""
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(
            f"LRA task {task!r}: data set not found. Missing: {', '.join(missing)}. {hint}"
        )
