"""ttt_linear: recurrent == chunk (outputs, final W, every gradient), the inner norm, bf16, splitting,
stepping, the dual form and the delta-rule identity, long sequences, input checks."""

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.ttt import MiniBatchState, ttt_linear, ttt_linear_step
from linattn.ops.ttt.inner import InnerNorm, error
from linattn.testing import assert_close, check_backends_agree, grads, l2norm, randn

SHAPES = [(1, 1, 1, 4, 4), (2, 7, 3, 5, 6), (1, 33, 2, 8, 3), (2, 40, 2, 4, 4)]  # B, T, H, K, V
NAMES = ["q", "k", "v", "eta", "W0", "norm_weight", "norm_bias"]


def make(B, T, H, K, V, dtype=torch.float64, seed=0):
    """q, k (L2-normalised), v, eta in (0, 1), W0, and inner-norm weight/bias [H, V]."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(randn(B, T, H, K, dtype=torch.float64, generator=gen))
    k = l2norm(randn(B, T, H, K, dtype=torch.float64, generator=gen))
    v = randn(B, T, H, V, dtype=torch.float64, generator=gen)
    eta = torch.sigmoid(randn(B, T, H, dtype=torch.float64, generator=gen))
    W0 = randn(B, H, K, V, dtype=torch.float64, generator=gen) / K
    weight = 1 + 0.3 * randn(H, V, dtype=torch.float64, generator=gen)
    bias = 0.3 * randn(H, V, dtype=torch.float64, generator=gen)
    return [x.to(dtype) for x in (q, k, v, eta, W0, weight, bias)]


def runner(mini_batch_size, chunk_size=16, inner_norm=False):
    def run(q, k, v, eta, W0, norm_weight, norm_bias, backend):
        return ttt_linear(q, k, v, eta, initial_state=W0, output_final_state=True, backend=backend,
                          chunk_size=chunk_size, mini_batch_size=mini_batch_size, inner_norm=inner_norm,
                          norm_weight=norm_weight, norm_bias=norm_bias)
    return run


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mini_batch_size", [1, 3, 16])
def test_backends_agree(shape, with_state, dtype, mini_batch_size):
    x = make(*shape, dtype=dtype)
    x[4] = x[4] if with_state else None
    x[5:] = [None, None]
    check_backends_agree(runner(mini_batch_size), x, NAMES, ["chunk"], tol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
@pytest.mark.parametrize("mini_batch_size", [5, 16])
def test_chunk_sizes(chunk_size, mini_batch_size):
    x = make(1, 131, 2, 4, 5, dtype=torch.float32, seed=1)
    x[5:] = [None, None]
    check_backends_agree(runner(mini_batch_size, chunk_size), x, NAMES, ["chunk"], tol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 1, 4, 4), (2, 37, 3, 6, 6)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mini_batch_size", [1, 4, 16])
def test_inner_norm_backends_agree(shape, dtype, mini_batch_size):
    x = make(*shape, dtype=dtype, seed=2)
    check_backends_agree(runner(mini_batch_size, inner_norm=True), x, NAMES, ["chunk"], tol=1e-5)


def test_inner_norm_gradient_is_the_layer_norm_loss_gradient():
    """inner.error (written out) == autograd's d/dz of 0.5 ||k + LN(z) - v||^2 at z = W^T k."""
    _, k, v, _, W, weight, bias = make(1, 6, 2, 5, 5, seed=3)
    k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [H, T, K]
    z = (k @ W[0]).detach().requires_grad_(True)
    loss = 0.5 * ((k + F.layer_norm(z, (5,), eps=1e-6) * weight[:, None] + bias[:, None] - v) ** 2).sum()
    (expected,) = torch.autograd.grad(loss, z)
    norm = InnerNorm(weight[:, None], bias[:, None], 1e-6)
    assert_close(error(W[0], k, v, norm), expected, 1e-12, "inner LayerNorm gradient")


def test_mini_batch_gradients_are_taken_at_the_batch_start():
    """One mini-batch (the paper's dual form): o_t = W_0^T q_t - sum_{s<=t} eta_s (q_t.k_s)(W_0^T k_s - v_s)."""
    q, k, v, eta, W0, _, _ = make(1, 12, 1, 4, 3, seed=4)
    for backend in ("recurrent", "chunk"):
        o, W = ttt_linear(q, k, v, eta, scale=1.0, initial_state=W0, output_final_state=True, backend=backend,
                          mini_batch_size=12)
        Q, Kt, Vt, e, W_0 = q[0, :, 0], k[0, :, 0], v[0, :, 0], eta[0, :, 0], W0[0, 0]
        err = Kt @ W_0 - Vt
        expected = Q @ W_0 - ((Q @ Kt.T) * e[None, :]).tril() @ err
        assert_close(o[0, :, 0], expected, 1e-12, f"{backend}: dual form")
        assert_close(W[0, 0], W_0 - Kt.T @ (e[:, None] * err), 1e-12, f"{backend}: end-of-batch W")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_mini_batch_one_is_the_delta_rule(backend):
    q, k, v, eta, W0, _, _ = make(2, 29, 2, 4, 5, seed=5)
    o, W = ttt_linear(q, k, v, eta, initial_state=W0, output_final_state=True, backend=backend, mini_batch_size=1)
    S = W0.clone()
    for t in range(q.shape[1]):  # S_t = (I - eta_t k_t k_t^T) S_{t-1} + eta_t k_t v_t^T
        kt, vt, et = k[:, t], v[:, t], eta[:, t, :, None, None]
        S = S - et * kt[..., :, None] * (kt[..., None, :] @ S) + et * kt[..., :, None] * vt[..., None, :]
        assert_close(o[:, t], (q[:, t, :, None, :] * 4 ** -0.5 @ S)[..., 0, :], 1e-12, f"delta rule o_{t}")
    assert_close(W, S, 1e-12, "delta rule state")


