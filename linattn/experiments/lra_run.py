"""One LRA run: optional self-pretraining (SPT) on the task's train split, then fine-tuning a classifier.

A run config (one run of the ``lra`` study; the LRA settings live in ``task`` so the generic run-config
checks of :func:`linattn.train.build.check_run_config` apply unchanged)::

    task:  {name: lra/listops, data_dir: null, spt: causal, pretrain_steps: 150, mask_ratio: null,
            max_len: 2000, generate: {num_train: 2000, ...}}
    model: {mixer: gla, d_model: 32, n_layers: 1, n_heads: 2}    # ModelConfig; vocab_size from the task
    train: {max_steps: 300, batch_size: 32, lr: 0.003}            # TrainConfig of the WHOLE run
    seed: 0

Compute matching (Amos et al. 2023): ``train.max_steps`` is the total; SPT pretrains for
``pretrain_steps`` and fine-tunes for ``max_steps - pretrain_steps``; ``spt: none`` fine-tunes for all
``max_steps``. ``spt: causal`` trains a CausalLM on next-token prediction (:class:`CausalLMView`);
``spt: masked`` trains the same CausalLM architecture to restore ``<mask>`` tokens
(:class:`MaskedLMView`, ratio ``mask_ratio`` or the task's default). Its pretrained weights (all but
``lm_head``) initialise a :class:`SequenceClassifier` (mean pooling, same mixer direction) before
fine-tuning. Accuracy is measured on the val split (during training) and on the test split (at the end).

Retrieval (``lra/retrieval``, two documents per example): SPT trains on every document of the train split
as its own sequence (2 N sequences; masked ratio 15% by default), and the classifier is the dual encoder
(``SequenceClassifier(..., dual=True)``: one shared encoder, the head reads [e1, e2, e1 * e2, e1 - e2]);
the pretrained weights initialise its shared encoder, its head starts fresh. Pairs travel through the
Trainer as one tensor [B, 2, T] (:func:`inputs_targets`).

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
from torch.nn import functional as F

from linattn.data.lra import (
    CausalLMView,
    ListOpsConfig,
    LRADataset,
    MaskedLMView,
    collate,
    get_task,
    load_pretrained,
    task_info,
    write_listops,
)
from linattn.data.lra.vocab import PAD_ID
from linattn.errors import ConfigError, bad_value
from linattn.train.build import check_run_config
from linattn.train.config import TrainConfig
from linattn.train.trainer import Trainer, TrainResult
from linattn.validation import check_choice, check_float, check_int, check_str

PREFIX = "lra/"
SPT_MODES = ("none", "causal", "masked")
LRA_TASK_KEYS = ("name", "data_dir", "spt", "pretrain_steps", "mask_ratio", "max_len", "generate")


def is_lra_config(config: dict) -> bool:
    """Whether run ``config`` is an LRA run (its task name starts with ``lra/``)."""
    return isinstance(config.get("task"), dict) and str(config["task"].get("name", "")).startswith(PREFIX)


def check_lra_config(config: dict) -> dict:
    """A normalised copy of LRA run ``config``; ConfigError naming a bad key or value."""
    cfg = check_run_config(config)
    t = cfg["task"]
    unknown = sorted(set(t) - set(LRA_TASK_KEYS))
    if unknown:
        raise ConfigError(f"unknown LRA task key(s) {unknown}; expected a subset of {list(LRA_TASK_KEYS)}")
    name = str(t["name"])
    if not name.startswith(PREFIX):
        raise bad_value("task.name", name, "'lra/<task>'")
    try:
        task_info(name[len(PREFIX):])
    except ValueError as exc:  # lists the LRA tasks
        raise ConfigError(str(exc), field="task.name") from None
    t.setdefault("data_dir", None)
    t.setdefault("spt", "none")
    t.setdefault("pretrain_steps", 0)
    t.setdefault("mask_ratio", None)
    t.setdefault("generate", None)
    check_choice("task.spt", t["spt"], SPT_MODES)
    if t["data_dir"] is not None:
        check_str("task.data_dir", t["data_dir"])
    if t["mask_ratio"] is not None:
        check_float("task.mask_ratio", t["mask_ratio"], 0, 1, low_open=True, high_open=True)
    if t.get("max_len") is not None:
        check_int("task.max_len", t["max_len"], 1)
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
    lra = task["name"][len(PREFIX):]
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


class LRABatches:
    """``batch(index, rank, world)`` for the Trainer from a map-style LRA dataset or SPT view: batch
    ``index`` is a slice of a per-epoch permutation seeded by (seed, epoch) (the last partial batch of an
    epoch is dropped), padded by ``collate``. Targets: ``label[:, None]`` for a classification split,
    the per-token ``labels`` of an SPT view."""

    def __init__(self, data: LRADataset | CausalLMView | MaskedLMView, batch_size: int, seed: int) -> None:
        if not 1 <= batch_size <= len(data):
            raise ConfigError(f"batch_size must be in [1, {len(data)}] (the split's size), got {batch_size}",
                              field="train.batch_size")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.per_epoch = len(data) // batch_size
        self._perm: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.data), generator=g))
        return self._perm[1]

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, j = divmod(index, self.per_epoch)
        ids = self._permutation(epoch)[j * self.batch_size:(j + 1) * self.batch_size][rank::world]
        if isinstance(self.data, MaskedLMView):
            self.data.set_epoch(epoch)
        return inputs_targets(collate([self.data[int(i)] for i in ids]))


def inputs_targets(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): inputs are ``input_ids`` [B, T], or for a document pair both documents stacked
    as [B, 2, T] (each right-padded with ``PAD_ID`` to the longer one); targets are the per-token
    ``labels`` [B, T] of an SPT batch or ``label[:, None]`` [B, 1]."""
    x = batch["input_ids"]
    if "input_ids2" in batch:
        x2 = batch["input_ids2"]
        T = max(x.shape[1], x2.shape[1])
        x = torch.stack([F.pad(x, (0, T - x.shape[1]), value=PAD_ID), F.pad(x2, (0, T - x2.shape[1]), value=PAD_ID)],
                        dim=1)
    return x, batch["labels"] if "labels" in batch else batch["label"][:, None]


