"""Run kinds: what a run config is (its ``kind``), how it is checked and how it trains.

Every run config names its kind (``kind:``, default ``synthetic``); the study runner and ``linattn train``
both go through :func:`train_run`, so ``linattn train <study>/runs/<run_id>/config.yaml`` reruns any run of
any study the way the study ran it.

- ``synthetic``: a CausalLM on a synthetic task (:func:`linattn.train.build.train_from_config`).
- ``lra``: optional self-pretraining, then a classifier fine-tuned on a Long Range Arena task
  (:func:`linattn.experiments.lra_run.train_lra_from_config`).
- ``lm``: a CausalLM on a corpus of text files, scored in bits per byte
  (:func:`linattn.experiments.lm_run.train_lm_from_config`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from linattn.config_files import read_yaml
from linattn.errors import ConfigError, located
from linattn.experiments.lm_run import check_lm_config, train_lm_from_config
from linattn.experiments.lra_run import check_lra_config, train_lra_from_config
from linattn.train.build import SYNTHETIC, check_run_config, train_from_config
from linattn.train.distributed import process_group_scope
from linattn.train.trainer import TrainResult
from linattn.validation import check_device


@dataclass(frozen=True)
class RunKind:
    """A kind of run: ``check(config)`` returns the normalised config (ConfigError naming a bad field);
    ``train(config, out_dir, device=, progress=, deadline=, override_config=)`` trains it (resuming) and
    writes ``config.yaml`` and ``result.json`` (with ``num_params``) into ``out_dir``."""

    name: str
    check: Callable[[dict], dict]
    train: Callable[..., TrainResult]


RUN_KINDS: dict[str, RunKind] = {
    SYNTHETIC: RunKind(SYNTHETIC, check_run_config, train_from_config),
    "lra": RunKind("lra", check_lra_config, train_lra_from_config),
    "lm": RunKind("lm", check_lm_config, train_lm_from_config),
}


def run_kind(config: dict) -> RunKind:
    """The kind of run ``config`` (``kind``, default synthetic); ConfigError for an unknown one."""
    name = config.get("kind", SYNTHETIC) if isinstance(config, dict) else SYNTHETIC
    if name not in RUN_KINDS:
        raise ConfigError(f"must be one of {sorted(RUN_KINDS)}, got {name!r}", field="kind")
    return RUN_KINDS[name]


def check_config(config: dict) -> dict:
    """The normalised copy of run ``config`` by the checks of its kind."""
    return run_kind(config).check(config)


def train_run(config: dict, out_dir: str | Path | None = None, *, device: str | None = None,
              progress: bool | None = None, deadline: float | None = None,
              override_config: bool = False) -> TrainResult:
    """Train run ``config`` of any kind in ``out_dir`` (default: the config's ``out_dir``), resuming it."""
    return run_kind(config).train(config, out_dir, device=device, progress=progress, deadline=deadline,
                                  override_config=override_config)


def cli_train(path: str | Path, device: str | None = None, out_dir: str | Path | None = None,
              override_config: bool = False) -> int:
    """``linattn train CONFIG.yaml [--device D] [--out DIR] [--override-config]``: one run of any kind (a
    study's ``runs/<run_id>/config.yaml`` included); under torchrun it trains data-parallel. Prints the final
    metrics as JSON; returns the exit code. Errors in the config name the file and the field."""
    if device is not None:
        check_device("--device", device)
    with process_group_scope():  # under torchrun: the group the Trainer starts ends with the command
        with located(source=path):
            config = read_yaml(path, "run config")
            result = train_run(config, out_dir, device=device, override_config=override_config)
        main_rank = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if main_rank:
        print(json.dumps({"status": result.status, "step": result.step, **result.metrics}))
    return 0
