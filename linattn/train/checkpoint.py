"""Atomic, checksummed checkpoints with everything exact resume needs, and clear errors for bad files.

A checkpoint's payload is one ``torch.save`` of a dict holding ``model``, ``optimizer``, ``scheduler``,
``rng`` (torch CPU/CUDA, Python ``random``, NumPy), ``step``, ``data_position``, the config the run was
written with and the trainer's bookkeeping. The file is one header line, then the payload bytes::

    linattn-checkpoint 2 sha256=<64 hex digits> bytes=<payload size>\n<payload>

so a flipped or missing byte anywhere is caught on load (CheckpointError naming the file) instead of
resuming from silently wrong weights or optimizer moments. It is written to a temporary file in the same
folder, flushed to disk and renamed over the old one, so a crash (even kill -9) leaves either the old or
the new checkpoint, never half of one.

Format 1 (before checksums: a bare ``torch.save`` zip) is still read, with a :class:`UncheckedCheckpointWarning`:
it cannot be verified, and the next save rewrites it in format 2.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from linattn.errors import CheckpointError

FORMAT_VERSION = 2
REQUIRED_KEYS = ("format_version", "model", "optimizer", "scheduler", "rng", "step", "data_position")
MAGIC = b"linattn-checkpoint "
_HEADER = re.compile(rb"linattn-checkpoint (\d+) sha256=([0-9a-f]{64}) bytes=(\d+)\n")
_HEADER_MAX = 160  # bytes; the header line is ~110
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip container: a format-1 checkpoint

__all__ = ["CheckpointError", "UncheckedCheckpointWarning", "load_checkpoint", "save_checkpoint", "rng_state",
           "set_rng_state"]


class UncheckedCheckpointWarning(UserWarning):
    """A checkpoint written before checksums (format 1) was loaded without verification."""


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
    """Write ``payload`` (plus the format version) to ``path`` atomically, behind a checksummed header."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({**payload, "format_version": FORMAT_VERSION}, buffer)
    data = buffer.getbuffer()
    header = MAGIC + f"{FORMAT_VERSION} sha256={hashlib.sha256(data).hexdigest()} bytes={len(data)}\n".encode()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _verified_payload(path: Path, raw: bytes) -> bytes:
    """The payload of file content ``raw`` after checking its header, size and sha256."""
    match = _HEADER.match(raw[:_HEADER_MAX])
    if match is None:
        raise CheckpointError(f"checkpoint {path} has a damaged header (expected 'linattn-checkpoint <version> "
                              f"sha256=<hex> bytes=<n>'); delete it to start the run over")
    version, digest, size = int(match[1]), match[2].decode(), int(match[3])
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {version}, expected {FORMAT_VERSION}")
    data = raw[match.end():]
    if len(data) != size:
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated: its header says {size} payload bytes, "
                              f"the file holds {len(data)}; delete it to start the run over")
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise CheckpointError(f"checkpoint {path} is corrupt: sha256 of its payload is {actual[:16]}..., its header "
                              f"says {digest[:16]}...; delete it to start the run over")
    return data


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint`, verifying its checksum; CheckpointError
    naming the file otherwise. A format-1 file (no checksum) loads with an UncheckedCheckpointWarning."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    raw = path.read_bytes()
    if raw.startswith(MAGIC):
        data = _verified_payload(path, raw)
    elif raw.startswith(_ZIP_MAGIC):
        warnings.warn(f"checkpoint {path} was written before checkpoints carried a checksum (format 1); it is "
                      f"loaded unverified and rewritten with a checksum at the next save",
                      UncheckedCheckpointWarning, stacklevel=2)
        data = raw
    else:
        raise CheckpointError(f"checkpoint {path} is not a linattn checkpoint (no 'linattn-checkpoint' header); "
                              f"delete it to start the run over")
    try:
        ckpt = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for a damaged zip/pickle
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: {exc}); "
                              f"delete it to start the run over") from exc
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(ckpt).__name__}, expected a dict")
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}; it was not written by linattn's Trainer")
    if ckpt["format_version"] not in (1, FORMAT_VERSION):
        raise CheckpointError(f"checkpoint {path} has format {ckpt['format_version']}, expected {FORMAT_VERSION}")
    return ckpt
