"""Packed variable-length sequences: for every op and backend, N sequences packed along time with cu_seqlens give
the outputs, final states and gradients of running each sequence alone (lengths odd, shorter and longer than a
chunk; with and without per-sequence initial states); bad offsets and states are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from linattn.ops import KVCache, get_op, list_ops
from linattn.testing import assert_same_gradients

H, K, V = 2, 4, 4
LENGTHS = (5, 1, 17)  # chunk_size 16: shorter than a chunk, a single token, longer than a chunk
CHUNK = 16
CASES = [(name, backend) for name in list_ops() for backend in get_op(name).backends]


def _map(fn, x: object) -> object:
    """``x`` (a tensor, tuple, list or dataclass state) with ``fn`` applied to every tensor."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, item) for item in x)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: _map(fn, getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, dict):
        return {key: _map(fn, item) for key, item in x.items()}
    return x


def _leaves(x: object) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(found.append, x)
    return found


def _initial_states(name: str, N: int) -> object:
    """Per-sequence initial states in the packed layout: rows of a state the op itself returned."""
    spec = get_op(name)
    _, state = spec.fn(**spec.example_inputs(N, 3, H, K, V, seed=7), output_final_state=True)
    state = _map(lambda t: t.detach().clone(), state)
    if isinstance(state, KVCache):  # one cache per sequence
        return [_map(lambda t, i=i: t[i:i + 1].clone().requires_grad_(), state) for i in range(N)]
    return _map(lambda t: t.requires_grad_(), state)


def _row(state: object, i: int) -> object:
    if isinstance(state, list):
        return state[i]
    return _map(lambda t: t[i:i + 1], state)


def _loss(o: torch.Tensor, state: object) -> torch.Tensor:
    """A loss reading every output and state entry with distinct weights (so a misplaced gradient shows)."""
    total = (o * torch.linspace(-1, 1, o.numel(), device=o.device).reshape(o.shape)).sum()
    for t in _leaves(state):
        total = total + (t * torch.linspace(0.5, -0.5, t.numel(), device=t.device).reshape(t.shape)).sum()
    return total


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("name,backend", CASES)
def test_packed_equals_separate(name: str, backend: str, with_state: bool) -> None:
    spec = get_op(name)
    T, N = sum(LENGTHS), len(LENGTHS)
    # Triton kernels run on the GPU where there is one (the interpreter only runs without: tests/conftest.py)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    inputs = {a: x.to(device).requires_grad_() for a, x in spec.example_inputs(1, T, H, K, V, seed=3).items()}
    init = _map(lambda t: t.detach().to(device).requires_grad_(), _initial_states(name, N)) if with_state else None
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(backend=backend, chunk_size=CHUNK, output_final_state=True)
    leaves = [x for x in inputs.values()] + _leaves(init)

    o, final = spec.fn(**inputs, initial_state=init, cu_seqlens=cu, **kw)

    outs, finals = [], []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        # token arguments have time at dim 1 (m positions per token: gated_delta_product's interleaved keys)
        alone = {a: x[:, s * (x.shape[1] // T):e * (x.shape[1] // T)] if x.dim() >= 3 else x
                 for a, x in inputs.items()}
        o_i, f_i = spec.fn(**alone, initial_state=None if init is None else _row(init, i), **kw)
        outs.append(o_i)
        finals.append(f_i)
    o_ref = torch.cat(outs, dim=1)
    if isinstance(final, list):
        assert len(final) == N and all(isinstance(f, KVCache) for f in final)
        final_ref = finals
    else:
        final_ref = _cat_rows(finals)

    assert o.shape == o_ref.shape
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(_leaves(final), _leaves(final_ref), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_same_gradients(_loss(o, final), _loss(o_ref, final_ref), leaves, rtol=1e-5, atol=1e-5)


def _cat_rows(states: list[object]) -> object:
    first = states[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(states, dim=0)
    return type(first)(_cat_rows([s[j] for s in states]) for j in range(len(first)))


def _call(name: str, cu: object, T: int = 6, B: int = 1, **kw: object) -> tuple:
    spec = get_op(name)
    return spec.fn(**spec.example_inputs(B, T, H, K, V), cu_seqlens=cu, **kw)


@pytest.mark.parametrize(
    "cu,error,match",
    [
        ([0, 2, 6], None, None),
        ([1, 2, 6], ValueError, r"cu_seqlens must start at 0, got 1"),
        ([0, 2, 5], ValueError, r"cu_seqlens must end at the packed length T = 6, got 5"),
        ([0, 4, 2, 6], ValueError, r"cu_seqlens must be strictly increasing .* cu_seqlens\[1\] = 4 and "),
        ([0, 2, 2, 6], ValueError, r"cu_seqlens must be strictly increasing \(empty sequences are refused\)"),
        ([6], ValueError, r"cu_seqlens must be 1-D with N\+1 >= 2 offsets"),
        ([[0, 6]], ValueError, r"cu_seqlens must be 1-D with N\+1 >= 2 offsets"),
    ],
)
def test_bad_offsets_are_named(cu: list, error: type | None, match: str | None) -> None:
    for dtype in (torch.int32, torch.int64):
        offsets = torch.tensor(cu, dtype=dtype)
        if error is None:
            o, _ = _call("gated_delta_rule", offsets)
            assert o.shape == (1, 6, H, V)
        else:
            with pytest.raises(error, match=match):
                _call("gated_delta_rule", offsets)


@pytest.mark.parametrize("name", list_ops())
def test_every_op_refuses_bad_packing(name: str) -> None:
    with pytest.raises(TypeError, match=r"cu_seqlens must have dtype int32 or int64, got torch.float32"):
        _call(name, torch.tensor([0.0, 6.0]))
    with pytest.raises(TypeError, match=r"cu_seqlens must be a 1-D int32 or int64 tensor .* got list"):
        _call(name, [0, 6])
    with pytest.raises(ValueError, match=r"q must have batch size B = 1 with cu_seqlens"):
        _call(name, torch.tensor([0, 6], dtype=torch.int32), B=2)
    with pytest.raises(ValueError, match=r"cu_seqlens must end at the packed length T = 6"):
        _call(name, torch.tensor([0, 3, 7], dtype=torch.int32))


@pytest.mark.parametrize("name", list_ops())
def test_initial_state_needs_one_row_per_sequence(name: str) -> None:
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    init = _initial_states(name, 3)  # three rows for two sequences
    if isinstance(init, list):
        with pytest.raises(ValueError, match=r"initial_state with cu_seqlens must hold N = 2 states .* got 3"):
            _call(name, cu, initial_state=init)
        with pytest.raises(TypeError, match=r"initial_state with cu_seqlens must be a list of N = 2 KVCaches"):
            _call(name, cu, initial_state=init[0])
    else:
        with pytest.raises(ValueError, match=r"initial_state with cu_seqlens must have N = 2 sequences along dim 0"):
            _call(name, cu, initial_state=init)


def test_offsets_on_another_device_are_named() -> None:
    with pytest.raises(ValueError, match=r"cu_seqlens must be on the CPU or on q's device cpu, got meta"):
        _call("simple_gla", torch.tensor([0, 6], dtype=torch.int32, device="meta"))


def test_a_packed_call_without_offsets_is_unchanged() -> None:
    spec = get_op("gla")
    x = spec.example_inputs(2, 5, H, K, V)
    o, s = spec.fn(**x, output_final_state=True)
    o2, s2 = spec.fn(**x, output_final_state=True, cu_seqlens=None)
    assert torch.equal(o, o2) and torch.equal(s, s2)
