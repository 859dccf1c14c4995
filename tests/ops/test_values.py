"""The value-check switch: value_checks(False), set_value_checks and LINATTN_CHECK_VALUES=0 turn range
checks off (a delta rule's beta outside [0, 1] then passes); the switch is restored after the block."""

from __future__ import annotations

import contextvars

import pytest
import torch

from linattn import switches
from linattn.ops.common import values
from linattn.ops.gated_delta_rule import gated_delta_rule
from linattn.testing import l2norm, log_gate, randn

B, T, H, K = 1, 6, 2, 4


def _call(beta_value: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    q, k, v = randn(B, T, H, K, generator=g), l2norm(randn(B, T, H, K, generator=g)), randn(B, T, H, K, generator=g)
    o, _ = gated_delta_rule(q, k, v, log_gate(B, T, H, generator=g), torch.full((B, T, H), beta_value),
                            backend="recurrent")
    return o


def test_checks_are_on_by_default_and_reject_beta_out_of_range():
    assert values.value_checks_enabled()
    with pytest.raises(ValueError, match=r"beta must have values in \[0, 1\], got values in \[1.5, 1.5\]"):
        _call(1.5)


def test_value_checks_false_lets_the_call_through_and_restores_the_switch():
    with values.value_checks(False):
        assert not values.value_checks_enabled()
        o = _call(1.5)
    assert o.shape == (B, T, H, K) and torch.isfinite(o).all()
    assert values.value_checks_enabled(), "the switch is back on after the block"
    with pytest.raises(ValueError, match="beta must have values"):
        _call(1.5)


def test_the_switch_is_restored_after_an_exception_and_blocks_nest():
    with pytest.raises(RuntimeError, match="inside"):
        with values.value_checks(False):
            raise RuntimeError("inside")
    assert values.value_checks_enabled()
    with values.value_checks(False):
        with values.value_checks(True):
            assert values.value_checks_enabled()
            with pytest.raises(ValueError, match="beta must have values"):
                _call(1.5)
        assert not values.value_checks_enabled(), "the outer block's setting is back"
    assert values.value_checks_enabled()


def test_set_value_checks_turns_them_off_for_this_context_only():
    def off_then_call() -> torch.Tensor:
        values.set_value_checks(False)
        return _call(1.5)

    o = contextvars.copy_context().run(off_then_call)  # a copy: this test's context keeps checks on
    assert torch.isfinite(o).all()
    assert values.value_checks_enabled()
    previous = values.value_check_mode()
    values.set_value_checks(False)
    try:
        assert torch.isfinite(_call(1.5)).all()
    finally:
        values.set_value_checks(previous)  # not True ("strict"): later tests expect the default mode
    with pytest.raises(ValueError, match="beta must have values"):
        _call(1.5)


def test_switch_arguments_must_be_modes_or_bools():
    with pytest.raises(TypeError, match="enabled must be one of 'auto', 'strict', 'off' or a bool.*got int 0"):
        values.set_value_checks(0)
    with pytest.raises(TypeError, match="enabled must be one of"):
        with values.value_checks("no"):
            pass
    assert values.value_checks_enabled()


def test_auto_mode_checks_cpu_tensors_and_skips_cuda_ones_strict_checks_both():
    cpu = torch.zeros(3)
    assert values.value_check_mode() == "auto"
    assert values.value_checks_enabled(cpu) and values.value_checks_enabled(torch.empty(3, device="meta"))

    class OnCuda:  # value_checks_enabled reads only .device (no GPU here to make a real CUDA tensor)
        device = torch.device("cuda", 0)

    assert not values.value_checks_enabled(OnCuda()), "auto: no host synchronisation for CUDA tensors"
    with values.value_checks("strict"):
        assert values.value_checks_enabled(OnCuda())
    with values.value_checks(True):
        assert values.value_check_mode() == "strict"
    with values.value_checks("off"):
        assert not values.value_checks_enabled(cpu)


@pytest.mark.parametrize("raw, mode", [("auto", "auto"), ("1", "strict"), ("strict", "strict"), ("0", "off"),
                                       ("off", "off")])
def test_environment_variable_sets_the_default_mode(raw, mode):
    assert switches.from_environment({"LINATTN_CHECK_VALUES": raw}).value_checks == mode
    with pytest.raises(ValueError, match="LINATTN_CHECK_VALUES must be one of"):
        switches.from_environment({"LINATTN_CHECK_VALUES": "sometimes"})


@pytest.mark.parametrize("mode, enabled", [("off", False), ("strict", True)])
def test_the_process_default_sets_the_mode(mode, enabled):
    previous = switches.configure(value_checks=mode)  # what LINATTN_CHECK_VALUES sets at import
    try:
        # a fresh context: no mode set by a block or set_value_checks, so the process default holds
        contextvars.Context().run(_default_mode_holds, enabled)
    finally:
        switches.configure(value_checks=previous.value_checks)
    assert values.value_checks_enabled()


def _default_mode_holds(enabled: bool) -> None:
    assert values.value_checks_enabled() is enabled
    if enabled:
        with pytest.raises(ValueError, match="beta must have values"):
            _call(1.5)
    else:
        assert torch.isfinite(_call(1.5)).all()
        with values.value_checks(True):
            with pytest.raises(ValueError, match="beta must have values"):
                _call(1.5)
