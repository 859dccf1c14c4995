"""Build a training run (task, model, data stream, eval set, Trainer) from one plain config dict.

A run config of kind ``synthetic`` (the default; ``linattn train CONFIG.yaml`` reads any kind through
:mod:`linattn.experiments.runs`, which sends this kind here)::

    kind: synthetic    # what the run is: a CausalLM trained on a synthetic task (linattn.data)
    task:  {name: mqar, vocab: 64, seq_len: 64, num_kv_pairs: 8}   # linattn.data.make_task
    model: {mixer: gla, d_model: 64, n_layers: 2, n_heads: 2}      # linattn.models.ModelConfig
    train: {max_steps: 1000, batch_size: 64, lr: 0.001}            # TrainConfig; seed is overridden
    seed: 0            # model init, training stream and TrainConfig.seed
    eval_examples: 512
    eval_seed: 1234    # the held-out set (shared by every run of a study)
    out_dir: runs/train/my_run   # checkpoint.pt, metrics.jsonl, config.yaml, result.json

``model.vocab_size`` defaults to the task's vocabulary.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch
import yaml

from linattn.data import TaskStream, eval_set, make_task
from linattn.errors import ConfigError, located
from linattn.train.config import TrainConfig
from linattn.train.trainer import CHECKPOINT_NAME, Trainer, TrainResult
from linattn.validation import check_device, check_int, check_str

RUN_KEYS = ("kind", "task", "model", "train", "seed", "eval_examples", "eval_seed", "out_dir")
SYNTHETIC = "synthetic"
T = TypeVar("T")


@dataclass
class Run:
    """Everything a run needs, built from its config."""

    trainer: Trainer
    num_params: int


def check_run_config(config: dict) -> dict:
    """A normalised deep copy of ``config``; ConfigError naming an unknown or missing key or a bad value.
    The ``train`` and ``model`` sections are checked field by field (TrainConfig, ModelConfig), so a study
    refuses a bad run before any run starts. ``kind`` (default "synthetic") is only checked to be a str here:
    the run kinds are known to :mod:`linattn.experiments.runs`."""
    if not isinstance(config, dict):
        raise ConfigError(f"a run config must be a mapping, got {type(config).__name__}")
    unknown = sorted(set(config) - set(RUN_KEYS))
    if unknown:
        raise ConfigError(f"unknown run config key(s) {unknown}; expected a subset of {list(RUN_KEYS)}")
    for key in ("task", "model"):
        if not isinstance(config.get(key), dict):
            raise ConfigError(f"run config needs a '{key}' mapping, got {config.get(key)!r}")
    cfg = copy.deepcopy(config)
    cfg.setdefault("kind", SYNTHETIC)
    check_str("kind", cfg["kind"])
    cfg.setdefault("train", {})
    cfg.setdefault("seed", 0)
    cfg.setdefault("eval_examples", 512)
    cfg.setdefault("eval_seed", 1234)
    if "name" not in cfg["task"]:
        raise ConfigError("run config 'task' needs a 'name' (one of linattn.data.list_tasks())")
    from linattn.models import ModelConfig

    check_int("seed", cfg["seed"], 0)
    check_int("eval_examples", cfg["eval_examples"], 1)
    check_int("eval_seed", cfg["eval_seed"], 0)
    if cfg.get("out_dir") is not None:
        check_str("out_dir", cfg["out_dir"])
    with located("train"):
        TrainConfig.from_dict(dict(cfg["train"], seed=cfg["seed"]))
    with located("model"):
        # vocab_size defaults to the task's, known only once the task is built: any valid one checks the rest
        ModelConfig.from_dict({"vocab_size": 1, **cfg["model"]})
    return cfg


def _from_section(section: str, build: Callable[[], T]) -> T:
    """``build()``, with the ValueError/TypeError of argument checks below the config layer (task
    constructors, layer constructors) turned into a ConfigError of config ``section``."""
    try:
        with located(section):
            return build()
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc), field=section) from exc


def build_run(config: dict, out_dir: str | Path | None = None, device: str | None = None,
              progress: bool | None = None, override_config: bool = False) -> Run:
    """The Trainer of run ``config`` (model initialised from ``config['seed']``). ``device`` and
    ``progress`` override the config's; ``override_config``: resume a checkpoint written under another config."""
    from linattn.models import CausalLM, ModelConfig

    cfg = check_run_config(config)
    if cfg["kind"] != SYNTHETIC:
        raise ConfigError(f"build_run builds runs of kind {SYNTHETIC!r}, got {cfg['kind']!r} (run it with "
                          f"linattn.experiments.train_run or `linattn train`)", field="kind")
    if device is not None:
        check_device("--device", device)
    task_params = dict(cfg["task"])
    task = _from_section("task", lambda: make_task(task_params.pop("name"), **task_params))
    with located("model"):
        model_cfg = ModelConfig.from_dict({"vocab_size": task.vocab_size, **cfg["model"]})
    if model_cfg.vocab_size < task.vocab_size:
        raise ConfigError(f"{model_cfg.vocab_size} < the task's vocabulary {task.vocab_size}", field="model.vocab_size")
    train = dict(cfg["train"], seed=cfg["seed"])
    if device is not None:
        train["device"] = device
    if progress is not None:
        train["progress"] = progress
    with located("train"):
        train_cfg = TrainConfig.from_dict(train)
    torch.manual_seed(cfg["seed"])
    model = _from_section("model", lambda: CausalLM(model_cfg))
    stream = TaskStream(task, train_cfg.batch_size, seed=cfg["seed"])
    held_out = eval_set(task, cfg["eval_examples"], cfg["eval_seed"])
    trainer = Trainer(model, stream, train_cfg, eval_data=held_out, out_dir=out_dir, run_config=cfg,
                      override_config=override_config)
    return Run(trainer, sum(p.numel() for p in model.parameters()))


def train_from_config(config: dict, out_dir: str | Path | None = None, device: str | None = None,
                      progress: bool | None = None, deadline: float | None = None,
                      override_config: bool = False) -> TrainResult:
    """Build run ``config``, write its config.yaml into ``out_dir``, train (resuming), write result.json."""
    out = Path(out_dir or config.get("out_dir") or "runs/train")
    run = build_run(config, out, device, progress, override_config)
    out.mkdir(parents=True, exist_ok=True)
    resuming = (out / CHECKPOINT_NAME).exists()
    if not resuming:
        _write_config(run, out, config)
    result = run.trainer.fit(deadline=deadline)
    if resuming:  # rewritten only once the checkpoint's config was accepted (or overridden)
        _write_config(run, out, config)
    if run.trainer.dist.is_main and result.status != "interrupted":
        (out / "result.json").write_text(json.dumps({**asdict(result), "num_params": run.num_params}, indent=2))
    return result


def _write_config(run: Run, out: Path, config: dict) -> None:
    if run.trainer.dist.is_main:
        (out / "config.yaml").write_text(yaml.safe_dump(check_run_config(config), sort_keys=False))
