"""Atomic checkpoints with everything exact resume needs, and clear errors for bad files.

A checkpoint is one ``torch.save`` file holding ``model``, ``optimizer``, ``scheduler``, ``rng``
(torch CPU/CUDA, Python ``random``, NumPy), ``step``, ``data_position`` and the trainer's bookkeeping.
It is written to a temporary file in the same folder, flushed to disk and renamed over the old one, so
a crash (even kill -9) leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format_version", "model", "optimizer", "scheduler", "rng", "step", "data_position")


class CheckpointError(RuntimeError):
    """A checkpoint file is unreadable, truncated, or does not match the run."""


def rng_state() -> dict:
    """The state of every random generator a training step may use."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Write ``payload`` (plus the format version) to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save({"format_version": FORMAT_VERSION, **payload}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint`; CheckpointError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for a damaged zip/pickle
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: {exc}); "
                              f"delete it to start the run over") from exc
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(ckpt).__name__}, expected a dict")
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}; it was not written by linattn's Trainer")
    if ckpt["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {ckpt['format_version']}, expected {FORMAT_VERSION}")
    return ckpt
