"""Declarative studies: a base run config, named axes of overrides, seeds and learning rates.

A study (YAML or dict)::

    name: shortconv
    base: {kind: synthetic, task: {...}, model: {...}, train: {...}, eval_examples: 512}   # a run config
    axes:                                   # the grid: every combination of one label per axis
      mixer: {gla: {model.mixer: gla}, gated_delta_rule: {model.mixer: gated_delta_rule}}
      conv:  {none: {model.mixer_kwargs.short_conv: ""}, k: {model.mixer_kwargs.short_conv: k}}
      width: {path: model.d_model, values: [32, 64]}     # shorthand: label = str(value)
    exclude: [{mixer: gla, conv: none}]     # label combinations to leave out (partial matches)
    seeds: [0, 1]
    lrs: [0.001, 0.003]                     # train.lr, swept; the report takes the best per setting
    metric: accuracy                        # the eval metric the report compares
    report: {facet: task, rows: [mixer], cols: conv}

Overrides are dotted paths into the run config. Runs are the grid x seeds x lrs.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linattn.config_files import read_yaml
from linattn.errors import ConfigError, bad_value, located
from linattn.experiments.runs import check_config
from linattn.validation import check_float, check_int, check_str

STUDY_KEYS = ("name", "base", "axes", "exclude", "seeds", "lrs", "metric", "report", "description")


@dataclass(frozen=True)
class RunSpec:
    """One run of a study: its axis labels, seed, lr and full run config."""

    labels: tuple[tuple[str, str], ...]
    seed: int
    lr: float
    config: dict = field(compare=False, hash=False)

    @property
    def run_id(self) -> str:
        """A readable, file-safe, unique name: ``mixer=gla,conv=k,seed=0,lr=0.003`` made safe."""
        parts = [f"{k}-{v}" for k, v in self.labels] + [f"s{self.seed}", f"lr{self.lr:g}"]
        slug = re.sub(r"[^A-Za-z0-9_.+-]", "_", "_".join(parts))
        if len(slug) > 150:
            slug = slug[:120] + "_" + hashlib.sha1(slug.encode()).hexdigest()[:12]
        return slug

    def row(self) -> dict:
        return {**dict(self.labels), "seed": self.seed, "lr": self.lr}


def set_path(config: dict, path: str, value: Any) -> None:
    """``config[a][b][c] = value`` for ``path = "a.b.c"`` (creating mappings on the way)."""
    keys = path.split(".")
    node = config
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override path {path!r}: {k!r} is not a mapping")
    node[keys[-1]] = copy.deepcopy(value)


def _normalise_axis(name: str, axis: Any) -> dict[str, dict]:
    if isinstance(axis, dict) and set(axis) == {"path", "values"}:
        return {str(v): {axis["path"]: v} for v in axis["values"]}
    if not isinstance(axis, dict) or not axis:
        raise ConfigError(f"axis {name!r} must map labels to override dicts, or be {{path, values}}; got {axis!r}")
    for label, overrides in axis.items():
        if not isinstance(overrides, dict):
            raise ConfigError(f"axis {name!r} label {label!r}: overrides must be a dict of dotted paths, "
                             f"got {overrides!r}")
    return {str(k): v for k, v in axis.items()}


@dataclass
class Study:
    """A parsed, validated study definition."""

    name: str
    base: dict
    axes: dict[str, dict[str, dict]]
    seeds: list[int]
    lrs: list[float]
    exclude: list[dict] = field(default_factory=list)
    metric: str = "accuracy"
    report: dict = field(default_factory=dict)
    description: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> Study:
        """The study of mapping ``d``; ConfigError naming the bad key or value (every run config included)."""
        if not isinstance(d, dict):
            raise ConfigError(f"a study must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - set(STUDY_KEYS))
        if unknown:
            raise ConfigError(f"unknown study key(s) {unknown}; expected a subset of {list(STUDY_KEYS)}")
        for key in ("name", "base", "seeds", "lrs"):
            if key not in d:
                raise ConfigError(f"a study needs {key!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(d["name"])):
            raise ConfigError(f"study name must be file-safe ([A-Za-z0-9_.-]+), got {d['name']!r}", field="name")
        for key in ("seeds", "lrs"):
            if not isinstance(d[key], list) or not d[key]:
                raise bad_value(key, d[key], "a non-empty list")
        seeds = [check_int(f"seeds[{i}]", s, 0) for i, s in enumerate(d["seeds"])]
        lrs = [check_float(f"lrs[{i}]", x, 0, low_open=True) for i, x in enumerate(d["lrs"])]
        if not isinstance(d["base"], dict):
            raise bad_value("base", d["base"], "a run config mapping")
        for key, kind in (("exclude", list), ("report", dict)):
            if d.get(key) is not None and not isinstance(d[key], kind):
                raise bad_value(key, d[key], f"a {kind.__name__}")
        axes = {str(k): _normalise_axis(str(k), v) for k, v in (d.get("axes") or {}).items()}
        study = cls(str(d["name"]), d["base"], axes, seeds, lrs, list(d.get("exclude") or []),
                    check_str("metric", d.get("metric", "accuracy")), dict(d.get("report") or {}),
                    str(d.get("description", "")))
        for e in study.exclude:
            bad = set(e) - set(axes) if isinstance(e, dict) else {"(not a mapping)"}
            if bad:
                raise ConfigError(f"exclude entry {e} names unknown axes {sorted(bad)}", field="exclude")
        study.runs()  # validates every override path and run config
        return study

    @classmethod
    def from_yaml(cls, path: str | Path) -> Study:
        """The study of YAML file ``path``; errors name the file."""
        with located(source=path):
            return cls.from_dict(read_yaml(path, "study file"))

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "base": self.base, "axes": self.axes,
                "exclude": self.exclude, "seeds": self.seeds, "lrs": self.lrs, "metric": self.metric,
                "report": self.report}

    def fingerprint(self) -> str:
        """A hash of the definition: a resumed study must be the same study."""
        return hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _excluded(self, labels: dict[str, str]) -> bool:
        return any(all(labels.get(k) == str(v) for k, v in e.items()) for e in self.exclude)

    def settings(self) -> list[tuple[tuple[str, str], ...]]:
        """Every non-excluded combination of axis labels, in grid order."""
        names = list(self.axes)
        combos = itertools.product(*(list(self.axes[n]) for n in names))
        out = [tuple(zip(names, combo)) for combo in combos]
        return [s for s in out if not self._excluded(dict(s))]

    def runs(self) -> list[RunSpec]:
        """Every run: settings x seeds x lrs, each with its full run config, checked by its kind's checks."""
        specs = []
        for labels in self.settings():
            config = copy.deepcopy(self.base)
            for axis, label in labels:
                for path, value in self.axes[axis][label].items():
                    set_path(config, path, value)
            for seed, lr in itertools.product(self.seeds, self.lrs):
                c = copy.deepcopy(config)
                c["seed"] = int(seed)
                set_path(c, "train.lr", lr)
                specs.append(RunSpec(labels, int(seed), lr, check_config(c)))
        ids = [s.run_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ConfigError("two runs of the study share a run id; make the axis labels distinct")
        return specs

    def with_seeds(self, seeds: list[int]) -> Study:
        """This study with ``seeds`` instead of its own (checked like a study file's)."""
        return Study.from_dict({**self.to_dict(), "seeds": list(seeds)})


ReportFn = Callable[[Study, Path, list[dict]], None]


def no_options(group: argparse._ArgumentGroup) -> None:
    """A study without flags of its own."""


@dataclass(frozen=True)
class StudyEntry:
    """A named study, everything ``linattn run NAME`` needs: ``presets`` (the first is the default);
    ``make(preset)``, the study at a preset; ``report(study, study_dir, rows)``, which writes report.md;
    ``add_options(group)``, the study's own flags (their dests in ``options``, each defaulting to None); and
    ``from_args(args, workers)``, the study of a parsed command line (default: ``make(args.preset)``)."""

    name: str
    presets: tuple[str, ...]
    make: Callable[[str], Study]
    report: ReportFn
    add_options: Callable[[argparse._ArgumentGroup], None] = no_options
    options: tuple[str, ...] = ()
    from_args: Callable[[argparse.Namespace, int], Study] | None = None

    def study_from_args(self, args: argparse.Namespace, workers: int) -> Study:
        """The study of ``args`` (``workers``: the run processes, for studies that measure before they run)."""
        return self.from_args(args, workers) if self.from_args is not None else self.make(args.preset)
