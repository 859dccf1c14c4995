"""Checks on argument *values* (ranges, flags), complementing the shape/dtype checks of checks.py.

A range check reads the tensor (on CUDA this is one host synchronisation), so ops use it only for
arguments whose out-of-range values silently break the math (e.g. a delta rule's beta). Under
``torch.compile`` range checks are skipped: a data-dependent branch would break the graph; run the
function eagerly once to have the values checked.
"""

from __future__ import annotations

import torch


def check_bool(name: str, value: object) -> bool:
    """``value`` must be a Python bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_range(name: str, x: torch.Tensor, low: float, high: float, hint: str = "") -> torch.Tensor:
    """Every entry of ``x`` must lie in [low, high] (NaN fails); ``hint`` is appended to the error."""
    if x.numel() == 0 or torch.compiler.is_compiling():
        return x
    lo, hi = torch.aminmax(x.detach())
    lo, hi = float(lo), float(hi)
    if not (lo >= low and hi <= high):
        raise ValueError(
            f"{name} must have values in [{low:g}, {high:g}], got values in [{lo:g}, {hi:g}]"
            + (f" ({hint})" if hint else "")
        )
    return x
