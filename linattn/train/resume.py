"""Resume rules: a checkpoint is resumed only under the config it was written with.

The Trainer stores its :class:`TrainConfig` (``config``) and, when given, the whole run config
(``run_config``: task, model, seed, ...) in every checkpoint. On resume the two are compared with the
current ones; any difference raises :class:`ResumeError` listing each changed field (old -> new), unless the
caller passes ``override_config`` (``linattn train --override-config``): then the new values win and each
change is reported. Fields that do not change what is computed may differ freely
(:data:`linattn.train.config.RESUME_FREE_FIELDS`: device, progress bar, TensorBoard; and the run's
``out_dir``, which moves with the folder).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from linattn.errors import ResumeError
from linattn.train.config import RESUME_FREE_FIELDS, TrainConfig

Change = tuple[str, object, object]
_MISSING = "<absent>"
# run-config keys compared elsewhere ("train": through the TrainConfig) or free to differ ("out_dir")
_RUN_KEYS_SKIPPED = ("train", "out_dir")


def _plain(value: object) -> object:
    """Tuples as lists, so (0.9, 0.98) read back from YAML as [0.9, 0.98] compares equal."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def config_changes(old: Mapping, new: Mapping, prefix: str = "", skip: tuple[str, ...] = ()) -> list[Change]:
    """``(dotted field, old value, new value)`` for every leaf that differs between two nested mappings
    (keys in ``skip`` ignored at the top level); a key present on one side only counts as a change."""
    changes: list[Change] = []
    for key in sorted(set(old) | set(new), key=str):
        if key in skip:
            continue
        name = f"{prefix}{key}"
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changes += config_changes(a, b, f"{name}.")
        elif _plain(a) != _plain(b):
            changes.append((name, a, b))
    return changes


def format_changes(changes: list[Change]) -> str:
    """``train.lr: 0.001 -> 0.5; model.d_model: 32 -> 64``."""
    return "; ".join(f"{name}: {old!r} -> {new!r}" for name, old, new in changes)


def resume_changes(ckpt: Mapping, train: Mapping, run: Mapping | None) -> list[Change]:
    """What differs between the configs saved in checkpoint ``ckpt`` and the current ``train`` (a
    TrainConfig dict) and ``run`` (the run config, or None when the caller has none)."""
    # a field added to TrainConfig after the checkpoint was written ran at its default, which keeps the old behaviour
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    saved_train = {**defaults, **ckpt["config"]} if ckpt.get("config") else {}
    changes = config_changes(saved_train, train, "train.", skip=RESUME_FREE_FIELDS)
    saved_run = ckpt.get("run_config")
    if saved_run is not None and run is not None:
        changes = config_changes(saved_run, run, skip=_RUN_KEYS_SKIPPED) + changes
    return changes


def refuse_changes(path: Path, changes: list[Change]) -> None:
    """Raise the ResumeError for a checkpoint ``path`` written under another config."""
    raise ResumeError(f"checkpoint {path} was written with a different config ({format_changes(changes)}); "
                      f"resume with the config it was written with, pass --override-config (linattn train) / "
                      f"override_config=True (Trainer) to continue under the new values, or use a new output folder")
