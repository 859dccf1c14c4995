"""The delta family (delta_rule, gated_delta_rule, comba, gated_delta_product): recurrent == parallel ==
chunk (outputs, final states, every gradient), bf16, chunk sizes, splitting, stepping, identities
between the ops, long sequences with extreme gates, and input checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from linattn.ops.comba import comba, comba_step
from linattn.ops.common.matrix_scan import matrix_state_scan
from linattn.ops.delta_rule import delta_rule, delta_rule_step
from linattn.ops.gated_delta_product import gated_delta_product, gated_delta_product_step
from linattn.ops.gated_delta_rule import gated_delta_rule, gated_delta_rule_step
from linattn.testing import assert_close, check_backends_agree, grads, l2norm, log_gate, randn


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    step: Callable
    args: tuple[str, ...]  # positional arguments in order (initial_state is passed last, by keyword)
    n: int = 1  # sub-steps per token (num_householder); k, v, beta have T * n entries

    def per_substep(self, name: str) -> bool:
        return self.fn is gated_delta_product and name in ("k", "v", "beta")


CASES = [
    Case("delta_rule", delta_rule, delta_rule_step, ("q", "k", "v", "beta")),
    Case("gated_delta_rule", gated_delta_rule, gated_delta_rule_step, ("q", "k", "v", "g", "beta")),
    Case("comba", comba, comba_step, ("q", "k", "v", "p", "g", "beta")),
    Case("gated_delta_product", gated_delta_product, gated_delta_product_step, ("q", "k", "v", "g", "beta"), n=2),
]
IDS = [c.name for c in CASES]
SHAPES = [(1, 1, 1, 4, 4), (2, 7, 3, 5, 6), (1, 33, 2, 8, 3)]  # B, T, H, K, V


def make(case: Case, B: int, T: int, H: int, K: int, V: int, dtype=torch.float64, seed: int = 0,
         beta_max: float = 1.0) -> list[torch.Tensor]:
    """The case's positional inputs followed by an initial state (L2-normalised keys, beta in [0, beta_max))."""
    gen = torch.Generator().manual_seed(seed)
    Tn = T * case.n
    f64 = dict(dtype=torch.float64, generator=gen)
    x = dict(q=randn(B, T, H, K, **f64), k=l2norm(randn(B, Tn, H, K, **f64)), v=randn(B, Tn, H, V, **f64),
             g=log_gate(B, T, H, **f64), beta=beta_max * torch.rand(B, Tn, H, **f64))
    x["p"] = torch.sigmoid(randn(H, K, **f64)) * x["k"]  # Comba's read key p = d ⊙ k, d in (0, 1)
    s0 = randn(B, H, K, V, **f64)
    return [x[a].to(dtype) for a in case.args] + [s0.to(dtype)]


def run(case: Case, *xs: torch.Tensor | None, backend: str, chunk_size: int = 16, **kw):
    *args, s0 = xs
    return case.fn(*args, initial_state=s0, output_final_state=True, backend=backend, chunk_size=chunk_size, **kw)


