"""The decay family (linear_attn, retention, simple_gla, gla) through one set of checks:
recurrent == parallel == chunk (outputs, states, every gradient) in float64/float32, bf16 chunk and
parallel vs the float32 recurrence, every chunk size, split runs with the state carried, step
decoding, and long sequences with extreme gates."""

from dataclasses import dataclass, field

import pytest
import torch

from linattn.ops.common.registry import get_op
from linattn.ops.gla import gla, gla_step
from linattn.ops.linear_attn import linear_attn, linear_attn_step
from linattn.ops.retention import retention, retention_step
from linattn.ops.simple_gla import simple_gla, simple_gla_step
from linattn.testing import assert_close, check_backends_agree, grads, log_gate, randn


@dataclass
class Case:
    """One op (and its keywords) with the layout of its gate and state."""

    name: str
    op: object
    step: object
    gate: str | None = None  # None, "scalar" [B, T, H] or "vector" [B, T, H, K]
    kwargs: dict = field(default_factory=dict)
    feature_mult: int = 1  # state rows M = feature_mult * K
    extra_column: bool = False  # normaliser column in the state

    def make(self, B, T, H, K, V, dtype=torch.float64, seed=0, g_low=-0.5):
        """Inputs [q, k, v, (g,) s0] and their names; s0 in float32 at least (states are float32)."""
        gen = torch.Generator().manual_seed(seed)
        xs = [randn(B, T, H, K, dtype=dtype, generator=gen), randn(B, T, H, K, dtype=dtype, generator=gen),
              randn(B, T, H, V, dtype=dtype, generator=gen)]
        names = ["q", "k", "v"]
        if self.gate is not None:
            xs.append(log_gate(B, T, H, *((K,) if self.gate == "vector" else ()), dtype=dtype, generator=gen,
                               low=g_low))
            names.append("g")
        s_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        s0 = randn(B, H, self.feature_mult * K, V + int(self.extra_column), dtype=s_dtype, generator=gen)
        xs.append(s0.abs() if self.extra_column else s0)  # a positive normaliser keeps z^T phi(q) away from 0
        return xs, names + ["initial_state"]

    def run(self, *xs, backend="auto", chunk_size=16):
        *args, s0 = xs
        return self.op(*args, initial_state=s0, output_final_state=True, backend=backend, chunk_size=chunk_size,
                       **self.kwargs)

    def step_all(self, xs):
        """Decode token by token from the initial state; return (o [B, T, H, V], final state)."""
        *args, state = xs
        outs = []
        for t in range(args[0].shape[1]):
            o_t, state = self.step(*(a[:, t] for a in args), state=state, **self.kwargs)
            outs.append(o_t)
        return torch.stack(outs, 1), state


CASES = [
    Case("simple_gla", simple_gla, simple_gla_step, gate="scalar"),
    Case("gla", gla, gla_step, gate="vector"),
    Case("retention", retention, retention_step),
    Case("linear_attn", linear_attn, linear_attn_step),
    Case("linear_attn_elu_norm", linear_attn, linear_attn_step, kwargs=dict(feature_map="elu", normalize=True, eps=0.5),
         extra_column=True),  # eps ~ z^T phi(q): at T=1 without it the output is v and grad q is only noise
    Case("linear_attn_performer", linear_attn, linear_attn_step, kwargs=dict(feature_map="performer")),
    Case("linear_attn_fourier", linear_attn, linear_attn_step, kwargs=dict(feature_map="fourier"), feature_mult=2),
]
IDS = [c.name for c in CASES]
SHAPES = [(1, 1, 1, 4, 4), (2, 7, 3, 5, 6), (1, 45, 2, 8, 3)]  # B, T, H, K, V


