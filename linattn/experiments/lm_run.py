"""One language-modelling run on real text (run kind ``lm``): a CausalLM trained on next-token prediction over
a corpus of text files, scored in bits per byte.

A run config of kind ``lm`` (the corpus and tokenizer settings live in ``task``, so the generic run-config
checks of :func:`linattn.train.build.check_run_config` apply unchanged)::

    kind:  lm
    task:  {name: text, root: null, include: null, exclude: null, val_fraction: 0.05, test_fraction: 0.05,
            tokenizer: bytes, vocab_size: null, seq_len: 128, eval_windows: 64, test_windows: 256,
            cache_dir: null, pack_documents: false}
    model: {mixer: gated_delta_rule, d_model: 64, n_layers: 2, n_heads: 2}   # vocab_size from the tokenizer
    train: {max_steps: 300, batch_size: 16, lr: 0.003, target_metric: loss}
    seed: 0

``root: null`` is the running Python's standard library (``include``/``exclude`` null: its defaults, see
:mod:`linattn.data.text.corpus`); another folder reads ``include`` (default ``*.txt``). A corpus of several
folders is the optional key ``sources`` instead of ``root``/``include``/``exclude`` (which stay null), a list of
``{name, root, include, exclude}`` read the same way; a file's path is ``<name>/<path in its folder>`` and its
split follows that path (:class:`linattn.data.text.corpus.MultiCorpus`). Configs without ``sources`` are
normalised as before (no key added), so runs made before it existed resume unchanged. ``tokenizer``:
``bytes`` or ``bpe`` (``vocab_size`` ids, trained on the train split). The token shards are built once into
``cache_dir`` (null: ``<study folder>/data``, or ``<out>/data`` for a lone run) and shared by every run
that asks for the same corpus and tokenizer. Training windows of ``seq_len`` tokens are drawn at random
from the packed train split (they cross document boundaries); with ``pack_documents: true`` each step instead
trains on whole documents, ``train.batch_size * seq_len`` tokens packed along one row with ``cu_seqlens``, the
model's state restarting at every document (:mod:`linattn.data.packed`; a document longer than what is left
of a step continues in the next one). Validation is ``eval_windows`` fixed windows of the validation split (the
Trainer's eval, every ``train.eval_every`` steps), test ``test_windows`` windows of the test split once at
the end. ``result.json`` holds ``val_bpb``, ``test_bpb``, ``unigram_bpb`` (the entropy baseline of the train
split) and ``val_bpb_per_nat`` (a logged eval loss times it is the validation bits per byte).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import torch
import yaml

from linattn.data.packed import PackedDocuments
from linattn.data.text import (
    MultiCorpus,
    TextCorpus,
    build_shards,
    eval_windows,
    make_corpus,
    make_sources_corpus,
    unigram_entropy_bpb,
)
from linattn.data.text.corpus import SOURCE_KEYS
from linattn.data.text.score import mean_loss_to_bpb
from linattn.data.text.tokenizer import TOKENIZERS
from linattn.data.text.windows import TokenWindows
from linattn.errors import ConfigError, bad_value
from linattn.train.build import check_run_config
from linattn.train.config import TrainConfig
from linattn.train.trainer import Trainer, TrainResult
from linattn.validation import check_choice, check_float, check_int, check_str

KIND = "lm"
TASK_DEFAULTS = {"name": "text", "root": None, "include": None, "exclude": None, "val_fraction": 0.05,
                 "test_fraction": 0.05, "tokenizer": "bytes", "vocab_size": None, "seq_len": 128,
                 "eval_windows": 64, "test_windows": 256, "cache_dir": None, "pack_documents": False}
# keys checked when present but never added: a normalised config is stored with each run's checkpoint and
# compared on resume, so a new default would make every earlier run look changed
OPTIONAL_TASK_KEYS = ("sources",)


def _patterns(field: str, value) -> None:
    if value is not None and (not isinstance(value, list) or not all(isinstance(p, str) and p for p in value)):
        raise bad_value(field, value, "null or a list of file name patterns")


def _check_sources(t: dict) -> None:
    """``task.sources``: a non-empty list of {name, root, include, exclude} with distinct names, and then no
    ``root``/``include``/``exclude`` beside it."""
    sources = t["sources"]
    if not isinstance(sources, list) or not sources:
        raise bad_value("task.sources", sources, "a non-empty list of {name, root, include, exclude}")
    for key in ("root", "include", "exclude"):
        if t[key] is not None:
            raise bad_value(f"task.{key}", t[key], "null when task.sources is given (each source has its own)")
    names = []
    for i, src in enumerate(sources):
        field = f"task.sources[{i}]"
        if not isinstance(src, dict) or set(src) - set(SOURCE_KEYS) or "name" not in src:
            raise bad_value(field, src, "a mapping with keys name and (optional) root, include, exclude")
        name = check_str(f"{field}.name", src["name"])
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", "..") or name in names:
            raise bad_value(f"{field}.name", name, "a distinct name matching [A-Za-z0-9_.-]+ (the first folder of "
                            "its files' paths)")
        names.append(name)
        if src.get("root") is not None:
            check_str(f"{field}.root", src["root"])
        for key in ("include", "exclude"):
            _patterns(f"{field}.{key}", src.get(key))


def check_lm_config(config: dict) -> dict:
    """A normalised copy of lm run ``config``; ConfigError naming a bad key or value."""
    cfg = check_run_config(config)
    if cfg["kind"] != KIND:
        raise bad_value("kind", cfg["kind"], repr(KIND))
    t = cfg["task"]
    unknown = sorted(set(t) - set(TASK_DEFAULTS) - set(OPTIONAL_TASK_KEYS))
    if unknown:
        raise ConfigError(f"unknown lm task key(s) {unknown}; expected a subset of "
                          f"{list(TASK_DEFAULTS) + list(OPTIONAL_TASK_KEYS)}")
    for key, value in TASK_DEFAULTS.items():
        t.setdefault(key, value)
    check_choice("task.name", t["name"], ("text",))
    check_choice("task.tokenizer", t["tokenizer"], TOKENIZERS)
    if t["tokenizer"] == "bpe":
        check_int("task.vocab_size", t["vocab_size"], 257, 2**20)
    elif t["vocab_size"] is not None:
        raise bad_value("task.vocab_size", t["vocab_size"], "null for the bytes tokenizer (256 ids)")
    for key in ("root", "cache_dir"):
        if t[key] is not None:
            check_str(f"task.{key}", t[key])
    for key in ("include", "exclude"):
        _patterns(f"task.{key}", t[key])
    if "sources" in t:
        _check_sources(t)
    for key in ("val_fraction", "test_fraction"):
        check_float(f"task.{key}", t[key], 0, 1, low_open=True, high_open=True)
    for key in ("seq_len", "eval_windows", "test_windows"):
        check_int(f"task.{key}", t[key], 1)
    if not isinstance(t["pack_documents"], bool):
        raise bad_value("task.pack_documents", t["pack_documents"], "true or false")
    return cfg


def lm_corpus(task: dict) -> TextCorpus | MultiCorpus:
    """The corpus of checked task ``task``: its ``sources``, else its ``root``/``include``/``exclude``."""
    if task.get("sources"):
        return make_sources_corpus(task["sources"], task["val_fraction"], task["test_fraction"])
    return make_corpus(task["root"], task["include"], task["exclude"], task["val_fraction"], task["test_fraction"])


def data_cache_dir(task: dict, out_dir: Path) -> Path:
    """Where the token shards live: ``task.cache_dir``, else the study folder's ``data/`` (run folders are
    ``<study>/runs/<run_id>``), else ``<out>/data``."""
    if task["cache_dir"] is not None:
        return Path(task["cache_dir"])
    return (out_dir.parent.parent if out_dir.parent.name == "runs" else out_dir) / "data"


def _train_config(cfg: dict, device: str | None, progress: bool | None) -> TrainConfig:
    train = dict(cfg["train"], seed=cfg["seed"])
    if device is not None:
        train["device"] = device
    if progress is not None:
        train["progress"] = progress
    return TrainConfig.from_dict(train)


def train_lm_from_config(config: dict, out_dir: str | Path | None = None, device: str | None = None,
                         progress: bool | None = None, deadline: float | None = None,
                         override_config: bool = False) -> TrainResult:
    """Run lm config ``config`` (module docstring) in ``out_dir``, resuming from its checkpoint; writes
    config.yaml and, unless interrupted, result.json (with ``num_params``)."""
    from linattn.models import CausalLM, ModelConfig

    cfg = check_lm_config(config)
    out = Path(out_dir or config.get("out_dir") or "runs/lm")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    t = cfg["task"]
    shards = build_shards(lm_corpus(t), data_cache_dir(t, out), t["tokenizer"], t["vocab_size"])
    table = shards.token_bytes()
    val = eval_windows(shards.tokens("val"), table, t["seq_len"], t["eval_windows"])
    train_cfg = _train_config(cfg, device, progress)
    with_vocab = {"vocab_size": shards.vocab_size, **cfg["model"]}
    model_cfg = ModelConfig.from_dict(with_vocab)
    if model_cfg.vocab_size < shards.vocab_size:
        raise ConfigError(f"{model_cfg.vocab_size} < the tokenizer's {shards.vocab_size} ids", field="model.vocab_size")
    torch.manual_seed(cfg["seed"])
    model = CausalLM(model_cfg)
    if t["pack_documents"]:
        stream = PackedDocuments(shards.tokens("train"), shards.offsets("train"), t["seq_len"], train_cfg.batch_size,
                                 cfg["seed"])
    else:
        stream = TokenWindows(shards.tokens("train"), t["seq_len"], train_cfg.batch_size, cfg["seed"])
    trainer = Trainer(model, stream, train_cfg, eval_data=(val.inputs, val.targets), out_dir=out, run_config=cfg,
                      override_config=override_config)
    res = trainer.fit(deadline=deadline)
    if res.status == "interrupted":
        return res
    test = eval_windows(shards.tokens("test"), table, t["seq_len"], t["test_windows"])
    trainer.eval_data = (test.inputs, test.targets)
    test_loss = trainer.evaluate()["loss"]
    metrics = {"val_loss": res.metrics["loss"], "val_bpb": mean_loss_to_bpb(res.metrics["loss"], val.num_tokens,
                                                                            val.num_bytes),
               "test_loss": test_loss, "test_bpb": mean_loss_to_bpb(test_loss, test.num_tokens, test.num_bytes),
               "unigram_bpb": float(unigram_entropy_bpb(shards.tokens("train"), table)),
               "val_bpb_per_nat": mean_loss_to_bpb(1.0, val.num_tokens, val.num_bytes),
               "vocab_size": shards.vocab_size}
    result = TrainResult(res.status, res.step, metrics, res.best, res.wall_s)
    num_params = sum(p.numel() for p in model.parameters())
    if trainer.dist.is_main:
        (out / "result.json").write_text(json.dumps({**asdict(result), "num_params": num_params}, indent=2))
    return result
