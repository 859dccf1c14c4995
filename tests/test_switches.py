"""linattn.settings / configure / current: one surface for the op, step, ShortConv and fused backends, value
checks and Triton launches; the older per-switch functions read and write the same settings."""

from __future__ import annotations

import threading

import pytest
import torch

import linattn
from linattn import switches
from linattn.layers import ShortConv, fused, set_shortconv_backend
from linattn.ops import get_op, get_step_backend, set_step_backend
from linattn.ops.common import values


def test_a_block_changes_settings_and_restores_them():
    before = linattn.current()
    with linattn.settings(step_backend="torch", shortconv_backend="conv1d", fused_backend="torch",
                          op_backend="recurrent", fast_launch=False) as inside:
        assert inside is linattn.current()
        assert (inside.step_backend, inside.shortconv_backend, inside.fused_backend, inside.op_backend,
                inside.fast_launch) == ("torch", "conv1d", "torch", "recurrent", False)
        assert get_step_backend() == "torch"
    assert linattn.current() == before


def test_a_block_is_restored_when_it_raises():
    before = linattn.current()
    with pytest.raises(RuntimeError, match="inside"):
        with linattn.settings(step_backend="torch", value_checks="off"):
            raise RuntimeError("inside")
    assert linattn.current() == before and values.value_check_mode() == "auto"


def test_configure_returns_the_previous_settings_and_the_old_functions_share_them():
    previous = linattn.configure(step_backend="torch")
    try:
        assert previous.step_backend == "auto" and get_step_backend() == "torch"
        assert set_step_backend("triton") == "torch" and linattn.current().step_backend == "triton"
        fused.set_fused_backend("torch")
        assert linattn.current().fused_backend == "torch"
    finally:
        linattn.configure(step_backend=previous.step_backend, fused_backend=previous.fused_backend)


@pytest.mark.parametrize("name, value, error, match", [
    ("step_backend", "fast", ValueError, "step_backend must be one of 'auto', 'torch', 'triton'; got 'fast'"),
    ("op_backend", "cuda", ValueError, "op_backend must be one of 'auto', 'recurrent', 'parallel'"),
    ("shortconv_backend", 1, ValueError, "shortconv_backend must be one of"),
    ("value_checks", "sometimes", ValueError, "value_checks must be one of 'auto', 'strict', 'off'"),
    ("fast_launch", "0", TypeError, "fast_launch must be a bool, got str '0'"),
    ("triton_launch", {"gla": 4}, ValueError, "triton_launch must map kernel families to mappings"),
    ("backend", "chunk", TypeError, "unknown setting 'backend'"),
])
def test_bad_values_name_the_setting(name, value, error, match):
    before = linattn.current()
    with pytest.raises(error, match=match):
        with linattn.settings(**{name: value}):
            pass
    assert linattn.current() == before


def test_the_environment_gives_the_starting_values():
    env = {"LINATTN_OP_BACKEND": "chunk", "LINATTN_STEP_BACKEND": "torch", "LINATTN_SHORTCONV_BACKEND": "muladd",
           "LINATTN_FUSED_BACKEND": "triton", "LINATTN_CHECK_VALUES": "0", "LINATTN_FAST_LAUNCH": "0",
           "LINATTN_TRITON_LAUNCH": '{"gla": {"num_warps": 2}}'}
    assert switches.from_environment(env) == switches.Settings("chunk", "torch", "muladd", "triton", "off", False,
                                                              {"gla": {"num_warps": 2}})
    assert set(env) == set(switches.ENVIRONMENT.values()), "every setting has its variable"
    assert switches.from_environment({}) == switches.Settings()
    with pytest.raises(ValueError, match="LINATTN_STEP_BACKEND: step_backend must be one of"):
        switches.from_environment({"LINATTN_STEP_BACKEND": "fast"})
    with pytest.raises(ValueError, match="LINATTN_FAST_LAUNCH must be 0 or 1, got 'no'"):
        switches.from_environment({"LINATTN_FAST_LAUNCH": "no"})


def test_op_backend_chooses_what_auto_calls_run():
    gla, ttt = get_op("gla"), get_op("ttt_linear")
    cpu = torch.device("cpu")
    assert gla.resolve("auto", cpu) is gla.implementations["chunk"]
    with linattn.settings(op_backend="recurrent"):
        assert gla.resolve("auto", cpu) is gla.implementations["recurrent"]
        assert gla.resolve("parallel", cpu) is gla.implementations["parallel"], "an explicit backend= wins"
    with linattn.settings(op_backend="parallel"):  # ttt_linear has no parallel form: its own "auto"
        assert ttt.resolve("auto", cpu) is ttt.implementations["chunk"]


def test_op_backend_reaches_the_op_call(monkeypatch):
    calls = []
    gla = get_op("gla")
    recurrent = gla.implementations["recurrent"]
    monkeypatch.setitem(gla.implementations, "recurrent", lambda *a, **k: calls.append(1) or recurrent(*a, **k))
    q = torch.randn(1, 5, 1, 4)
    g = -torch.rand(1, 5, 1, 4)
    with linattn.settings(op_backend="recurrent"):
        linattn.ops.gla(q, q, q, g)
    assert calls == [1]


def test_shortconv_follows_the_setting_unless_an_instance_sets_its_own():
    conv, other = ShortConv(8), ShortConv(8)
    x = torch.randn(2, 5, 8)
    assert conv._resolved_backend(x) == "muladd", "auto on the CPU"
    with linattn.settings(shortconv_backend="conv1d"):
        assert conv._resolved_backend(x) == "conv1d"
        assert set_shortconv_backend(torch.nn.Sequential(other), "muladd") == 1
        assert other._resolved_backend(x) == "muladd"
        y_conv1d, _ = conv(x)
    y_muladd, _ = conv(x)
    assert torch.allclose(y_conv1d, y_muladd, atol=1e-6)


def test_fused_backend_decides_the_fused_kernels():
    x = torch.randn(2, 3)
    with linattn.settings(fused_backend="triton"):
        assert fused.use_fused_kernels(x)
    with linattn.settings(fused_backend="torch"):
        assert not fused.use_fused_kernels(x)
    assert not fused.use_fused_kernels(x), "auto: CUDA tensors only"


def test_value_checks_in_a_block_hold_for_this_thread_only():
    seen = {}
    with linattn.settings(value_checks="off"):
        assert values.value_check_mode() == "off" and not values.value_checks_enabled(torch.zeros(1))
        worker = threading.Thread(target=lambda: seen.update(mode=values.value_check_mode()))
        worker.start()
        worker.join()
    assert seen["mode"] == "auto", "another thread keeps the process default"
    assert values.value_check_mode() == "auto"
