"""One LRA run: optional self-pretraining (SPT) on the task's train split, then fine-tuning a classifier.

A run config of kind ``lra`` (one run of the ``lra`` study; the LRA settings live in ``task`` so the
generic run-config checks of :func:`linattn.train.build.check_run_config` apply unchanged)::

    kind:  lra
    task:  {name: listops, data_dir: null, spt: causal, pretrain_steps: 150, mask_ratio: null,
            max_len: 2000, generate: {num_train: 2000, ...}, bidirectional: false, val_examples: null}
    model: {mixer: gla, d_model: 32, n_layers: 1, n_heads: 2}    # ModelConfig; vocab_size from the task
    train: {max_steps: 300, batch_size: 32, lr: 0.003}            # TrainConfig of the WHOLE run
    seed: 0

Compute matching (Amos et al. 2023): ``train.max_steps`` is the total; SPT pretrains for
``pretrain_steps`` and fine-tunes for ``max_steps - pretrain_steps``; ``spt: none`` fine-tunes for all
``max_steps``. ``spt: causal`` trains a CausalLM on next-token prediction (:class:`CausalLMView`);
``spt: masked`` trains the same CausalLM architecture to restore ``<mask>`` tokens
(:class:`MaskedLMView`, ratio ``mask_ratio`` or the task's default). Its pretrained weights (all but
``lm_head``) initialise a :class:`SequenceClassifier` (mean pooling, same mixer direction) before
fine-tuning. Accuracy is measured on the val split (during training; its first ``val_examples`` when set, since
an evaluation of all 20,000 Pathfinder images took 16.5 s of a run sharing an H100 with five others, 2,000 took
1.8 s) and on the whole test split (at the end).

``bidirectional: true`` (default false) makes the classifier bidirectional (``SequenceClassifier(...,
bidirectional=True)``: each block sums its mixer run left to right and a second mixer run right to left
within each sequence's length), as the paper fine-tunes its Transformers (non-causal attention) after every
SPT mode and from scratch. The pretraining model stays the unidirectional CausalLM; its weights initialise
both directions of each block (``blocks.i.mixer`` -> ``blocks.i.mixer.fwd`` and ``blocks.i.mixer.bwd``,
:func:`linattn.models.transfer_encoder`), so the backward mixer starts as the pretrained left-to-right mixer
read over the reversed sequence; the embedding, norms and MLPs copy as usual and the head starts fresh.
The bidirectional classifier has twice the mixer parameters and about twice the mixer compute per step.

Retrieval (task ``retrieval``, two documents per example): SPT trains on every document of the train split
as its own sequence (2 N sequences; masked ratio 15% by default), and the classifier is the dual encoder
(``SequenceClassifier(..., dual=True)``: one shared encoder, the head reads [e1, e2, e1 * e2, e1 - e2]);
the pretrained weights initialise its shared encoder, its head starts fresh. Pairs travel through the
Trainer as one tensor [B, 2, T] (:func:`linattn.data.lra.inputs_targets`).

``data_dir: null`` (or a folder without the task's files) with ``generate`` set: the run generates
ListOps with ``ListOpsConfig(**generate)`` into ``<study folder>/data`` (shared by the study's runs).
Files: ``<out>/pretrain/`` and ``<out>/finetune/`` (each checkpoint.pt + metrics.jsonl, resumable),
``<out>/config.yaml`` and ``<out>/result.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
import yaml
from torch import nn

from linattn.data.lra import (
    CausalLMView,
    ListOpsConfig,
    LRABatches,
    LRADataset,
    MaskedLMView,
    get_task,
    task_info,
    whole_split,
    write_listops,
)
from linattn.data.lra.vocab import PAD_ID
from linattn.errors import ConfigError, bad_value
from linattn.models import PaddedClassifier, transfer_encoder
from linattn.train.build import check_run_config
from linattn.train.config import TrainConfig
from linattn.train.trainer import Trainer, TrainResult
from linattn.validation import check_bool, check_choice, check_float, check_int, check_str

KIND = "lra"
SPT_MODES = ("none", "causal", "masked")
LRA_TASK_KEYS = ("name", "data_dir", "spt", "pretrain_steps", "mask_ratio", "max_len", "generate", "bidirectional",
                 "val_examples")


def check_lra_config(config: dict) -> dict:
    """A normalised copy of LRA run ``config``; ConfigError naming a bad key or value."""
    cfg = check_run_config(config)
    if cfg["kind"] != KIND:
        raise bad_value("kind", cfg["kind"], repr(KIND))
    t = cfg["task"]
    unknown = sorted(set(t) - set(LRA_TASK_KEYS))
    if unknown:
        raise ConfigError(f"unknown LRA task key(s) {unknown}; expected a subset of {list(LRA_TASK_KEYS)}")
    try:
        task_info(str(t["name"]))
    except ValueError as exc:  # lists the LRA tasks
        raise ConfigError(str(exc), field="task.name") from None
    t.setdefault("data_dir", None)
    t.setdefault("spt", "none")
    t.setdefault("pretrain_steps", 0)
    t.setdefault("mask_ratio", None)
    t.setdefault("generate", None)
    t.setdefault("bidirectional", False)
    check_bool("task.bidirectional", t["bidirectional"])
    check_choice("task.spt", t["spt"], SPT_MODES)
    if t["data_dir"] is not None:
        check_str("task.data_dir", t["data_dir"])
    if t["mask_ratio"] is not None:
        check_float("task.mask_ratio", t["mask_ratio"], 0, 1, low_open=True, high_open=True)
    if t.get("max_len") is not None:
        check_int("task.max_len", t["max_len"], 1)
    t.setdefault("val_examples", None)
    if t["val_examples"] is not None:
        check_int("task.val_examples", t["val_examples"], 1)
    total = cfg["train"].get("max_steps", TrainConfig.max_steps)
    if t["spt"] == "none":
        t["pretrain_steps"] = 0
    else:
        check_int("task.pretrain_steps", t["pretrain_steps"], 1, total - 1)
    if t["generate"] is not None and not isinstance(t["generate"], dict):
        raise bad_value("task.generate", t["generate"], "null or a mapping of ListOpsConfig fields")
    return cfg


# -- data ------------------------------------------------------------------------------------------------
def resolve_data_dir(task: dict, out_dir: Path) -> Path:
    """The folder holding the task's files: ``task.data_dir`` when it has them; otherwise (with
    ``generate``) ListOps generated once into the study folder's ``data/`` (atomically: runs in parallel
    processes race harmlessly, the generator being deterministic)."""
    lra = task["name"]
    given = task["data_dir"]
    if given is not None:
        try:
            get_task(lra, given, "test")
            return Path(given)
        except FileNotFoundError:
            if task["generate"] is None:
                raise
    elif task["generate"] is None:
        raise ConfigError(f"task.data_dir is null and task.generate is not set: nothing to read {lra!r} from")
    if lra != "listops":
        raise ConfigError(f"task.generate only makes ListOps; {lra!r} needs its files in task.data_dir")
    cfg = ListOpsConfig(**task["generate"])
    # run folders are <study>/runs/<run_id>; a lone run generates next to itself
    root = out_dir.parent.parent if out_dir.parent.name == "runs" else out_dir
    target = root / "data"
    if not (target / "listops-1000" / "basic_test.tsv").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".data-", dir=root))
        write_listops(tmp, cfg)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# -- models ----------------------------------------------------------------------------------------------
def build_models(cfg: dict, num_classes: int, vocab_size: int, dual: bool = False
                 ) -> tuple[nn.Module | None, PaddedClassifier]:
    """(the pretraining CausalLM or None for ``spt: none``, the classifier; a dual encoder of document
    pairs if ``dual``; bidirectional blocks if ``task.bidirectional``), initialised from cfg['seed']."""
    from linattn.models import CausalLM, ModelConfig, SequenceClassifier

    model_cfg = ModelConfig.from_dict({"vocab_size": vocab_size, **cfg["model"]})
    torch.manual_seed(cfg["seed"])
    lm = None if cfg["task"]["spt"] == "none" else CausalLM(model_cfg)
    clf = SequenceClassifier(model_cfg, num_classes, pooling="mean",
                             bidirectional=cfg["task"].get("bidirectional", False), dual=dual)
    return lm, PaddedClassifier(clf, PAD_ID)


# -- the run ---------------------------------------------------------------------------------------------
def _train_config(cfg: dict, device: str | None, progress: bool | None, **changes: object) -> TrainConfig:
    train = dict(cfg["train"], seed=cfg["seed"], **changes)
    if device is not None:
        train["device"] = device
    if progress is not None:
        train["progress"] = progress
    return TrainConfig.from_dict(train)


def load_splits(task: dict, root: Path) -> dict[str, LRADataset]:
    """The train, val and test splits of ``task`` (a checked run config's task section) read from ``root``."""
    options = {} if task.get("max_len") is None else {"max_len": task["max_len"]}
    return {s: get_task(task["name"], root, s, **options) for s in ("train", "val", "test")}


def finetune_trainer(cfg: dict, clf: nn.Module, splits: dict[str, LRADataset], device: str | None,
                     progress: bool | None, out_dir: Path | None = None, override_config: bool = False) -> Trainer:
    """The Trainer of run ``cfg``'s fine-tuning phase (the steps left after pretraining; validation on the first
    ``task.val_examples`` of the val split); ``out_dir`` None: no files (scoring a checkpoint)."""
    t = cfg["task"]
    ft_cfg = _train_config(cfg, device, progress, max_steps=_train_config(cfg, device, progress).max_steps
                           - t["pretrain_steps"])
    return Trainer(clf, LRABatches(splits["train"], ft_cfg.batch_size, cfg["seed"]), ft_cfg,
                   eval_data=whole_split(splits["val"], t["val_examples"]), out_dir=out_dir, run_config=cfg,
                   override_config=override_config)


def score_on_test(trainer: Trainer, splits: dict[str, LRADataset]) -> dict:
    """``trainer``'s model evaluated on the whole test split (loss, accuracy)."""
    trainer.eval_data = whole_split(splits["test"])
    return trainer.evaluate()


def train_lra_from_config(config: dict, out_dir: str | Path | None = None, device: str | None = None,
                          progress: bool | None = None, deadline: float | None = None,
                          override_config: bool = False) -> TrainResult:
    """Run LRA config ``config`` (module docstring) in ``out_dir``, resuming either phase from its
    checkpoint; writes config.yaml and, unless interrupted, result.json (with ``num_params``). The
    result's metrics: val ``loss``/``accuracy``, ``test_loss``/``test_accuracy``, ``pretrain_loss`` (the
    last logged pretraining loss, SPT only) and ``pretrain_steps``. ``override_config``: resume checkpoints
    written under another config (each phase's Trainer, see linattn.train.resume)."""
    cfg = check_lra_config(config)
    out = Path(out_dir or config.get("out_dir") or "runs/lra")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    t = cfg["task"]
    lra = t["name"]
    info = task_info(lra)
    splits = load_splits(t, resolve_data_dir(t, out))
    lm, clf = build_models(cfg, info.num_classes, len(info.vocab), dual=info.pair)
    wall, metrics = 0.0, {"pretrain_steps": t["pretrain_steps"]}
    if lm is not None:
        view = CausalLMView(splits["train"]) if t["spt"] == "causal" else MaskedLMView(
            splits["train"], t["mask_ratio"], seed=cfg["seed"])
        pre_cfg = _train_config(cfg, device, progress, max_steps=t["pretrain_steps"], target_value=None,
                                warmup_steps=min(cfg["train"].get("warmup_steps", 50), t["pretrain_steps"]))
        pre = Trainer(lm, LRABatches(view, pre_cfg.batch_size, cfg["seed"]), pre_cfg, out_dir=out / "pretrain",
                      run_config=cfg, override_config=override_config)
        res = pre.fit(deadline=deadline)
        wall += res.wall_s
        if res.status == "interrupted":
            return TrainResult("interrupted", res.step, {}, None, wall)
        logged = [r for r in _metrics(out / "pretrain") if r.get("split") == "train"]
        metrics["pretrain_loss"] = logged[-1]["loss"] if logged else None
        transfer_encoder(pre.model, clf)
    ft = finetune_trainer(cfg, clf, splits, device, progress, out / "finetune", override_config)
    res = ft.fit(deadline=deadline)
    wall += res.wall_s
    if res.status == "interrupted":
        return TrainResult("interrupted", t["pretrain_steps"] + res.step, {}, None, wall)
    test = score_on_test(ft, splits)
    metrics.update({k: v for k, v in res.metrics.items() if k not in ("seq_accuracy", "step")},
                   finetune_steps=res.step, test_loss=test["loss"], test_accuracy=test["accuracy"])
    result = TrainResult(res.status, t["pretrain_steps"] + res.step, metrics, res.best, round(wall, 3))
    num_params = sum(p.numel() for p in clf.parameters())
    (out / "result.json").write_text(json.dumps({**asdict(result), "num_params": num_params}, indent=2))
    return result


def _metrics(out_dir: Path) -> list[dict]:
    from linattn.train.trainer import read_metrics

    return read_metrics(out_dir) if (out_dir / "metrics.jsonl").is_file() else []
