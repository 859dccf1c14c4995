"""Checks on argument *values* (ranges, flags), complementing the shape/dtype checks of checks.py.

A range check reads the tensor (on CUDA this is one host synchronisation), so ops use it only for
arguments whose out-of-range values silently break the math (e.g. a delta rule's beta). Under
``torch.compile`` range checks are skipped: a data-dependent branch would break the graph; run the
function eagerly once to have the values checked.

``value_checks(False)`` (a context manager) or ``set_value_checks(False)`` turns range checks off
where the caller guarantees the ranges, so the hot path keeps no host synchronisation: the layers
produce beta by a sigmoid and decays by a log-sigmoid/softplus, in range by construction, and call
their ops inside ``value_checks(False)``. The environment variable ``LINATTN_CHECK_VALUES=0`` turns them
off everywhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_ENABLED: ContextVar[bool] = ContextVar("linattn_value_checks", default=os.environ.get("LINATTN_CHECK_VALUES",
                                                                                      "1") != "0")


def value_checks_enabled() -> bool:
    """Whether range checks (host synchronisations on CUDA) run here."""
    return _ENABLED.get()


def set_value_checks(enabled: bool) -> None:
    """Turn range checks on or off for this thread/context (see the module docstring)."""
    _ENABLED.set(check_bool("enabled", enabled))


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Range checks on or off inside the ``with`` block."""
    token = _ENABLED.set(check_bool("enabled", enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def check_bool(name: str, value: object) -> bool:
    """``value`` must be a Python bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_range(name: str, x: torch.Tensor, low: float, high: float, hint: str = "") -> torch.Tensor:
    """Every entry of ``x`` must lie in [low, high] (NaN fails); ``hint`` is appended to the error."""
    if x.numel() == 0 or torch.compiler.is_compiling() or not _ENABLED.get():
        return x
    lo, hi = torch.aminmax(x.detach())
    lo, hi = float(lo), float(hi)
    if not (lo >= low and hi <= high):
        raise ValueError(
            f"{name} must have values in [{low:g}, {high:g}], got values in [{lo:g}, {hi:g}]"
            + (f" ({hint})" if hint else "")
        )
    return x
