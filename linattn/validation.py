"""Strict checks of config fields: each returns the value (normalised) or raises a :class:`ConfigError`
naming the field, the value and what was expected.

Strict because configs come from YAML and Python, where the easy mistakes pass loose checks: ``True`` is an
``int`` (``mlp_hidden: true`` would be a 1-wide MLP), any non-empty string is truthy (``progress: 'no'``),
and YAML 1.1 reads ``1e-3`` (no dot) as a string.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence

import torch

from linattn.errors import ConfigError, bad_value


def check_bool(field: str, value: object) -> bool:
    """``value`` must be ``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise bad_value(field, value, "true or false")
    return value


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high}"
    return ""


def _in_bounds(x: float, low: float | None, high: float | None, low_open: bool, high_open: bool) -> bool:
    above = low is None or (x > low if low_open else x >= low)
    below = high is None or (x < high if high_open else x <= high)
    return above and below


def check_int(field: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``value`` must be an int (not a bool) in ``[low, high]`` (either bound may be None)."""
    expected = f"an int {_bounds(low, high, False, False)}".rstrip()
    if isinstance(value, bool) or not isinstance(value, int) or not _in_bounds(value, low, high, False, False):
        raise bad_value(field, value, expected)
    return value


def check_float(field: str, value: object, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False) -> float:
    """``value`` must be a finite number (int or float, not a bool) within the bounds; returned as a float."""
    expected = f"a finite number {_bounds(low, high, low_open, high_open)}".rstrip()
    if isinstance(value, str) and is_number(value):
        expected += " (YAML reads 1e-3 without a dot as text: write 1.0e-3)"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not _in_bounds(value, low, high, low_open, high_open):
        raise bad_value(field, value, expected)
    return float(value)


def is_number(text: str) -> bool:
    """Whether ``float(text)`` succeeds."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_choice(field: str, value: object, choices: Sequence[str]) -> str:
    """``value`` must be one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise bad_value(field, value, f"one of {', '.join(repr(c) for c in choices)}")
    return value


def check_str(field: str, value: object) -> str:
    """``value`` must be a non-empty string."""
    if not isinstance(value, str) or not value:
        raise bad_value(field, value, "a non-empty string")
    return value


def check_pair(field: str, value: object, low: float, high: float) -> tuple[float, float]:
    """``value`` must be a list/tuple of two finite numbers in ``[low, high)`` (e.g. Adam's betas)."""
    expected = f"a pair [a, b] of numbers in [{low}, {high})"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise bad_value(field, value, expected)
    try:
        first, second = (check_float(field, v, low, high, high_open=True) for v in value)
    except ConfigError:
        raise bad_value(field, value, expected) from None
    return first, second


DEVICE_FORMS = "'auto', 'cpu', 'cuda' or 'cuda:N'"


def check_device(field: str, value: object, allow_auto: bool = True) -> str:
    """``value`` must name a device this machine has: 'cpu', 'cuda', 'cuda:N' (N < the GPU count) or,
    with ``allow_auto``, 'auto' (cuda when available, else cpu)."""
    forms = DEVICE_FORMS if allow_auto else DEVICE_FORMS.replace("'auto', ", "")
    if not isinstance(value, str):
        raise bad_value(field, value, forms)
    if value == "auto" and allow_auto:
        return value
    try:
        device = torch.device(value)
    except RuntimeError:
        raise bad_value(field, value, forms) from None
    if device.type not in ("cpu", "cuda"):
        raise bad_value(field, value, forms)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{value!r} needs a CUDA GPU, but CUDA is not available here (torch "
                              f"{torch.__version__}, {torch.cuda.device_count()} GPUs visible); use 'cpu'",
                              field=field)
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise bad_value(field, value, f"a GPU index below {count} (the visible GPUs)")
    return value


def int_arg(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for an int flag >= ``low``: argparse then names the flag, the value and the bound
    (exit code 2) instead of accepting e.g. ``--batches 0`` and doing nothing."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def json_object_arg(text: str) -> dict:
    """An argparse ``type`` for a flag that takes a JSON object (e.g. a triton_launch setting): argparse then names
    the flag and the value when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


json_object_arg.__name__ = "JSON object"