def _without_state(xs, with_state):
    return xs if with_state else xs[:-1] + [None]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backends_agree(case, shape, with_state, dtype):
    xs, names = case.make(*shape, dtype=dtype)
    check_backends_agree(case.run, _without_state(xs, with_state), names, ["parallel", "chunk"], tol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_every_chunk_size(case, chunk_size):
    xs, names = case.make(2, 133, 2, 6, 5, seed=1)
    check_backends_agree(lambda *a, backend: case.run(*a, backend=backend, chunk_size=chunk_size), xs, names,
                         ["chunk"], tol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["chunk", "parallel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_against_float32_recurrence(case, backend, dtype):
    xs, names = case.make(2, 50, 2, 16, 8, dtype=dtype, seed=2)
    ref_out, ref_grad = grads(lambda *a: case.run(*a, backend="recurrent"), [x.float() for x in xs])
    out, grad = grads(lambda *a: case.run(*a, backend=backend), xs)
    assert out[0].dtype == dtype and out[1].dtype == torch.float32
    for i, (a, e) in enumerate(zip(out, ref_out)):
        assert_close(a, e, 5e-3, f"{case.name} {backend} {dtype} output {i}", metric="rmse")
    for name, a, e in zip(names, grad, ref_grad):
        assert_close(a, e, 1e-2, f"{case.name} {backend} {dtype} grad of {name}", metric="rmse")


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["chunk", "parallel", "recurrent"])
def test_split_with_state_carried_equals_full(case, backend):
    xs, _ = case.make(2, 53, 2, 5, 4, seed=3)
    o, s = case.run(*xs, backend="recurrent")
    *args, s0 = xs
    o1, s1 = case.run(*(a[:, :21] for a in args), s0, backend=backend)
    o2, s2 = case.run(*(a[:, 21:] for a in args), s1, backend=backend)
    assert_close(torch.cat([o1, o2], 1), o, 1e-10, f"{case.name} split o")
    assert_close(s2, s, 1e-10, f"{case.name} split state")


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("with_state", [False, True])
def test_step_equals_recurrence(case, with_state):
    xs, _ = case.make(2, 9, 3, 4, 5, seed=4)
    xs = _without_state(xs, with_state)
    o, s = case.run(*xs, backend="recurrent")
    o_steps, s_steps = case.step_all(xs)
    assert_close(o_steps, o, 1e-10, f"{case.name} steps o")
    assert_close(s_steps, s, 1e-10, f"{case.name} steps state")


GATED = [c for c in CASES if c.gate is not None]


@pytest.mark.parametrize("case", GATED, ids=[c.name for c in GATED])
@pytest.mark.parametrize("g_value", [-20.0, 0.0])
def test_long_sequence_chunk_stays_finite(case, g_value):
    xs, _ = case.make(1, 65536, 1, 16, 16, dtype=torch.float32, seed=5)
    xs[3] = torch.full_like(xs[3], g_value)
    o, s = case.run(*xs, backend="chunk", chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    if g_value == 0.0:  # no decay: the state is the plain sum of k v^T
        q, k, v, _, s0 = xs
        assert_close(s, s0 + torch.einsum("bthk,bthv->bhkv", k.double(), v.double()), 1e-4, "g=0 state")
    else:  # the state forgets everything but the last token: S_T = k_T v_T^T
        assert_close(s[0, 0], torch.outer(xs[1][0, -1, 0], xs[2][0, -1, 0]), 1e-6, "g=-20 state")


@pytest.mark.parametrize("case", GATED, ids=[c.name for c in GATED])
@pytest.mark.parametrize("g_value", [-20.0, 0.0])
def test_extreme_gates_chunk_gradients_finite(case, g_value):
    xs, names = case.make(1, 4096, 1, 16, 16, dtype=torch.float32, seed=6)
    xs[3] = torch.full_like(xs[3], g_value)
    _, gs = grads(lambda *a: case.run(*a, backend="chunk", chunk_size=128), xs)
    for name, gr in zip(names, gs):
        assert torch.isfinite(gr).all(), f"{case.name}: non-finite grad of {name}"


@pytest.mark.slow
@pytest.mark.parametrize("case", GATED, ids=[c.name for c in GATED])
@pytest.mark.parametrize("g_value", [-20.0, 0.0])
def test_long_sequence_recurrent_and_chunk_gradients(case, g_value):
    xs, names = case.make(1, 65536, 1, 16, 16, dtype=torch.float32, seed=5)
    xs[3] = torch.full_like(xs[3], g_value)
    o_r, s_r = case.run(*xs, backend="recurrent")
    o_c, s_c = case.run(*xs, backend="chunk")
    assert torch.isfinite(o_r).all() and torch.isfinite(s_r).all()
    assert_close(o_c, o_r, 1e-3, f"{case.name} long T chunk vs recurrent", metric="rmse")
    _, gs = grads(lambda *a: case.run(*a, backend="chunk"), xs)
    for name, gr in zip(names, gs):
        assert torch.isfinite(gr).all(), f"{case.name}: non-finite grad of {name}"


@pytest.mark.parametrize("case", GATED, ids=[c.name for c in GATED])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_exact_with_strong_random_gates(case, chunk_size):
    """Gates in [-20, 0): decays span exp(-20)..1 within one token, far beyond exp(-87) across a chunk."""
    xs, names = case.make(1, 100, 2, 6, 5, seed=7, g_low=-20.0)
    check_backends_agree(lambda *a, backend: case.run(*a, backend=backend, chunk_size=chunk_size), xs, names,
                         ["chunk"], tol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_auto_is_chunk_on_cpu_and_chunk_size_checked(case):
    xs, _ = case.make(1, 20, 1, 4, 4, dtype=torch.float32)
    o_auto, _ = case.run(*xs)
    o_chunk, _ = case.run(*xs, backend="chunk")
    assert torch.equal(o_auto, o_chunk)
    with pytest.raises(ValueError, match="chunk_size"):
        case.run(*xs, chunk_size=0)
    with pytest.raises(ValueError, match="backend"):
        case.run(*xs, backend="fast")


@pytest.mark.parametrize("name", ["linear_attn", "retention", "simple_gla", "gla"])
def test_registry_entries(name):
    spec = get_op(name)
    assert spec.family == "decay" and spec.step is not None and spec.fn is not None
    assert {"recurrent", "parallel", "chunk"} <= set(spec.backends)
    inputs = spec.example_inputs(1, 9, 2, 4, 3, seed=1)
    o, s = spec.fn(**inputs, output_final_state=True)
    o_r, s_r = spec.fn(**inputs, output_final_state=True, backend="recurrent")
    assert_close(o, o_r, 1e-5, f"{name} example inputs, auto vs recurrent")
    assert s.dtype == torch.float32 and s.shape[:2] == (1, 2)
