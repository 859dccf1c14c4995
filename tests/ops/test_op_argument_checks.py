"""Every public op and its step refuse, with an error naming the argument, an ``output_final_state`` that is not a
bool, a scale that is not None or a finite number > 0, a tensor on another device than q, and an absurd
chunk_size; valid calls still run. Inputs come from each op's ``OpSpec.example_inputs``; a tensor on the "meta"
device stands in for one on another GPU (the checks compare ``.device`` only, so they never read it)."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from linattn.ops import get_op, list_ops
from linattn.ops.common.checks import CHUNK_SIZES, MAX_CHUNK_SIZE, check_chunk_size
from linattn.testing import step_inputs

B, T, H, K, V = 1, 3, 2, 4, 4
OPS = list_ops()
BAD_SCALES = [math.nan, math.inf, -math.inf, 0.0, -0.5, 0]
SCALE_ERROR = r"scale must be None \(K\^-1/2\) or a finite number > 0"


def _op_inputs(name: str) -> dict[str, torch.Tensor]:
    return get_op(name).example_inputs(B, T, H, K, V)


def _step_inputs(name: str) -> dict[str, torch.Tensor]:
    return step_inputs(name, B, H, K, V)


def _to(x: object, device: str) -> object:
    """A state (tensor, tuple, dict, KVCache, MiniBatchState) with every tensor moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(item, device) for item in x)
    if isinstance(x, dict):
        return {key: _to(item, device) for key, item in x.items()}
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: _to(getattr(x, f.name), device) for f in dataclasses.fields(x)})
    return x


def _device_error(name: str, ref: str) -> str:
    return rf"^{re.escape(name)}\S* must be on {ref}'s device cpu, got meta$"


@pytest.mark.parametrize("name", OPS)
def test_valid_calls_still_run(name: str) -> None:
    spec = get_op(name)
    o, state = spec.fn(**_op_inputs(name), scale=0.5, output_final_state=True, chunk_size=16)
    assert torch.isfinite(o).all() and state is not None
    o_t, _ = spec.step(**_step_inputs(name), scale=2)  # an int scale is a number
    assert torch.isfinite(o_t).all()


@pytest.mark.parametrize("name", OPS)
def test_output_final_state_must_be_a_bool(name: str) -> None:
    for value in ("yes", 1, None):
        with pytest.raises(TypeError, match="output_final_state must be a bool"):
            get_op(name).fn(**_op_inputs(name), output_final_state=value)


@pytest.mark.parametrize("name", OPS)
def test_scale_must_be_finite_and_positive(name: str) -> None:
    spec = get_op(name)
    for scale in BAD_SCALES:
        with pytest.raises(ValueError, match=SCALE_ERROR):
            spec.fn(**_op_inputs(name), scale=scale)
        with pytest.raises(ValueError, match=SCALE_ERROR):
            spec.step(**_step_inputs(name), scale=scale)
    for scale in (True, "0.5"):
        with pytest.raises(TypeError, match=SCALE_ERROR):
            spec.fn(**_op_inputs(name), scale=scale)
        with pytest.raises(TypeError, match=SCALE_ERROR):
            spec.step(**_step_inputs(name), scale=scale)


@pytest.mark.parametrize("name", OPS)
def test_every_tensor_argument_must_be_on_q_device(name: str) -> None:
    spec = get_op(name)
    x = _op_inputs(name)
    for arg in x:
        if arg != "q":
            with pytest.raises(ValueError, match=_device_error(arg, "q")):
                spec.fn(**{**x, arg: x[arg].to("meta")})
    _, final = spec.fn(**x, output_final_state=True)
    with pytest.raises(ValueError, match=_device_error("initial_state", "q")):
        spec.fn(**x, initial_state=_to(final, "meta"))

    xt = _step_inputs(name)
    for arg in xt:
        if arg != "q":
            with pytest.raises(ValueError, match=_device_error(arg, "q")):
                spec.step(**{**xt, arg: xt[arg].to("meta")})
    _, state = spec.step(**xt)
    with pytest.raises(ValueError, match=_device_error("state", "q")):
        spec.step(**xt, state=_to(state, "meta"))


@pytest.mark.parametrize("name", OPS)
def test_absurd_chunk_size_is_refused_before_any_allocation(name: str) -> None:
    for chunk_size in (2**20, MAX_CHUNK_SIZE + 1, 0, True, 16.0):
        with pytest.raises(ValueError, match=rf"chunk_size must be an int in \[1, {MAX_CHUNK_SIZE}\].*got"):
            get_op(name).fn(**_op_inputs(name), chunk_size=chunk_size)


def test_every_chunk_size_that_worked_keeps_working() -> None:
    for chunk_size in (1, 4, 48, *CHUNK_SIZES, 1000, MAX_CHUNK_SIZE):
        assert check_chunk_size(chunk_size) == chunk_size