def whole_split(data: LRADataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Every example of ``data`` as one padded (inputs, targets) pair (the Trainer's eval set)."""
    return inputs_targets(collate([data[i] for i in range(len(data))]))


# -- models ----------------------------------------------------------------------------------------------
class PaddedClassifier(nn.Module):
    """A SequenceClassifier reading right-padded ids (``PAD_ID`` = padding): logits [B, 1, C], the shape
    the Trainer's token loss takes with targets [B, 1]. A dual classifier (retrieval) reads a pair as
    [B, 2, T] (see :func:`inputs_targets`); each document is cut to its batch's longest real length."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        dual = getattr(self.classifier, "dual", False)
        want = 3 if dual else 2
        if input_ids.dim() != want or (dual and input_ids.shape[1] != 2):
            raise ValueError(f"input_ids must be {'[B, 2, T] (a document pair)' if dual else '[B, T]'} for this "
                             f"{'dual' if dual else 'single-document'} classifier, got shape {list(input_ids.shape)}")
        if not dual:
            return self.classifier(input_ids, mask=input_ids != PAD_ID)[:, None, :]
        docs = [_trim(input_ids[:, j]) for j in range(2)]
        return self.classifier(docs[0], docs[1], mask=docs[0] != PAD_ID, mask2=docs[1] != PAD_ID)[:, None, :]


def _trim(ids: torch.Tensor) -> torch.Tensor:
    """Right-padded ids [B, T] without the columns that are padding in every row."""
    longest = int((ids != PAD_ID).sum(1).max())
    return ids[:, :max(longest, 1)]


def build_models(cfg: dict, num_classes: int, vocab_size: int, dual: bool = False
                 ) -> tuple[nn.Module | None, PaddedClassifier]:
    """(the pretraining CausalLM or None for ``spt: none``, the classifier; a dual encoder of document
    pairs if ``dual``), initialised from cfg['seed']."""
    from linattn.models import CausalLM, ModelConfig, SequenceClassifier

    model_cfg = ModelConfig.from_dict({"vocab_size": vocab_size, **cfg["model"]})
    torch.manual_seed(cfg["seed"])
    lm = None if cfg["task"]["spt"] == "none" else CausalLM(model_cfg)
    return lm, PaddedClassifier(SequenceClassifier(model_cfg, num_classes, pooling="mean", dual=dual))


def transfer(lm: nn.Module, classifier: PaddedClassifier) -> list[str]:
    """Copy the pretrained LM's weights (all but its head) into the classifier; the names copied."""
    report = load_pretrained(classifier.classifier, lm.state_dict(), drop_prefixes=("lm_head",))
    if not report.loaded:
        raise RuntimeError("no pretrained tensor matched the classifier's names")
    return list(report.loaded)


# -- the run ---------------------------------------------------------------------------------------------
def _train_config(cfg: dict, device: str | None, progress: bool | None, **changes: object) -> TrainConfig:
    train = dict(cfg["train"], seed=cfg["seed"], **changes)
    if device is not None:
        train["device"] = device
    if progress is not None:
        train["progress"] = progress
    return TrainConfig.from_dict(train)


def train_lra_from_config(config: dict, out_dir: str | Path | None = None, device: str | None = None,
                          progress: bool | None = None, deadline: float | None = None) -> TrainResult:
    """Run LRA config ``config`` (module docstring) in ``out_dir``, resuming either phase from its
    checkpoint; writes config.yaml and, unless interrupted, result.json (with ``num_params``). The
    result's metrics: val ``loss``/``accuracy``, ``test_loss``/``test_accuracy``, ``pretrain_loss`` (the
    last logged pretraining loss, SPT only) and ``pretrain_steps``."""
    cfg = check_lra_config(config)
    out = Path(out_dir or config.get("out_dir") or "runs/lra")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    t = cfg["task"]
    lra = t["name"][len(PREFIX):]
    info = task_info(lra)
    root = resolve_data_dir(t, out)
    options = {} if t.get("max_len") is None else {"max_len": t["max_len"]}
    splits = {s: get_task(lra, root, s, **options) for s in ("train", "val", "test")}
    lm, clf = build_models(cfg, info.num_classes, len(info.vocab), dual=info.pair)
    total = _train_config(cfg, device, progress).max_steps
    wall, metrics = 0.0, {"pretrain_steps": t["pretrain_steps"]}
    if lm is not None:
        view = CausalLMView(splits["train"]) if t["spt"] == "causal" else MaskedLMView(
            splits["train"], t["mask_ratio"], seed=cfg["seed"])
        pre_cfg = _train_config(cfg, device, progress, max_steps=t["pretrain_steps"], target_value=None,
                                warmup_steps=min(cfg["train"].get("warmup_steps", 50), t["pretrain_steps"]))
        pre = Trainer(lm, LRABatches(view, pre_cfg.batch_size, cfg["seed"]), pre_cfg, out_dir=out / "pretrain",
                      run_config=cfg)
        res = pre.fit(deadline=deadline)
        wall += res.wall_s
        if res.status == "interrupted":
            return TrainResult("interrupted", res.step, {}, None, wall)
        logged = [r for r in _metrics(out / "pretrain") if r.get("split") == "train"]
        metrics["pretrain_loss"] = logged[-1]["loss"] if logged else None
        transfer(pre.model, clf)
    ft_cfg = _train_config(cfg, device, progress, max_steps=total - t["pretrain_steps"])
    ft = Trainer(clf, LRABatches(splits["train"], ft_cfg.batch_size, cfg["seed"]), ft_cfg,
                 eval_data=whole_split(splits["val"]), out_dir=out / "finetune", run_config=cfg)
    res = ft.fit(deadline=deadline)
    wall += res.wall_s
    if res.status == "interrupted":
        return TrainResult("interrupted", t["pretrain_steps"] + res.step, {}, None, wall)
    ft.eval_data = whole_split(splits["test"])
    test = ft.evaluate()
    metrics.update({k: v for k, v in res.metrics.items() if k not in ("seq_accuracy", "step")},
                   finetune_steps=res.step, test_loss=test["loss"], test_accuracy=test["accuracy"])
    result = TrainResult(res.status, t["pretrain_steps"] + res.step, metrics, res.best, round(wall, 3))
    num_params = sum(p.numel() for p in clf.parameters())
    (out / "result.json").write_text(json.dumps({**asdict(result), "num_params": num_params}, indent=2))
    return result


def _metrics(out_dir: Path) -> list[dict]:
    from linattn.train.trainer import read_metrics

    return read_metrics(out_dir) if (out_dir / "metrics.jsonl").is_file() else []