@pytest.mark.parametrize("inner_norm", [False, True])
def test_bf16_chunk_matches_fp32_recurrent(inner_norm):
    x = [t.to(torch.bfloat16) for t in make(2, 45, 2, 8, 8, seed=6)]
    if not inner_norm:
        x[5:] = [None, None]
    run = runner(16, inner_norm=inner_norm)
    ref_out, ref_grad = grads(lambda *a: run(*a, backend="recurrent"), [None if t is None else t.float() for t in x])
    for backend in ("chunk", "recurrent"):
        out, grad = grads(lambda *a, b=backend: run(*a, backend=b), x)
        assert_close(out[0], ref_out[0], 5e-3, f"bf16 {backend} output", metric="rmse")
        for name, a, e in zip(NAMES, grad, ref_grad):
            if e is not None:
                assert_close(a, e, 1e-2, f"bf16 {backend} grad of {name}", metric="rmse")


@pytest.mark.parametrize("inner_norm", [False, True])
def test_split_and_step_equal_full(inner_norm):
    q, k, v, eta, W0, weight, bias = make(2, 23, 2, 4, 4, seed=7)
    nk = dict(inner_norm=inner_norm, norm_weight=weight if inner_norm else None, norm_bias=bias if inner_norm else None)
    o, W = ttt_linear(q, k, v, eta, initial_state=W0, output_final_state=True, backend="recurrent",
                      mini_batch_size=4, **nk)
    for t in (8, 12):  # multiples of the mini-batch size
        o1, W1 = ttt_linear(q[:, :t], k[:, :t], v[:, :t], eta[:, :t], initial_state=W0, output_final_state=True,
                            backend="chunk", mini_batch_size=4, **nk)
        o2, W2 = ttt_linear(q[:, t:], k[:, t:], v[:, t:], eta[:, t:], initial_state=W1, output_final_state=True,
                            backend="chunk", mini_batch_size=4, **nk)
        assert_close(torch.cat([o1, o2], 1), o, 1e-10, f"split at {t}: o")
        assert_close(W2, W, 1e-10, f"split at {t}: W")
    state = W0
    for t in range(23):
        o_t, state = ttt_linear_step(q[:, t], k[:, t], v[:, t], eta[:, t], state=state, mini_batch_size=4, **nk)
        assert isinstance(state, MiniBatchState) and state.count == (t + 1) % 4
        assert_close(o_t, o[:, t], 1e-10, f"step {t}")
    assert_close(state.current[0], W, 1e-10, "step W")


@pytest.mark.parametrize("backend", ["chunk", pytest.param("recurrent", marks=pytest.mark.slow)])
def test_long_sequence_finite(backend):
    T = 8192
    q, k, v, eta, _, _, _ = make(1, T, 1, 16, 16, dtype=torch.float32, seed=8)
    for lr in (eta, torch.ones_like(eta)):
        o, W = ttt_linear(q, k, v, lr, output_final_state=True, backend=backend)
        assert torch.isfinite(o).all() and torch.isfinite(W).all()


def test_parallel_backend_refused_with_reason():
    q, k, v, eta, _, _, _ = make(1, 5, 1, 4, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="no closed T x T matrix form"):
        ttt_linear(q, k, v, eta, backend="parallel")


def test_bad_inputs():
    q, k, v, eta, W0, weight, bias = make(1, 5, 2, 4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="eta must have shape"):
        ttt_linear(q, k, v, eta[:, :4])
    with pytest.raises(ValueError, match="q must have shape"):
        ttt_linear(q[0], k, v, eta)
    with pytest.raises(ValueError, match="k must have"):
        ttt_linear(q, k[:, :, :1], v, eta)
    with pytest.raises(TypeError, match="v must be a floating tensor"):
        ttt_linear(q, k, v.int(), eta)
    with pytest.raises(ValueError, match="backend"):
        ttt_linear(q, k, v, eta, backend="fast")
    with pytest.raises(ValueError, match="initial_state must have shape"):
        ttt_linear(q, k, v, eta, initial_state=W0[:, :1])
    with pytest.raises(ValueError, match="mini_batch_size"):
        ttt_linear(q, k, v, eta, mini_batch_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        ttt_linear(q, k, v, eta, chunk_size=-4)
    with pytest.raises(ValueError, match="needs K == V"):
        ttt_linear(q, k, v, eta, inner_norm=True)
    with pytest.raises(ValueError, match="inner_norm=False"):
        ttt_linear(q, k, v, eta, norm_weight=weight)
    with pytest.raises(TypeError, match="inner_norm must be a bool"):
        ttt_linear(q, k, v, eta, inner_norm="yes")
    qq, kk, vv, ee, _, w4, _ = make(1, 5, 2, 4, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        ttt_linear(qq, kk, vv, ee, inner_norm=True, norm_weight=w4[:1])
    with pytest.raises(ValueError, match="^eta must have shape"):
        ttt_linear_step(q[:, 0], k[:, 0], v[:, 0], eta)
    with pytest.raises(ValueError, match="state must have shape"):
        ttt_linear_step(q[:, 0], k[:, 0], v[:, 0], eta[:, 0], state=W0[..., :2])
    with pytest.raises(ValueError, match="state.count"):
        ttt_linear_step(q[:, 0], k[:, 0], v[:, 0], eta[:, 0], state=MiniBatchState((W0,), W0, 7),
                        mini_batch_size=4)
