"""One calling convention for every op and its step.

For every registered op: one dict of keyword arguments (q, k, v and the op's per-token inputs by name, with
sequence shape [B, T, ...], plus shared options) calls the op; the step takes the same names, each tensor cut
to one token, plus the same options. The op's final state continues in the step and the step's state in the
op, and any such chain equals one long run.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from linattn.ops import MiniBatchState, get_op, list_ops

B, H, K, V = 2, 2, 8, 8
T = 13
TOL = dict(rtol=1e-5, atol=1e-5)  # float32, as the ops' own split and step tests

# options beyond scale that each op shares with its step (exercised where the op has them)
OPTIONS: dict[str, dict[str, Any]] = {
    "comba": {"allow_neg_eigval": True},
    "delta_rule": {"allow_neg_eigval": True},
    "forgetting_attn": {"window_size": 5, "rope": {"theta": 10000.0}},
    "gated_delta_product": {"num_householder": 2, "allow_neg_eigval": True},
    "gated_delta_rule": {"allow_neg_eigval": True},
    "linear_attn": {"feature_map": "elu", "normalize": True},
    "mesa_net": {"solver": "exact"},
    "softmax_attn": {"window_size": 5, "rope": {"theta": 10000.0}},
    "titans": {"mini_batch_size": 4},
    "ttt_linear": {"mini_batch_size": 4, "inner_norm": True},
}


def _inputs(name: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the per-token tensors [B, T*m, ...] by name, the shared keyword arguments: constant tensors and options)."""
    x = get_op(name).example_inputs(B, T, H, K, V, dtype=torch.float32, seed=seed)
    tokens = {n: t for n, t in x.items() if t.dim() >= 3}  # [B, T(*m), H, ...]; constants (mesa's lamb) are [H, K]
    shared = {n: t for n, t in x.items() if t.dim() < 3}
    shared.update(scale=0.7, **OPTIONS.get(name, {}))
    if name == "ttt_linear":
        gen = torch.Generator().manual_seed(seed + 1)
        shared.update(norm_weight=1 + 0.1 * torch.randn(H, V, generator=gen),
                      norm_bias=0.1 * torch.randn(H, V, generator=gen))
    return tokens, shared


def _cut(tokens: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Positions [start, stop) of every per-token tensor (an input of m T positions keeps m per token)."""
    return {n: x[:, start * (x.shape[1] // T):stop * (x.shape[1] // T)] for n, x in tokens.items()}


def _token(tokens: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    """Token t of every per-token tensor as a step takes it: x[:, t], or the token's m sub-steps x[:, t*m:(t+1)*m]."""
    out = {}
    for n, x in tokens.items():
        m = x.shape[1] // T
        out[n] = x[:, t] if m == 1 else x[:, t * m:(t + 1) * m]
    return out


def _steps(step, tokens: dict[str, torch.Tensor], shared: dict[str, Any], start: int, stop: int,
           state: Any) -> tuple[torch.Tensor, Any]:
    outs = []
    for t in range(start, stop):
        o_t, state = step(**_token(tokens, t), state=state, **shared)
        outs.append(o_t)
    return torch.stack(outs, dim=1), state


def _assert_states_close(a: Any, b: Any) -> None:
    if isinstance(a, MiniBatchState):
        a = a.current[0] if len(a.current) == 1 else a.current
    if isinstance(b, MiniBatchState):
        b = b.current[0] if len(b.current) == 1 else b.current
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, **TOL)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_states_close(x, y)
    else:  # a KVCache
        _assert_states_close((a.k, a.v, *[a.extras[n] for n in sorted(a.extras)]),
                             (b.k, b.v, *[b.extras[n] for n in sorted(b.extras)]))