def time_slice(case: Case, xs: list[torch.Tensor], a: int, b: int) -> list[torch.Tensor]:
    """Tokens a..b-1 of the case's positional inputs."""
    n = case.n
    return [x[:, a * n:b * n] if case.per_substep(name) else x[:, a:b] for name, x in zip(case.args, xs)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backends_agree(case, shape, with_state, dtype):
    xs = make(case, *shape, dtype=dtype)
    if not with_state:
        xs[-1] = None
    names = list(case.args) + ["s0"]
    if shape[1] == 1 and not with_state and "g" in names:
        # one token from a zero state: g has no effect, its exact gradient is 0 and a relative error is
        # meaningless; check the gradient of everything else (g is held constant).
        i = names.index("g")
        g = xs.pop(i)
        names.pop(i)
        fn = lambda *a, backend: run(case, *a[:i], g, *a[i:], backend=backend)
    else:
        fn = lambda *a, backend: run(case, *a, backend=backend)
    check_backends_agree(fn, xs, names, ["parallel", "chunk"], tol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_every_chunk_size(case, chunk_size):
    xs = make(case, 1, chunk_size // case.n + 3, 2, 6, 5, seed=1)  # two chunks, the second one padded
    check_backends_agree(lambda *a, backend: run(case, *a, backend=backend, chunk_size=chunk_size), xs,
                         list(case.args) + ["s0"], ["chunk"], tol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bfloat16_against_float32_recurrent(case):
    xs = make(case, 2, 45, 2, 16, 16, dtype=torch.bfloat16, seed=2)
    ref_out, ref_grad = grads(lambda *a: run(case, *a, backend="recurrent"), [x.float() for x in xs])
    for backend in ("recurrent", "parallel", "chunk"):
        out, grad = grads(lambda *a, b=backend: run(case, *a, backend=b), xs)
        assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32
        for i, (a, e) in enumerate(zip(out, ref_out)):
            assert_close(a, e, 5e-3, f"{backend} bf16 output {i}", metric="rmse")
        for name, a, e in zip(list(case.args) + ["s0"], grad, ref_grad):
            assert_close(a, e, 1e-2, f"{backend} bf16 grad of {name}", metric="rmse")


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_split_equals_full(case, backend):
    xs = make(case, 2, 21, 2, 4, 5, seed=3)
    o, s = run(case, *xs, backend="recurrent")
    o1, s1 = run(case, *time_slice(case, xs[:-1], 0, 8), xs[-1], backend=backend)
    o2, s2 = run(case, *time_slice(case, xs[:-1], 8, 21), s1, backend=backend)
    assert_close(torch.cat([o1, o2], 1), o, 1e-10, "split o")
    assert_close(s2, s, 1e-10, "split state")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_step_equals_recurrence(case):
    xs = make(case, 2, 9, 2, 4, 5, seed=4)
    o, s = run(case, *xs, backend="recurrent")
    state = xs[-1]
    for t in range(9):
        step_args = time_slice(case, xs[:-1], t, t + 1)
        step_args = [x if case.per_substep(name) else x[:, 0] for name, x in zip(case.args, step_args)]
        o_t, state = case.step(*step_args, state=state)
        assert_close(o_t, o[:, t], 1e-12, f"step {t}")
    assert_close(state, s, 1e-12, "step state")


def test_delta_rule_retrieves_what_it_just_wrote():
    """With beta = 1 and a unit key, S_t^T k_t = v_t exactly, whatever the state before (the delta rule's
    defining property); a hand-computed first step: S_1 = b k v^T, o_1 = b (q . k) v * scale."""
    q, k, v, beta, s0 = make(CASES[0], 1, 6, 2, 4, 3, seed=5)
    one = torch.ones_like(beta)
    for backend in ("recurrent", "parallel", "chunk"):
        o, _ = delta_rule(k, k, v, one, initial_state=s0, scale=1.0, backend=backend)
        assert_close(o, v, 1e-12, f"{backend}: S_t^T k_t = v_t")
    o, s = delta_rule(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], scale=0.5, output_final_state=True)
    b = beta[:, 0, :, None]
    assert_close(s, b[..., None] * k[:, 0, :, :, None] * v[:, 0, :, None, :], 1e-12, "S_1")
    assert_close(o[:, 0], 0.5 * b * (q[:, 0] * k[:, 0]).sum(-1, keepdim=True) * v[:, 0], 1e-12, "o_1")


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_identities_between_ops(backend):
    q, k, v, g, beta, s0 = make(CASES[1], 2, 19, 2, 6, 5, seed=6)
    kw = dict(initial_state=s0, output_final_state=True, backend=backend, chunk_size=16)
    ref = gated_delta_rule(q, k, v, g, beta, **kw)
    for what, got in [
        ("gated_delta_product(num_householder=1)", gated_delta_product(q, k, v, g, beta, num_householder=1, **kw)),
        ("comba(p=k)", comba(q, k, v, k, g, beta, **kw)),
    ]:
        assert_close(got[0], ref[0], 1e-12, f"{what} o")
        assert_close(got[1], ref[1], 1e-12, f"{what} state")
    got, ref = delta_rule(q, k, v, beta, **kw), gated_delta_rule(q, k, v, torch.zeros_like(g), beta, **kw)
    assert_close(got[0], ref[0], 1e-12, "gated_delta_rule(g=0) o")
    assert_close(got[1], ref[1], 1e-12, "gated_delta_rule(g=0) state")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_negative_eigenvalues(case):
    """beta in [0, 2] needs allow_neg_eigval=True; the backends agree there too."""
    xs = make(case, 1, 20, 2, 4, 4, seed=7, beta_max=2.0)
    with pytest.raises(ValueError, match=r"beta must have values in \[0, 1\].*allow_neg_eigval"):
        run(case, *xs, backend="chunk")
    check_backends_agree(lambda *a, backend: run(case, *a, backend=backend, allow_neg_eigval=True), xs,
                         list(case.args) + ["s0"], ["parallel", "chunk"], tol=1e-5)


def long_inputs(case: Case, T: int, g_value: float, beta_max: float) -> list[torch.Tensor]:
    xs = make(case, 1, T, 1, 16, 16, dtype=torch.float32, seed=8, beta_max=beta_max)
    return [torch.full_like(x, g_value) if name == "g" else x for name, x in zip(case.args, xs[:-1])] + xs[-1:]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("g_value", [0.0, -20.0])
def test_long_sequence_stays_finite(case, g_value):
    """T = 65536 with beta up to 2 (negative eigenvalues), no decay and extreme decay: chunk forward."""
    if case.name == "delta_rule" and g_value != 0.0:
        pytest.skip("delta_rule has no gate")
    with torch.no_grad():
        o, s = run(case, *long_inputs(case, 65536, g_value, beta_max=2.0), backend="chunk", chunk_size=64,
                   allow_neg_eigval=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert o.abs().max() < 1e3 and s.abs().max() < 1e3


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("g_value", [0.0, -20.0])
def test_long_sequence_recurrent_matches_chunk(case, g_value):
    """T = 65536 through the recurrence too; the chunk backend's gradients stay finite."""
    xs = [x.requires_grad_(True) for x in long_inputs(case, 65536, g_value, beta_max=2.0)]
    with torch.no_grad():
        o, s = run(case, *xs, backend="recurrent", allow_neg_eigval=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o2, s2 = run(case, *xs, backend="chunk", chunk_size=64, allow_neg_eigval=True)
    assert_close(o2, o, 1e-3, "chunk vs recurrent o at T=65536", metric="rmse")
    assert_close(s2, s, 1e-3, "chunk vs recurrent state at T=65536", metric="rmse")
    (o2.sum() + s2.sum()).backward()
    for name, x in zip(list(case.args) + ["s0"], xs):
        assert torch.isfinite(x.grad).all(), f"grad of {name} not finite"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bad_inputs(case):
    xs = make(case, 2, 5, 2, 4, 3, dtype=torch.float32)
    x = dict(zip(case.args, xs[:-1]))
    s0 = xs[-1]

    def call(**changes):
        args = [changes.get(a, x[a]) for a in case.args]
        kw = {k: val for k, val in changes.items() if k not in case.args}
        return case.fn(*args, **kw)

    bad = [
        (ValueError, "q must have shape", dict(q=x["q"][0])),
        (ValueError, "k must have", dict(k=x["k"][:, :-1])),
        (ValueError, "k must have", dict(k=x["k"][:, :, :1])),
        (ValueError, "v must have shape", dict(v=x["v"][:1])),
        (TypeError, "v must be a floating tensor", dict(v=x["v"].long())),
        (TypeError, "k must be a floating tensor", dict(k=x["k"].int())),
        (ValueError, "beta must have shape", dict(beta=x["beta"][:, :-1])),
        (ValueError, "beta must have shape", dict(beta=x["beta"][..., None])),
        (ValueError, r"beta must have values in \[0, 1\]", dict(beta=x["beta"] + 1.5)),
        (ValueError, r"beta must have values in \[0, 2\]", dict(beta=x["beta"] - 1.0, allow_neg_eigval=True)),
        (ValueError, "beta must have values", dict(beta=torch.full_like(x["beta"], float("nan")))),
        (TypeError, "allow_neg_eigval must be a bool", dict(allow_neg_eigval=1)),
        (ValueError, "backend", dict(backend="cuda-magic")),
        (ValueError, "initial_state", dict(initial_state=s0[:, :1])),
        (ValueError, "chunk_size", dict(chunk_size=0)),
    ]
    if "g" in case.args:
        bad += [(ValueError, "g must have shape", dict(g=x["g"][:, :-1])),
                (ValueError, "g must have shape", dict(g=x["g"][..., None])),
                (TypeError, "g must be a floating tensor", dict(g=x["g"].long()))]
    if "p" in case.args:
        bad += [(ValueError, "p must have shape", dict(p=x["p"][..., :-1])),
                (TypeError, "p must be a floating tensor", dict(p=x["p"].long()))]
    if case.name == "gated_delta_product":
        bad += [(ValueError, "num_householder must be a positive int", dict(num_householder=0)),
                (ValueError, "k must have shape", dict(num_householder=3))]
    for err, match, changes in bad:
        with pytest.raises(err, match=match):
            call(**changes)
    call()  # the unchanged inputs are fine


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bad_step_inputs(case):
    xs = make(case, 2, 1, 2, 4, 3, dtype=torch.float32)
    step_args = [x if case.per_substep(name) else x[:, 0] for name, x in zip(case.args, xs[:-1])]
    x = dict(zip(case.args, step_args))
    case.step(*step_args, state=xs[-1])
    with pytest.raises(ValueError, match="state"):
        case.step(*step_args, state=xs[-1][:, :1])
    with pytest.raises(ValueError, match="^beta "):
        case.step(*[x[a] + 2 if a == "beta" else x[a] for a in case.args], state=xs[-1])
    with pytest.raises(ValueError, match="^k "):
        case.step(*[x[a][:1] if a == "k" else x[a] for a in case.args], state=xs[-1])


def test_matrix_state_scan_gradcheck():
    """The hand-written backward of the chunk backends' state recurrence S_{n+1} = M_n S_n + R_n."""
    gen = torch.Generator().manual_seed(9)
    M = (0.5 * randn(4, 2, 3, 4, 4, dtype=torch.float64, generator=gen)).requires_grad_()
    R = randn(4, 2, 3, 4, 3, dtype=torch.float64, generator=gen).requires_grad_()
    S0 = randn(2, 3, 4, 3, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(matrix_state_scan, (M, R, S0))
    assert torch.autograd.gradcheck(lambda M, R: matrix_state_scan(M, R, None), (M, R))
    entering, S = [], S0
    for n in range(4):
        entering.append(S)
        S = M[n] @ S + R[n]
    got = matrix_state_scan(M, R, S0)
    assert_close(got[0], torch.stack(entering), 1e-14, "entering states")
    assert_close(got[1], S, 1e-14, "final state")
