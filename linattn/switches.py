"""One switch surface for the library's fast paths: which backend runs, and whether values are checked
(``linattn.settings``, ``linattn.configure`` and ``linattn.current`` are this module's).

::

    import linattn

    with linattn.settings(step_backend="torch", value_checks="strict"):
        ...                                   # restored when the block ends
    linattn.configure(shortconv_backend="conv1d")   # from now on
    linattn.current().op_backend              # what is in force

Every field has an environment variable that sets its starting value (read once, when linattn is imported;
docs/settings.md lists them all):

=====================  ===========================  ==================================================================
field                  environment variable         values
=====================  ===========================  ==================================================================
``op_backend``         ``LINATTN_OP_BACKEND``       what an op call with ``backend="auto"`` runs: "auto" (triton on
                                                    CUDA where the op has it, else chunk), or "recurrent", "parallel",
                                                    "chunk", "triton" wherever the op has that backend
``step_backend``       ``LINATTN_STEP_BACKEND``     decoding steps: "auto" (fused kernel on CUDA), "torch", "triton"
``shortconv_backend``  ``LINATTN_SHORTCONV_BACKEND``  ShortConv: "auto", "muladd", "conv1d", "triton"
``fused_backend``      ``LINATTN_FUSED_BACKEND``    the layers' fused norm and gate kernels: "auto", "torch", "triton"
``value_checks``       ``LINATTN_CHECK_VALUES``     range checks: "auto", "strict" (or 1), "off" (or 0)
``fast_launch``        ``LINATTN_FAST_LAUNCH``      Triton launches through the cached launcher: 1 (default) or 0
``triton_launch``      ``LINATTN_TRITON_LAUNCH``    launch settings per kernel family: ``{"gla": {"num_warps": 2}}``
=====================  ===========================  ==================================================================

``value_checks`` set by :func:`settings` holds in the current thread / async context only (a layer turns the
checks off around its own op calls without affecting another thread); every other field is process-wide,
because the code that reads it may run inside a ``torch.compile`` graph, where a context variable cannot be
read. The settings are read where they act, so a change applies to the next call.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

OP_BACKENDS = ("auto", "recurrent", "parallel", "chunk", "triton")
STEP_BACKENDS = ("auto", "torch", "triton")
SHORTCONV_BACKENDS = ("auto", "muladd", "conv1d", "triton")
FUSED_BACKENDS = ("auto", "torch", "triton")
VALUE_CHECK_MODES = ("auto", "strict", "off")
CHOICES: dict[str, tuple[str, ...]] = {
    "op_backend": OP_BACKENDS, "step_backend": STEP_BACKENDS, "shortconv_backend": SHORTCONV_BACKENDS,
    "fused_backend": FUSED_BACKENDS, "value_checks": VALUE_CHECK_MODES,
}
ENVIRONMENT: dict[str, str] = {
    "op_backend": "LINATTN_OP_BACKEND", "step_backend": "LINATTN_STEP_BACKEND",
    "shortconv_backend": "LINATTN_SHORTCONV_BACKEND", "fused_backend": "LINATTN_FUSED_BACKEND",
    "value_checks": "LINATTN_CHECK_VALUES", "fast_launch": "LINATTN_FAST_LAUNCH",
    "triton_launch": "LINATTN_TRITON_LAUNCH",
}
_MODE_ALIASES = {"1": "strict", "0": "off", "true": "strict", "false": "off", "on": "strict"}


@dataclass(frozen=True)
class Settings:
    """The switches in force (module docstring). ``triton_launch``: family -> {launch key: value}."""

    op_backend: str = "auto"
    step_backend: str = "auto"
    shortconv_backend: str = "auto"
    fused_backend: str = "auto"
    value_checks: str = "auto"
    fast_launch: bool = True
    triton_launch: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def check_setting(name: str, value: object) -> object:
    """``value`` for field ``name``, normalised (a bool for ``value_checks`` means strict / off); ValueError or
    TypeError naming the field and what it takes."""
    if name not in ENVIRONMENT:
        raise TypeError(f"unknown setting {name!r}; settings: {', '.join(ENVIRONMENT)}")
    if name == "value_checks" and isinstance(value, bool):
        return "strict" if value else "off"
    if name in CHOICES:
        if not isinstance(value, str) or value not in CHOICES[name]:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, CHOICES[name]))}; got {value!r}")
        return value
    if name == "fast_launch":
        if not isinstance(value, bool):
            raise TypeError(f"fast_launch must be a bool, got {type(value).__name__} {value!r}")
        return value
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise ValueError(f"triton_launch must map kernel families to mappings of launch keys, got {value!r}")
    return {str(family): dict(keys) for family, keys in value.items()}


def _from_text(name: str, raw: str) -> object:
    """Field ``name`` from the text of its environment variable."""
    var = ENVIRONMENT[name]
    if name == "value_checks":
        mode = _MODE_ALIASES.get(raw.strip().lower(), raw.strip().lower())
        if mode not in VALUE_CHECK_MODES:
            raise ValueError(f"{var} must be one of auto, strict (or 1), off (or 0); got {raw!r}")
        return mode
    if name == "fast_launch":
        if raw not in ("0", "1"):
            raise ValueError(f"{var} must be 0 or 1, got {raw!r}")
        return raw == "1"
    if name == "triton_launch":
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{var} must be a JSON object of families, got {raw!r}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"{var} must be a JSON object of families, got {raw!r}")
        bad = [f for f, keys in value.items() if not isinstance(keys, dict)]
        if bad:
            raise ValueError(f"{var}: the {bad[0]} entry must be a JSON object of launch keys, got {value[bad[0]]!r}")
        return value
    try:
        return check_setting(name, raw)
    except ValueError as exc:
        raise ValueError(f"{var}: {exc}") from None


def from_environment(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings the environment variables give (unset or empty: the default); ValueError naming a bad one."""
    env = os.environ if environ is None else environ
    return Settings(**{name: _from_text(name, env[var]) for name, var in ENVIRONMENT.items() if env.get(var)})


