"""Batches whose rows times heads exceed a launch grid's axis (CUDA: 65,535) run as slices of rows: for every op and
backend, with the limit lowered, the outputs, final states and gradients equal one whole call's."""

from __future__ import annotations

import pytest
import torch
from test_cu_seqlens import _leaves, _loss, _map

import linattn.ops.common.batch_slices as batch_slices
from linattn.ops import KVCache, get_op, list_ops
from linattn.testing import assert_same_gradients

B, T, H, K, V = 5, 7, 2, 4, 4
CASES = [(name, backend) for name in list_ops() for backend in get_op(name).backends]


def _initial_state(name: str, device: str) -> object:
    """A state the op itself returned for B rows (a KVCache for the softmax family), as leaves."""
    spec = get_op(name)
    _, state = spec.fn(**spec.example_inputs(B, 3, H, K, V, seed=7), output_final_state=True)
    return _map(lambda t: t.detach().to(device).requires_grad_(), state)


@pytest.mark.parametrize("name,backend", CASES)
def test_row_slices_equal_one_call(name: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_op(name)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    inputs = {a: x.to(device).requires_grad_() for a, x in spec.example_inputs(B, T, H, K, V, seed=3).items()}
    init = _initial_state(name, device)
    leaves = list(inputs.values()) + _leaves(init)
    kw = dict(backend=backend, chunk_size=16, output_final_state=True)

    o_ref, final_ref = spec.fn(**inputs, initial_state=init, **kw)
    calls = []
    implementation = spec.implementations[backend]
    monkeypatch.setitem(spec.implementations, backend,
                        lambda q, *a, **k: calls.append(q.shape[0]) or implementation(q, *a, **k))
    monkeypatch.setattr(batch_slices, "GRID_LIMIT", 4)  # 2 rows of 2 heads a call: rows 0-1, 2-3, 4
    o, final = spec.fn(**inputs, initial_state=init, **kw)

    assert calls == [2, 2, 1]
    assert type(final) is type(final_ref) and (not isinstance(final, KVCache) or final.length == final_ref.length)
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(_leaves(final), _leaves(final_ref), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert_same_gradients(_loss(o, final), _loss(o_ref, final_ref), leaves, rtol=1e-6, atol=1e-6)


def test_one_call_below_the_limit_and_for_packed_rows() -> None:
    q = torch.zeros(4, 3, 2, 8)
    assert batch_slices.rows_per_call(q) is None  # 8 rows x heads
    assert batch_slices.rows_per_call(torch.zeros(40000, 1, 2, 8)) == 32767
    assert batch_slices.rows_per_call("not a tensor") is None


def test_a_state_of_the_wrong_batch_is_named_with_the_call_s_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_op("gated_delta_rule")
    inputs = spec.example_inputs(B, T, H, K, V)
    monkeypatch.setattr(batch_slices, "GRID_LIMIT", 4)
    expected = r"initial_state must have shape \[B, H, K, V\] = \[5, 2, 4, 4\], got shape \[6, 2, 4, 4\]"
    with pytest.raises(ValueError, match=expected):
        spec.fn(**inputs, initial_state=torch.zeros(B + 1, H, K, V))
