"""ttt_linear backend="triton" == recurrent: outputs, final weights and every gradient (q, k, v, eta, the initial
weights, the inner LayerNorm's weight and bias), with and without the inner norm; bf16; long sequences finite.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.ops.common.triton_compat import triton_available
from linattn.ops.ttt import ttt_linear
from linattn.testing import assert_close, check_backends_agree, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(B, T, H, K, V, norm, seed=0, eta_max=0.3):
    gen = torch.Generator().manual_seed(seed)
    xs = [randn(B, T, H, K, generator=gen), randn(B, T, H, K, generator=gen), randn(B, T, H, V, generator=gen),
          eta_max * torch.rand(B, T, H, generator=gen, dtype=torch.float64).float(),
          0.1 * randn(B, H, K, V, generator=gen)]
    names = ["q", "k", "v", "eta", "initial_state"]
    if norm:
        xs += [1 + 0.1 * randn(H, V, generator=gen), 0.1 * randn(H, V, generator=gen)]
        names += ["norm_weight", "norm_bias"]
    return [x.to(DEVICE) for x in xs], names


def runner(norm, mini_batch_size=16, final=True):
    def run(q, k, v, eta, s0, *ln, backend):
        extra = dict(norm_weight=ln[0], norm_bias=ln[1]) if ln else {}
        return ttt_linear(q, k, v, eta, initial_state=s0, output_final_state=final, backend=backend,
                          mini_batch_size=mini_batch_size, inner_norm=norm, **extra)
    return run


@pytest.mark.parametrize("norm,shape,mini_batch_size", [
    (True, (1, 1, 1, 16, 16), 16),
    (True, (2, 37, 2, 24, 24), 16),  # a partial last mini-batch, head dims that are not powers of two
    (True, (1, 150, 2, 16, 16), 16),  # three chunks of 64 tokens
    (True, (1, 90, 1, 16, 16), 32),
    (False, (2, 150, 2, 16, 20), 16),  # K != V without the norm
    (False, (1, 70, 1, 20, 16), 32),
])
@pytest.mark.parametrize("with_state", [False, True])
def test_triton_matches_recurrent_fp32(norm, shape, mini_batch_size, with_state):
    xs, names = make(*shape, norm)
    if not with_state:
        xs[4] = None
    check_backends_agree(runner(norm, mini_batch_size), xs, names, ["triton"], tol=1e-5)


@pytest.mark.parametrize("norm,T,mini_batch_size", [
    (True, 229, 16),  # three whole chunks of 64 tokens, then 37: a partial last chunk and mini-batch
    (False, 229, 32),
    (True, 128, 32),  # whole chunks only
    (False, 80, 16),  # the last chunk one whole mini-batch
])
def test_triton_chunks_and_partial_tail_fp32(norm, T, mini_batch_size):
    """The parallel kernels read each chunk's entry weights and the kept per-token values: several chunks, whole
    and partial, with every gradient."""
    xs, names = make(1, T, 2, 16, 16, norm, seed=5)
    check_backends_agree(runner(norm, mini_batch_size), xs, names, ["triton"], tol=1e-5)


def test_triton_final_state_gradient_only():
    """Only the final weights reach the loss: the backward starts from their gradient with do = 0."""
    xs, names = make(1, 100, 2, 16, 16, True, seed=6)
    run = runner(True)
    check_backends_agree(lambda *a, backend: run(*a, backend=backend)[1:], xs, names, ["triton"], tol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_triton_no_grad_forward_equals_training_forward(norm):
    """Without a backward pass the forward keeps nothing for it; the output and final weights are the same (bit for
    bit: the same kernels compute them) and agree with the recurrence."""
    xs, _ = make(1, 150, 2, 16, 16, norm, seed=7)
    run = runner(norm)
    with torch.no_grad():
        o, W = run(*xs, backend="triton")
        o_ref, W_ref = run(*xs, backend="recurrent")
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    o_train, W_train = run(*leaves, backend="triton")
    assert o_train.requires_grad
    assert torch.equal(o, o_train.detach()) and torch.equal(W, W_train.detach())
    assert_close(o, o_ref, 1e-5, "o")
    assert_close(W, W_ref, 1e-5, "final W")


def test_triton_without_final_state():
    xs, names = make(1, 50, 2, 16, 16, True, seed=1)
    check_backends_agree(runner(True, final=False), xs, names, ["triton"], tol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_triton_bf16(norm):
    xs, names = make(1, 80, 2, 32, 32, norm, seed=2)
    xs[:3] = [x.bfloat16() for x in xs[:3]]
    run = runner(norm)

    def both(q, k, v, *rest, backend):
        if backend == "recurrent":  # float32 reference on the same bf16-rounded inputs
            q, k, v = q.float(), k.float(), v.float()
        o, W = run(q, k, v, *rest, backend=backend)
        assert o.dtype == q.dtype and W.dtype == torch.float32
        return o, W

    check_backends_agree(both, xs, names, ["triton"], tol=5e-3, grad_tol=1e-2, metric="rmse")


def test_triton_fp16_long():
    """fp16 inputs: the weight update's two tf32 dots rely on K being exact in tf32 (as for bf16); several chunks."""
    xs, names = make(1, 200, 1, 32, 32, True, seed=8)
    xs[:3] = [x.half() for x in xs[:3]]
    run = runner(True)

    def both(q, k, v, *rest, backend):
        if backend == "recurrent":
            q, k, v = q.float(), k.float(), v.float()
        return run(q, k, v, *rest, backend=backend)

    check_backends_agree(both, xs, names, ["triton"], tol=5e-3, grad_tol=1e-2, metric="rmse")


def test_triton_split_at_mini_batch_boundary_and_long_sequence_finite():
    xs, _ = make(1, 640, 1, 16, 16, True, seed=3, eta_max=1.0)
    q, k, v, eta, s0, w, b = xs
    kw = dict(inner_norm=True, norm_weight=w, norm_bias=b, output_final_state=True, backend="triton")
    o, W = ttt_linear(q, k, v, eta, initial_state=s0, **kw)
    o1, W1 = ttt_linear(q[:, :320], k[:, :320], v[:, :320], eta[:, :320], initial_state=s0, **kw)
    o2, W2 = ttt_linear(q[:, 320:], k[:, 320:], v[:, 320:], eta[:, 320:], initial_state=W1, **kw)
    assert torch.allclose(torch.cat([o1, o2], 1), o, rtol=1e-5, atol=1e-5)
    assert torch.allclose(W2, W, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(o).all() and torch.isfinite(W).all()


def test_triton_limits_and_auto_fallback():
    xs, _ = make(1, 20, 1, 16, 16, False)
    q, k, v, eta, _ = xs
    with pytest.raises(ValueError, match="mini_batch_size"):
        ttt_linear(q, k, v, eta, mini_batch_size=8, backend="triton")
    o_auto, _ = ttt_linear(q, k, v, eta, mini_batch_size=8)  # auto: chunk (on the CPU, and here on CUDA too)
    o_chunk, _ = ttt_linear(q, k, v, eta, mini_batch_size=8, backend="chunk")
    assert torch.equal(o_auto, o_chunk)


def test_triton_compiles_without_graph_breaks():
    xs, _ = make(1, 40, 2, 16, 16, True, seed=4)
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    run = runner(True)

    def loss(*ts):
        o, W = run(*ts, backend="triton")
        return o.square().sum() + W.sum()

    eager_grads = torch.autograd.grad(loss(*leaves), leaves)
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    for a, b in zip(torch.autograd.grad(value, leaves), eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert torch.allclose(value, loss(*leaves), rtol=1e-6)
