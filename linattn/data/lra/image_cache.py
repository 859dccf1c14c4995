"""Decoded pixel tokens of an image split, decoded once and memory-mapped after.

Decoding a Pathfinder PNG costs about 0.2 ms: at batch 128 that is 27 ms of host time a step, longer than the
step itself on a GPU, and paid again every epoch by every run of a study. :func:`cached_tokens` decodes a split
once into ``<folder>/tokens-cache/<split>-<key>.npy`` (int16 ``[N, pixels]``) and memory-maps that file from then
on, so parallel runs share one copy in the page cache.

The key hashes the split's image list (paths relative to ``folder``, labels) and the pixel count: a regenerated
data set writes new metadata and gets a new file. Images rewritten in place under unchanged metadata are not
detected; delete ``tokens-cache/`` then. Processes that start together take a lock file, so one decodes and the
others read its result. A folder that cannot be written (a read-only release copy) gets the decoded array
without a file.
"""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from pathlib import Path

import numpy as np

CACHE_DIR = "tokens-cache"
PARALLEL_FROM = 20_000  # images: below this one process decodes (starting workers costs more)
CHUNK = 2_000  # images per worker task


def cache_key(folder: Path, items: Sequence[tuple[Path, int]], pixels: int) -> str:
    """A short hash of the split's images (paths relative to ``folder``) and labels and the pixel count."""
    h = hashlib.sha256(f"{pixels}\n".encode())
    for path, label in items:
        h.update(f"{os.path.relpath(path, folder)} {label}\n".encode())
    return h.hexdigest()[:16]


def _decode_all(decode: Callable[[Path], np.ndarray], paths: Sequence[Path], pixels: int) -> np.ndarray:
    out = np.empty((len(paths), pixels), dtype=np.int16)
    for i, p in enumerate(paths):
        out[i] = decode(p)
    return out


def decode_tokens(decode: Callable[[Path], np.ndarray], paths: Sequence[Path], pixels: int,
                  workers: int | None = None) -> np.ndarray:
    """``decode(path)`` (a picklable function giving ``pixels`` token ids) of every path, int16
    ``[len(paths), pixels]``; large lists in parallel over ``workers`` processes (default: the CPU count)."""
    workers = workers or os.cpu_count() or 1
    if len(paths) < PARALLEL_FROM or workers == 1:
        return _decode_all(decode, paths, pixels)
    chunks = [list(paths[i:i + CHUNK]) for i in range(0, len(paths), CHUNK)]
    # spawn: the caller may already hold CUDA, which a forked child must not inherit
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return np.concatenate(list(pool.map(_decode_all, repeat(decode), chunks, repeat(pixels))))


def cached_tokens(folder: Path, split: str, items: Sequence[tuple[Path, int]], pixels: int,
                  decode: Callable[[Path], np.ndarray]) -> np.ndarray:
    """The token ids of the images ``items`` ((path, label) pairs) of ``split``, int16 ``[N, pixels]``:
    memory-mapped from the cache file, decoded and written there first when it is missing (module docstring)."""
    target = folder / CACHE_DIR / f"{split}-{cache_key(folder, items, pixels)}.npy"
    if target.is_file():
        return np.load(target, mmap_mode="r")
    paths = [p for p, _ in items]
    try:
        target.parent.mkdir(exist_ok=True)
        lock = open(target.parent / f".{target.name}.lock", "w")  # noqa: SIM115 (held until written)
    except OSError:  # read-only folder: no cache
        return decode_tokens(decode, paths, pixels)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():  # nobody wrote it while we waited
            tokens = decode_tokens(decode, paths, pixels)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                np.save(f, tokens)
            os.replace(tmp, target)
    return np.load(target, mmap_mode="r")