def test_every_op_has_a_step_with_its_argument_names() -> None:
    for name in list_ops():
        spec = get_op(name)
        assert spec.step is not None, name
        op_params = inspect.signature(spec.fn).parameters
        step_params = inspect.signature(spec.step).parameters
        positional = [n for n, p in op_params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [n for n, p in step_params.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == positional, name
        assert step_params["state"].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert step_params["state"].default is None, name
        for option in step_params:  # every step option is the op's option of the same name
            assert option == "state" or option == "inplace" or option in op_params, (name, option)
        whole_sequence = {"initial_state", "output_final_state", "backend", "chunk_size", "cu_seqlens"}
        for option, p in op_params.items():  # and every option of the op that is not about whole sequences
            if p.kind is p.KEYWORD_ONLY and option not in whole_sequence:
                assert option in step_params, (name, option)
        for n in positional:  # an optional input (a gate) defaults to None in both
            assert op_params[n].default is step_params[n].default, (name, n)


@pytest.mark.parametrize("name", list_ops())
def test_step_matches_op_token_by_token(name: str) -> None:
    spec = get_op(name)
    tokens, shared = _inputs(name)
    o, final = spec.fn(**tokens, **shared, output_final_state=True)
    o_steps, state = _steps(spec.step, tokens, shared, 0, T, None)
    torch.testing.assert_close(o_steps, o, **TOL)
    _assert_states_close(state, final)


@pytest.mark.parametrize("name", list_ops())
def test_states_cross_between_op_and_step(name: str) -> None:
    """op [0, a) -> step [a, b) -> op [b, T) equals the op over [0, T); for the mini-batch learners a is a
    mini-batch boundary (the op closes its last mini-batch) and b is inside a mini-batch."""
    spec = get_op(name)
    tokens, shared = _inputs(name, seed=1)
    o, final = spec.fn(**tokens, **shared, output_final_state=True)
    a, b = (4, 6) if name in ("ttt_linear", "titans") else (5, 8)
    o1, s1 = spec.fn(**_cut(tokens, 0, a), **shared, output_final_state=True)
    o2, s2 = _steps(spec.step, tokens, shared, a, b, s1)
    o3, s3 = spec.fn(**_cut(tokens, b, T), **shared, initial_state=s2, output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2, o3], dim=1), o, **TOL)
    _assert_states_close(s3, final)


@pytest.mark.parametrize("name", ["ttt_linear", "titans"])
@pytest.mark.parametrize("split", [4, 5, 7, 8])
def test_mini_batch_step_state_continues_in_the_op(name: str, split: int) -> None:
    """The step's MiniBatchState after ``split`` tokens (mini_batch_size 4: at a boundary for 4 and 8, inside a
    mini-batch for 5 and 7) continues in the op exactly, on every PyTorch backend (the Triton one has its own
    tests), also when the op's tokens do not complete the mini-batch."""
    spec = get_op(name)
    tokens, shared = _inputs(name, seed=2)
    o, final = spec.fn(**tokens, **shared, output_final_state=True, backend="recurrent")
    o1, s1 = _steps(spec.step, tokens, shared, 0, split, None)
    assert isinstance(s1, MiniBatchState) and s1.count == split % 4
    for backend in (b for b in spec.backends if b != "triton"):
        o2, s2 = spec.fn(**_cut(tokens, split, T), **shared, initial_state=s1, output_final_state=True,
                         backend=backend)
        torch.testing.assert_close(torch.cat([o1, o2], dim=1), o, **TOL)
        _assert_states_close(s2, final)
        # one more token than the steps left to their mini-batch (or fewer) ends the op's call inside it
        short = split + 1
        o3, _ = spec.fn(**_cut(tokens, split, short), **shared, initial_state=s1, backend=backend)
        torch.testing.assert_close(o3, o[:, split:short], **TOL)


@pytest.mark.parametrize("name", ["ttt_linear", "titans"])
def test_mini_batch_step_state_with_packed_sequences(name: str) -> None:
    """A MiniBatchState of N rows inside a mini-batch continues N packed sequences (cu_seqlens) exactly."""
    spec = get_op(name)
    tokens, shared = _inputs(name, seed=3)
    _, s1 = _steps(spec.step, tokens, shared, 0, 5, None)
    rest = _cut(tokens, 5, T)
    o, final = spec.fn(**rest, **shared, initial_state=s1, output_final_state=True)
    packed = {n: x.reshape(1, B * x.shape[1], *x.shape[2:]) for n, x in rest.items()}
    cu = torch.tensor([0, T - 5, 2 * (T - 5)])
    o_packed, final_packed = spec.fn(**packed, **shared, initial_state=s1, output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(o_packed.reshape(o.shape), o, **TOL)
    _assert_states_close(final_packed, final)
