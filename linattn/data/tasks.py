"""The named synthetic tasks: ``make_task(name, **params)`` and ``list_tasks()``."""

from __future__ import annotations

from linattn.data.base import SyntheticTask
from linattn.data.copying import InductionHeads, LongRangeCopy, SelectiveCopy
from linattn.data.ngram import InContextNGram
from linattn.data.recall import MultiQueryAR, StackedAR
from linattn.data.state_tracking import Parity, S5Composition

TASKS: dict[str, type[SyntheticTask]] = {
    "mqar": MultiQueryAR,
    "stacked_mqar": StackedAR,
    "selective_copy": SelectiveCopy,
    "induction_heads": InductionHeads,
    "long_range_copy": LongRangeCopy,
    "ngram": InContextNGram,
    "parity": Parity,
    "s5": S5Composition,
}


def list_tasks() -> list[str]:
    """Names accepted by :func:`make_task`."""
    return sorted(TASKS)


def make_task(name: str, **params: object) -> SyntheticTask:
    """The task ``name`` with ``params`` (its dataclass fields); unknown names or fields raise ValueError."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {list_tasks()}, got {name!r}")
    cls = TASKS[name]
    fields = set(cls.__dataclass_fields__)
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"task {name!r} has no parameter(s) {unknown}; expected a subset of {sorted(fields)}")
    return cls(**params)