_state: Settings = from_environment()
_value_checks: ContextVar[str | None] = ContextVar("linattn_value_checks", default=None)
# the LAUNCH dicts of the Triton kernel modules, by family, and their values as written in the module
_launch_tables: dict[str, dict] = {}
_launch_written: dict[str, dict] = {}


def current() -> Settings:
    """The process-wide settings in force (``value_checks``: the process default; :func:`value_check_mode`
    gives the mode of this context)."""
    return _state


def value_check_mode() -> str:
    """The value-check mode in this thread / context: a :func:`settings` block's, else the process default."""
    mode = _value_checks.get()
    return _state.value_checks if mode is None else mode


def set_context_value_checks(mode: str | bool | None) -> object:
    """Set the value-check mode of this thread / context (None: follow the process default); a token for
    :func:`reset_context_value_checks`."""
    return _value_checks.set(None if mode is None else check_setting("value_checks", mode))


def reset_context_value_checks(token: object) -> None:
    _value_checks.reset(token)


def configure(**changes: object) -> Settings:
    """Change settings process-wide from now on (``value_checks``: the process default); returns the settings
    before the change."""
    global _state
    checked = {name: check_setting(name, value) for name, value in changes.items()}
    previous = _state
    if "triton_launch" in checked:
        _check_launch(checked["triton_launch"])
    _state = replace(_state, **checked)
    if "triton_launch" in checked:
        for family in _launch_tables:
            _apply_launch(family)
    return previous


def _restore(saved: Settings) -> None:
    global _state
    relaunch = saved.triton_launch != _state.triton_launch
    _state = saved
    if relaunch:
        for family in _launch_tables:
            _apply_launch(family)


@contextlib.contextmanager
def settings(**changes: object) -> Iterator[Settings]:
    """The settings ``changes`` inside the ``with`` block, restored after it (see the module docstring);
    yields the settings in force."""
    mode = changes.pop("value_checks", None)
    token = None if mode is None else set_context_value_checks(mode)
    try:
        saved = configure(**changes)
    except BaseException:
        if token is not None:
            reset_context_value_checks(token)
        raise
    try:
        yield _state
    finally:
        _restore(saved)
        if token is not None:
            reset_context_value_checks(token)


def register_launch(family: str, launch: dict) -> dict:
    """Make the ``LAUNCH`` dict of a Triton kernel family follow ``triton_launch`` (applied now, and again
    whenever the setting changes); returns ``launch``. Code may still change the dict directly (tuning tools
    do); a change of ``triton_launch`` restores the module's values before applying the new ones."""
    _launch_tables[family] = launch
    _launch_written[family] = dict(launch)
    _check_launch({family: _state.triton_launch.get(family, {})})
    _apply_launch(family)
    return launch


def _check_launch(launch: Mapping[str, Mapping[str, Any]]) -> None:
    for family, keys in launch.items():
        if family in _launch_written:
            unknown = sorted(set(keys) - set(_launch_written[family]))
            if unknown:
                raise ValueError(f"triton_launch: unknown {family} launch key(s) {unknown}; valid: "
                                 f"{sorted(_launch_written[family])}")


def _apply_launch(family: str) -> None:
    table = _launch_tables[family]
    table.clear()
    table.update(_launch_written[family])
    table.update(_state.triton_launch.get(family, {}))


__all__ = ["ENVIRONMENT", "Settings", "check_setting", "configure", "current", "from_environment",
           "register_launch", "settings", "value_check_mode"]
