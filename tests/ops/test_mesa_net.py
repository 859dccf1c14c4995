"""mesa_net: recurrent == parallel == chunk (outputs, (G, H) states, every gradient), bf16, splitting,
stepping, CG vs exact solve, long sequences, input checks."""

import pytest
import torch

from linattn.ops.mesa_net import mesa_net, mesa_net_step
from linattn.testing import assert_close, check_backends_agree, grads, l2norm, log_gate, randn

SHAPES = [(1, 1, 1, 4, 4), (2, 7, 3, 5, 6), (1, 33, 2, 8, 3), (2, 40, 2, 4, 4)]  # B, T, H, K, V
NAMES = ["q", "k", "v", "g", "beta", "lamb", "G0", "H0"]


def make(B, T, H, K, V, dtype=torch.float64, seed=0):
    """q, k (L2-normalised), v, g, beta in (0, 1), lamb in [0.5, 1.5), and a PSD initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(randn(B, T, H, K, dtype=torch.float64, generator=gen))
    k = l2norm(randn(B, T, H, K, dtype=torch.float64, generator=gen))
    v = randn(B, T, H, V, dtype=torch.float64, generator=gen)
    g = log_gate(B, T, H, dtype=torch.float64, generator=gen)
    beta = torch.sigmoid(randn(B, T, H, dtype=torch.float64, generator=gen))
    lamb = 0.5 + torch.rand(H, K, dtype=torch.float64, generator=gen)
    A = randn(B, H, K, K, dtype=torch.float64, generator=gen) / K
    G0 = A @ A.transpose(-1, -2)
    H0 = randn(B, H, K, V, dtype=torch.float64, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta, lamb, G0, H0)]


def run(q, k, v, g, beta, lamb, G0, H0, backend, chunk_size=16, **kw):
    """mesa_net with the state pair flattened, as check_backends_agree wants tensors."""
    state = None if G0 is None else (G0, H0)
    o, (G, Hs) = mesa_net(q, k, v, g, beta, lamb, initial_state=state, output_final_state=True,
                          backend=backend, chunk_size=chunk_size, **kw)
    return o, G, Hs


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backends_agree(shape, with_state, dtype):
    x = make(*shape, dtype=dtype)
    if not with_state:
        x[6:] = [None, None]
    check_backends_agree(run, x, NAMES, ["parallel", "chunk"], tol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_chunk_sizes(chunk_size):
    x = make(1, 131, 2, 4, 5, dtype=torch.float32, seed=1)
    check_backends_agree(lambda *a, backend: run(*a, backend=backend, chunk_size=chunk_size), x, NAMES,
                         ["chunk"], tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cg_steps", [3, 6])
def test_cg_backends_agree(dtype, cg_steps):
    """Also where many systems converge before the last step (float32: their later steps must not
    turn rounding noise into gradient noise)."""
    x = make(2, 45, 2, 6, 3, dtype=dtype, seed=2)
    x[5] = torch.ones_like(x[5])  # G_t + I has few distinct eigenvalues for small t: CG converges early
    check_backends_agree(lambda *a, backend: run(*a, backend=backend, solver="cg", cg_steps=cg_steps), x, NAMES,
                         ["parallel", "chunk"], tol=1e-5)


def test_cg_with_k_steps_matches_exact():
    x = make(2, 25, 2, 6, 4, dtype=torch.float64, seed=3)
    exact, exact_grad = grads(lambda *a: run(*a, backend="chunk"), x)
    for steps in (6, 9):
        cg, cg_grad = grads(lambda *a, steps=steps: run(*a, backend="chunk", solver="cg", cg_steps=steps), x)
        assert_close(cg[0], exact[0], 1e-8, f"cg_steps={steps} output")
        for name, a, e in zip(NAMES, cg_grad, exact_grad):
            if name == "G0":  # Cholesky reads G0 as symmetric: compare the symmetric parts
                a, e = a + a.transpose(-1, -2), e + e.transpose(-1, -2)
            assert_close(a, e, 1e-7, f"cg_steps={steps} grad of {name}")
    # fewer steps than K is an approximation, and measurably one
    few, _, _ = run(*x, backend="chunk", solver="cg", cg_steps=2)
    assert (few - exact[0]).abs().max() > 1e-4


def test_bf16_chunk_matches_fp32_recurrent():
    x = [t.to(torch.bfloat16) for t in make(2, 45, 2, 8, 8, dtype=torch.float64, seed=4)]
    ref_out, ref_grad = grads(lambda *a: run(*a, backend="recurrent"), [t.float() for t in x])
    for backend in ("chunk", "recurrent"):
        out, grad = grads(lambda *a, b=backend: run(*a, backend=b), x)
        assert_close(out[0], ref_out[0], 5e-3, f"bf16 {backend} output", metric="rmse")
        for name, a, e in zip(NAMES, grad, ref_grad):
            assert a.dtype == torch.bfloat16
            assert_close(a, e, 1e-2, f"bf16 {backend} grad of {name}", metric="rmse")


def test_split_and_step_equal_full():
    q, k, v, g, beta, lamb, G0, H0 = make(2, 23, 2, 4, 5, seed=5)
    o, s = mesa_net(q, k, v, g, beta, lamb, initial_state=(G0, H0), output_final_state=True, backend="recurrent")
    for t, backend in ((7, "chunk"), (16, "parallel"), (1, "chunk")):
        o1, s1 = mesa_net(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], lamb, initial_state=(G0, H0),
                          output_final_state=True, backend=backend, chunk_size=16)
        o2, s2 = mesa_net(q[:, t:], k[:, t:], v[:, t:], g[:, t:], beta[:, t:], lamb, initial_state=s1,
                          output_final_state=True, backend=backend, chunk_size=16)
        assert_close(torch.cat([o1, o2], 1), o, 1e-10, f"split at {t} ({backend}) o")
        assert_close(s2[0], s[0], 1e-10, "split G")
        assert_close(s2[1], s[1], 1e-10, "split H")
    state = (G0, H0)
    for t in range(23):
        o_t, state = mesa_net_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], lamb, state=state)
        assert_close(o_t, o[:, t], 1e-10, f"step {t}")
    assert_close(state[0], s[0], 1e-10, "step G")
    assert_close(state[1], s[1], 1e-10, "step H")
    o_t, _ = mesa_net_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], lamb)
    o0, _ = mesa_net(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], lamb, backend="recurrent")
    assert_close(o_t, o0[:, 0], 1e-12, "step from no state")


def test_output_is_the_ridge_regression_readout():
    """Without decay, H_t^T (G_t + diag(lamb))^-1 q is the ridge regression of v on k read at q."""
    q, k, v, _, _, lamb, _, _ = make(1, 9, 1, 3, 2, seed=6)
    beta, g = torch.ones(1, 9, 1, dtype=torch.float64), torch.zeros(1, 9, 1, dtype=torch.float64)
    o, _ = mesa_net(q, k, v, g, beta, lamb, scale=1.0, backend="chunk")
    Kt, Vt = k[0, :, 0], v[0, :, 0]
    Wr = torch.linalg.solve(Kt.T @ Kt + torch.diag(lamb[0]), Kt.T @ Vt)  # argmin ||K W - V||^2 + sum lamb W^2
    assert_close(o[0, -1, 0], q[0, -1, 0] @ Wr, 1e-10, "ridge read-out")


@pytest.mark.parametrize("g_value", [-20.0, 0.0])
def test_long_sequence_chunk_finite(g_value):
    T = 65536
    q, k, v, _, beta, lamb, _, _ = make(1, T, 1, 16, 16, dtype=torch.float32, seed=7)
    g = torch.full((1, T, 1), g_value)
    o, (G, Hs) = mesa_net(q, k, v, g, beta, lamb, output_final_state=True, backend="chunk")
    assert torch.isfinite(o).all() and torch.isfinite(G).all() and torch.isfinite(Hs).all()


@pytest.mark.slow
@pytest.mark.parametrize("g_value", [-20.0, 0.0])
def test_long_sequence_recurrent_finite(g_value):
    T = 65536
    q, k, v, _, beta, lamb, _, _ = make(1, T, 1, 16, 16, dtype=torch.float32, seed=7)
    g = torch.full((1, T, 1), g_value)
    o, (G, Hs) = mesa_net(q, k, v, g, beta, lamb, output_final_state=True, backend="recurrent")
    assert torch.isfinite(o).all() and torch.isfinite(G).all() and torch.isfinite(Hs).all()


def test_bad_inputs():
    q, k, v, g, beta, lamb, G0, H0 = make(1, 5, 2, 4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="g must have shape"):
        mesa_net(q, k, v, g[:, :4], beta, lamb)
    with pytest.raises(ValueError, match="beta must have shape"):
        mesa_net(q, k, v, g, beta[..., None], lamb)
    with pytest.raises(ValueError, match="lamb must have shape"):
        mesa_net(q, k, v, g, beta, lamb[0])
    with pytest.raises(ValueError, match="lamb must be > 0"):
        mesa_net(q, k, v, g, beta, -lamb)
    with pytest.raises(ValueError, match="beta must have values in"):
        mesa_net(q, k, v, g, -beta, lamb)
    with pytest.raises(ValueError, match="q must have shape"):
        mesa_net(q[0], k, v, g, beta, lamb)
    with pytest.raises(ValueError, match="v must have shape"):
        mesa_net(q, k, v[:, :4], g, beta, lamb)
    with pytest.raises(TypeError, match="k must be a floating tensor"):
        mesa_net(q, k.long(), v, g, beta, lamb)
    with pytest.raises(ValueError, match="backend"):
        mesa_net(q, k, v, g, beta, lamb, backend="cuda-magic")
    with pytest.raises(ValueError, match="solver"):
        mesa_net(q, k, v, g, beta, lamb, solver="lu")
    with pytest.raises(ValueError, match="cg_steps"):
        mesa_net(q, k, v, g, beta, lamb, solver="cg", cg_steps=0)
    with pytest.raises(TypeError, match="initial_state"):
        mesa_net(q, k, v, g, beta, lamb, initial_state=G0)
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(G\) must have shape"):
        mesa_net(q, k, v, g, beta, lamb, initial_state=(H0, H0))
    with pytest.raises(ValueError, match="chunk_size"):
        mesa_net(q, k, v, g, beta, lamb, chunk_size=0)
    with pytest.raises(ValueError, match="^beta must have shape"):
        mesa_net_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta, lamb)
    with pytest.raises(ValueError, match=r"state\[1\] \(H\) must have shape"):
        mesa_net_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], lamb, state=(G0, G0))


def test_convergence_tool():
    """The CG step counter behind docs/ops/mesa_ttt.md's table: plain and Jacobi-preconditioned CG both reach
    rounding level within K steps, and the residuals it reports are those of the systems it builds."""
    from linattn.ops.mesa_net.convergence import case_systems, residual_history, steps_to

    A, b = case_systems(40, 8, "none", "axes", 1.0)
    for jacobi in (False, True):
        h = residual_history(A, b, 8, jacobi)
        assert h.shape == (9, 40) and bool((h[0] == 1).all())
        assert float(h[-1].max()) < 1e-10
        assert isinstance(steps_to(h, 1e-4, 1.0), int)
    x = torch.linalg.solve(A, b[..., None])[..., 0]
    assert_close(A @ x[..., None], b[..., None], 1e-12, "systems")
