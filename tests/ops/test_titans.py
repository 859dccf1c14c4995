"""titans: recurrent == chunk (outputs, final (M, S), every gradient), extreme gates, the ttt_linear
identity, bf16, splitting, stepping, long sequences, input checks."""

import pytest
import torch

from linattn.ops.ttt import MiniBatchState, titans, titans_step, ttt_linear
from linattn.testing import assert_close, check_backends_agree, grads, l2norm, randn

SHAPES = [(1, 1, 1, 4, 4), (2, 7, 3, 5, 6), (1, 33, 2, 8, 3), (2, 40, 2, 4, 4)]  # B, T, H, K, V
NAMES = ["q", "k", "v", "theta", "alpha", "eta", "M0", "S0"]


def make(B, T, H, K, V, dtype=torch.float64, seed=0):
    """q, k (L2-normalised), v, theta in (0, 1), alpha in (0, 0.2), eta in (0, 1), M0, S0."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(randn(B, T, H, K, dtype=torch.float64, generator=gen))
    k = l2norm(randn(B, T, H, K, dtype=torch.float64, generator=gen))
    v = randn(B, T, H, V, dtype=torch.float64, generator=gen)
    theta, alpha, eta = (torch.sigmoid(randn(B, T, H, dtype=torch.float64, generator=gen)) for _ in range(3))
    M0, S0 = (randn(B, H, K, V, dtype=torch.float64, generator=gen) / K for _ in range(2))
    return [x.to(dtype) for x in (q, k, v, theta, 0.2 * alpha, eta, M0, S0)]


def runner(mini_batch_size, chunk_size=16):
    def run(q, k, v, theta, alpha, eta, M0, S0, backend):
        o, (M, S) = titans(q, k, v, theta, alpha, eta, initial_state=None if M0 is None else (M0, S0),
                           output_final_state=True, backend=backend, chunk_size=chunk_size,
                           mini_batch_size=mini_batch_size)
        return o, M, S
    return run


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mini_batch_size", [1, 3, 16])
def test_backends_agree(shape, with_state, dtype, mini_batch_size):
    x = make(*shape, dtype=dtype)
    if not with_state:
        x[6:] = [None, None]
    check_backends_agree(runner(mini_batch_size), x, NAMES, ["chunk"], tol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
@pytest.mark.parametrize("mini_batch_size", [5, 16])
def test_chunk_sizes(chunk_size, mini_batch_size):
    x = make(1, 131, 2, 4, 5, dtype=torch.float32, seed=1)
    check_backends_agree(runner(mini_batch_size, chunk_size), x, NAMES, ["chunk"], tol=1e-5)


@pytest.mark.parametrize("alpha_value, eta_value", [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)])
def test_extreme_gates_agree(alpha_value, eta_value):
    """Gates at the ends of [0, 1] (products with exact zeros) agree, gradients of the gates included."""
    x = make(2, 37, 2, 4, 5, seed=2)
    x[4], x[5] = torch.full_like(x[4], alpha_value), torch.full_like(x[5], eta_value)
    x[4][:, ::3] = 0.5  # some tokens in between
    check_backends_agree(runner(4), x, NAMES, ["chunk"], tol=1e-5)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("mini_batch_size", [1, 6])
def test_no_momentum_no_decay_is_ttt_linear(backend, mini_batch_size):
    q, k, v, theta, _, _, M0, _ = make(2, 27, 2, 4, 5, seed=3)
    zero = torch.zeros_like(theta)
    o, (M, _) = titans(q, k, v, theta, zero, zero, initial_state=(M0, torch.zeros_like(M0)), output_final_state=True,
                       backend=backend, mini_batch_size=mini_batch_size)
    o_ttt, W = ttt_linear(q, k, v, theta, initial_state=M0, output_final_state=True, backend=backend,
                          mini_batch_size=mini_batch_size)
    assert_close(o, o_ttt, 1e-12, "titans(eta=alpha=0) vs ttt_linear: o")
    assert_close(M, W, 1e-12, "titans(eta=alpha=0) vs ttt_linear: state")


def test_bf16_chunk_matches_fp32_recurrent():
    x = [t.to(torch.bfloat16) for t in make(2, 45, 2, 8, 8, seed=4)]
    run = runner(16)
    ref_out, ref_grad = grads(lambda *a: run(*a, backend="recurrent"), [t.float() for t in x])
    for backend in ("chunk", "recurrent"):
        out, grad = grads(lambda *a, b=backend: run(*a, backend=b), x)
        assert_close(out[0], ref_out[0], 5e-3, f"bf16 {backend} output", metric="rmse")
        for name, a, e in zip(NAMES, grad, ref_grad):
            assert_close(a, e, 1e-2, f"bf16 {backend} grad of {name}", metric="rmse")


def test_split_and_step_equal_full():
    q, k, v, theta, alpha, eta, M0, S0 = make(2, 23, 2, 4, 5, seed=5)
    o, (M, S) = titans(q, k, v, theta, alpha, eta, initial_state=(M0, S0), output_final_state=True,
                       backend="recurrent", mini_batch_size=4)
    for t in (8, 20):  # multiples of the mini-batch size
        a, b = slice(0, t), slice(t, None)
        o1, s1 = titans(q[:, a], k[:, a], v[:, a], theta[:, a], alpha[:, a], eta[:, a], initial_state=(M0, S0),
                        output_final_state=True, backend="chunk", mini_batch_size=4)
        o2, s2 = titans(q[:, b], k[:, b], v[:, b], theta[:, b], alpha[:, b], eta[:, b], initial_state=s1,
                        output_final_state=True, backend="chunk", mini_batch_size=4)
        assert_close(torch.cat([o1, o2], 1), o, 1e-10, f"split at {t}: o")
        assert_close(s2[0], M, 1e-10, f"split at {t}: M")
        assert_close(s2[1], S, 1e-10, f"split at {t}: S")
    state = (M0, S0)
    for t in range(23):
        o_t, state = titans_step(q[:, t], k[:, t], v[:, t], theta[:, t], alpha[:, t], eta[:, t], state=state,
                                 mini_batch_size=4)
        assert isinstance(state, MiniBatchState) and state.count == (t + 1) % 4
        assert_close(o_t, o[:, t], 1e-10, f"step {t}")
    assert_close(state.current[0], M, 1e-10, "step M")
    assert_close(state.current[1], S, 1e-10, "step S")


@pytest.mark.parametrize("backend", ["chunk", pytest.param("recurrent", marks=pytest.mark.slow)])
def test_long_sequence_finite(backend):
    T = 8192
    q, k, v, theta, _, _, _, _ = make(1, T, 1, 16, 16, dtype=torch.float32, seed=6)
    for alpha_value, eta_value in ((0.0, 0.0), (1.0, 1.0), (0.01, 0.9)):
        alpha, eta = torch.full_like(theta, alpha_value), torch.full_like(theta, eta_value)
        o, (M, S) = titans(q, k, v, 0.1 * theta, alpha, eta, output_final_state=True, backend=backend)
        assert torch.isfinite(o).all() and torch.isfinite(M).all() and torch.isfinite(S).all()


def test_bad_inputs():
    q, k, v, theta, alpha, eta, M0, S0 = make(1, 5, 2, 4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="theta must have shape"):
        titans(q, k, v, theta[:, :4], alpha, eta)
    with pytest.raises(ValueError, match="alpha must have shape"):
        titans(q, k, v, theta, alpha[..., None], eta)
    with pytest.raises(ValueError, match="alpha must have values in"):
        titans(q, k, v, theta, alpha + 1, eta)
    with pytest.raises(ValueError, match="eta must have values in"):
        titans(q, k, v, theta, alpha, -eta)
    with pytest.raises(ValueError, match="q must have shape"):
        titans(q[0], k, v, theta, alpha, eta)
    with pytest.raises(TypeError, match="k must be a floating tensor"):
        titans(q, k.long(), v, theta, alpha, eta)
    with pytest.raises(ValueError, match="backend"):
        titans(q, k, v, theta, alpha, eta, backend="parallel")
    with pytest.raises(TypeError, match="initial_state must be a pair"):
        titans(q, k, v, theta, alpha, eta, initial_state=M0)
    with pytest.raises(ValueError, match=r"initial_state\[1\] \(S\) must have shape"):
        titans(q, k, v, theta, alpha, eta, initial_state=(M0, S0[:, :1]))
    with pytest.raises(ValueError, match="mini_batch_size"):
        titans(q, k, v, theta, alpha, eta, mini_batch_size=2.5)
    with pytest.raises(ValueError, match="^eta must have shape"):
        titans_step(q[:, 0], k[:, 0], v[:, 0], theta[:, 0], alpha[:, 0], eta)
    with pytest.raises(ValueError, match=r"state\[0\] \(M\) must have shape"):
        titans_step(q[:, 0], k[:, 0], v[:, 0], theta[:, 0], alpha[:, 0], eta[:, 0], state=(M0[..., :1], S0))
