"""Checks on argument *values* (ranges, flags), complementing the shape/dtype checks of checks.py.

A range check reads the tensor. On the CPU that is cheap; on CUDA it is a host synchronisation,
which stalls the launch queue and cannot be captured in a CUDA graph. So range checks run in one of
three modes:

- ``"auto"`` (the default): checked for CPU tensors, skipped for CUDA tensors and under
  ``torch.compile`` (a data-dependent branch would break the graph). Run a call once on the CPU, or
  in strict mode, to have the values checked.
- ``"strict"``: checked everywhere outside ``torch.compile`` (one host synchronisation per checked
  argument on CUDA).
- ``"off"``: never checked, for callers that guarantee the ranges (the layers make beta by a sigmoid
  and decays by a log-sigmoid/softplus, in range by construction, and call their ops so).

Shape, dtype and Python-value checks are free and always run. The mode is one of the library's settings
(``linattn.settings(value_checks=...)``, ``LINATTN_CHECK_VALUES``; linattn/switches.py); ``value_checks(mode)``
(a context manager that is a no-op under torch.compile, for the layers) and ``set_value_checks(mode)`` set it
for this thread/context. ``True`` means ``"strict"`` and ``False`` means ``"off"`` wherever a mode is taken.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from linattn import switches

MODES = switches.VALUE_CHECK_MODES


def _mode(value: object, name: str = "mode") -> str:
    """A value-check mode from a mode name or a bool (True: strict, False: off)."""
    if isinstance(value, bool):
        return "strict" if value else "off"
    if isinstance(value, str) and value in MODES:
        return value
    raise TypeError(f"{name} must be one of {', '.join(map(repr, MODES))} or a bool (True: 'strict', "
                    f"False: 'off'), got {type(value).__name__} {value!r}")


def value_check_mode() -> str:
    """The current mode: "auto", "strict" or "off"."""
    return switches.value_check_mode()


def value_checks_enabled(x: torch.Tensor | None = None) -> bool:
    """Whether a range check of ``x`` (any tensor when None) runs here: never under torch.compile or in mode
    "off"; in mode "auto" only for tensors that are not on CUDA (no host synchronisation)."""
    if torch.compiler.is_compiling():
        return False
    mode = switches.value_check_mode()
    if mode == "auto":
        return x is None or x.device.type != "cuda"
    return mode == "strict"


def set_value_checks(mode: str | bool) -> None:
    """Set the value-check mode for this thread/context (see the module docstring)."""
    switches.set_context_value_checks(_mode(mode, "enabled"))


@contextlib.contextmanager
def value_checks(mode: str | bool) -> Iterator[None]:
    """The value-check mode inside the ``with`` block (under torch.compile, where checks never run, a no-op)."""
    mode = _mode(mode, "enabled")
    if torch.compiler.is_compiling():  # a ContextVar cannot be set inside a compiled graph
        yield
        return
    token = switches.set_context_value_checks(mode)
    try:
        yield
    finally:
        switches.reset_context_value_checks(token)


def check_bool(name: str, value: object) -> bool:
    """``value`` must be a Python bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_range(name: str, x: torch.Tensor, low: float, high: float, hint: str = "") -> torch.Tensor:
    """Every entry of ``x`` must lie in [low, high] (NaN fails); ``hint`` is appended to the error. Runs where
    :func:`value_checks_enabled` says so."""
    if x.numel() == 0 or not value_checks_enabled(x):
        return x
    lo, hi = torch.aminmax(x.detach())
    lo, hi = float(lo), float(hi)
    if not (lo >= low and hi <= high):
        raise ValueError(
            f"{name} must have values in [{low:g}, {high:g}], got values in [{lo:g}, {hi:g}]"
            + (f" ({hint})" if hint else "")
        )
    return x


def check_log_decay(name: str, g: torch.Tensor | None) -> torch.Tensor | None:
    """A log decay must be <= 0 (None skipped): exp(g) > 1 grows the state without bound (Inf, then NaN)."""
    if g is None:
        return None
    return check_range(name, g, float("-inf"), 0.0, "a log decay: exp(g) must be a decay factor in [0, 1]")
