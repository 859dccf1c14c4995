"""Datasets: deterministic synthetic tasks (this package) and Long Range Arena (``linattn.data.lra``)."""

from linattn.data.base import IGNORE_INDEX, SyntheticTask, TaskStream, eval_set, generator, mix_seed
from linattn.data.copying import InductionHeads, LongRangeCopy, SelectiveCopy
from linattn.data.ngram import InContextNGram
from linattn.data.recall import MultiQueryAR, StackedAR
from linattn.data.state_tracking import Parity, S5Composition
from linattn.data.tasks import TASKS, list_tasks, make_task

__all__ = [
    "IGNORE_INDEX", "SyntheticTask", "TaskStream", "eval_set", "generator", "mix_seed",
    "MultiQueryAR", "StackedAR", "SelectiveCopy", "InductionHeads", "LongRangeCopy", "InContextNGram",
    "Parity", "S5Composition", "TASKS", "list_tasks", "make_task",
]
