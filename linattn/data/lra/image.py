"""Image loader: CIFAR-10 (python pickle batches) in greyscale, 1024 pixels read row by row.

Reads ``<data_dir>/cifar-10-batches-py/data_batch_1..5`` and ``test_batch``. As LRA: train is the first
90% of the training images, val the last 10%, test the test batch. Grey levels are those of LRA's
``tf.image.rgb_to_grayscale`` on uint8 images: floor(255.5 (0.2989 R + 0.5870 G + 0.1140 B) / 255),
computed in float32; each grey level 0-255 is a token.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from linattn.errors import DataError

from .dataset import LRADataset
from .files import check_labels, check_not_empty, check_split, require
from .vocab import PIXEL_VOCAB

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
NUM_CLASSES = 10
LUMA = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)


def rgb_to_grey(rows: np.ndarray) -> np.ndarray:
    """CIFAR rows ``[N, 3072]`` (R, G, B planes of 32x32) to grey ``[N, 1024]`` uint8."""
    planes = rows.reshape(-1, 3, 1024).astype(np.float32) / np.float32(255)
    grey = np.einsum("c,ncp->np", LUMA, planes)  # float32 in [0, 1]
    return np.clip(np.floor(grey * np.float32(255.5)), 0, 255).astype(np.uint8)


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Pixels [N, 3072] and labels [N] of one CIFAR-10 python batch; DataError naming the file when it is
    empty, not a pickle, lacks its keys, holds no images or labels outside 0-9."""
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file, expected a CIFAR-10 python batch (a pickled dict); re-extract "
                        f"cifar-10-python.tar.gz")
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
    except Exception as exc:  # pickle raises many types for damaged input
        raise DataError(f"{path}: not a CIFAR-10 python batch, unpickling failed ({type(exc).__name__}: {exc}); "
                        f"re-extract cifar-10-python.tar.gz") from exc
    if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
        keys = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise DataError(f"{path}: a CIFAR-10 python batch is a dict with b'data' and b'labels', got {keys}")
    data, labels = np.asarray(d[b"data"]), np.asarray(d[b"labels"])
    if data.ndim != 2 or data.shape[1] != 3072 or data.dtype != np.uint8:
        raise DataError(f"{path}: data must be [N, 3072] uint8 (CIFAR-10 python format), got "
                        f"{list(data.shape)} {data.dtype}")
    check_not_empty(data.shape[0], path, "images")
    if labels.shape != (data.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{path}: labels must be {data.shape[0]} integers (one per image), got {list(labels.shape)} "
                        f"{labels.dtype}")
    return data, check_labels(labels.astype(np.int64), NUM_CLASSES, path)


def load_image(data_dir: str | Path, split: str = "train") -> LRADataset:
    """Greyscale CIFAR-10 as 1024-token sequences; 10 classes."""
    split = check_split(split)
    folder = Path(data_dir) / "cifar-10-batches-py"
    names = ("test_batch",) if split == "test" else TRAIN_BATCHES
    require("image", [folder / n for n in names], f"Unpack cifar-10-python.tar.gz "
            f"(https://www.cs.toronto.edu/~kriz/cifar.html) so that {folder}/data_batch_1..5 and test_batch exist.")
    parts = [_read_batch(folder / n) for n in names]
    data, labels = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    if split != "test":
        cut = int(round(0.9 * len(labels)))
        data, labels = (data[:cut], labels[:cut]) if split == "train" else (data[cut:], labels[cut:])
    seqs = list(PIXEL_VOCAB.encode_values(rgb_to_grey(data)))
    return LRADataset("image", split, PIXEL_VOCAB, NUM_CLASSES, labels, seqs=seqs)
