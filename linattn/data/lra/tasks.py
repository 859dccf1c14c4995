"""The LRA task registry: ``get_task(name, data_dir, split)`` and each task's fixed facts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from . import image, listops, pathfinder, text
from .dataset import LRADataset
from .files import check_split
from .spt import MASK_RATIOS
from .vocab import BYTE_VOCAB, LISTOPS_VOCAB, PIXEL_VOCAB, Vocab


@dataclass(frozen=True)
class LRATask:
    """One LRA task: sizes for building a model, the SPT mask ratio, and its loader."""

    name: str
    vocab: Vocab
    num_classes: int
    max_len: int
    mask_ratio: float
    pair: bool
    load: Callable[..., LRADataset]


TASKS: dict[str, LRATask] = {
    "listops": LRATask("listops", LISTOPS_VOCAB, listops.NUM_CLASSES, 2000, MASK_RATIOS["listops"], False,
                       listops.load_listops),
    "text": LRATask("text", BYTE_VOCAB, text.NUM_CLASSES, 4096, MASK_RATIOS["text"], False, text.load_text),
    "retrieval": LRATask("retrieval", BYTE_VOCAB, text.NUM_CLASSES, 4000, MASK_RATIOS["retrieval"], True,
                         text.load_retrieval),
    "image": LRATask("image", PIXEL_VOCAB, image.NUM_CLASSES, 1024, MASK_RATIOS["image"], False, image.load_image),
    "pathfinder32": LRATask("pathfinder32", PIXEL_VOCAB, pathfinder.NUM_CLASSES, 1024, MASK_RATIOS["pathfinder32"],
                            False, partial(pathfinder.load_pathfinder, size=32)),
    "pathx": LRATask("pathx", PIXEL_VOCAB, pathfinder.NUM_CLASSES, 16384, MASK_RATIOS["pathx"], False,
                     partial(pathfinder.load_pathfinder, size=128)),
}


def list_lra_tasks() -> list[str]:
    """Names accepted by :func:`get_task`."""
    return list(TASKS)


def task_info(name: str) -> LRATask:
    """The facts of task ``name``."""
    if name not in TASKS:
        raise ValueError(f"name must be one of {', '.join(TASKS)}; got {name!r}")
    return TASKS[name]


def get_task(name: str, data_dir: str | Path, split: str = "train", **options: object) -> LRADataset:
    """Split ``split`` (train / val / test) of LRA task ``name`` read from ``data_dir``.

    ``options`` go to the loader: ``max_len`` (listops, text, retrieval), ``difficulty`` (pathfinder32,
    pathx: curv_baseline, curv_contour_length_9, curv_contour_length_14 (default); ``cache``, default true:
    decode the images once into ``tokens-cache/``). A missing data set
    raises FileNotFoundError saying which files to put where."""
    task = task_info(name)
    if not isinstance(data_dir, (str, Path)):
        raise TypeError(f"data_dir must be a str or pathlib.Path, got {type(data_dir).__name__}")
    return task.load(data_dir, check_split(split), **options)
