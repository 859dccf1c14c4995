"""linear_attn backend="triton" == recurrent: every feature map, the normaliser, states, gradients; bf16 inputs on
the bf16 kernels; the head dims whose launch settings differ (float32, K = 256).

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import importlib

import pytest
import torch

from linattn.ops.common.triton_compat import triton_available
from linattn.ops.linear_attn import FEATURE_MAPS, linear_attn
from linattn.testing import check_backends_agree, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(B, T, H, K, V, M, normalize, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = randn(B, T, H, K, generator=gen), randn(B, T, H, K, generator=gen), randn(B, T, H, V, generator=gen)
    s0 = randn(B, H, M, V + int(normalize), generator=gen)
    if normalize:  # a positive normaliser and positive features keep z^T phi(q) away from 0
        s0 = s0.abs()
    return [x.to(DEVICE) for x in (q, k, v, s0)]


def run(q, k, v, s0, backend, chunk_size=16, **kw):
    return linear_attn(q, k, v, initial_state=s0, output_final_state=True, backend=backend, chunk_size=chunk_size, **kw)


# (feature map, normalise): the normaliser needs positive features (elu, relu, performer)
MAPS = [(fm, False) for fm in FEATURE_MAPS] + [("elu", True), ("relu", True), ("performer", True)]


@pytest.mark.parametrize("feature_map,normalize", MAPS)
@pytest.mark.parametrize("with_state", [False, True])
def test_triton_matches_recurrent_fp32(feature_map, normalize, with_state):
    K, V = 12, 10
    M = 2 * K if feature_map == "fourier" else K
    q, k, v, s0 = make(2, 37, 2, K, V, M, normalize)
    kw = dict(feature_map=feature_map, normalize=normalize, eps=0.5 if normalize else 1e-6)
    check_backends_agree(lambda *xs, backend: run(*xs, backend, **kw), [q, k, v, s0 if with_state else None],
                         ["q", "k", "v", "initial_state"], ["triton"], tol=1e-5)


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_triton_normaliser_long_chunks_and_no_final_state(chunk_size):
    q, k, v, s0 = make(1, 150, 2, 40, 20, 40, True, seed=1)
    check_backends_agree(
        lambda q, k, v, backend: linear_attn(q, k, v, feature_map="elu", normalize=True, backend=backend,
                                             chunk_size=chunk_size), [q, k, v], ["q", "k", "v"], ["triton"], tol=1e-5)


def test_triton_bf16_runs_bf16_kernels(monkeypatch):
    """bf16 inputs reach simple_gla's kernels as bf16 features and agree with the float32 recurrence on the same
    rounded inputs (the default layer's op: elu + 1 with the normaliser)."""
    module = importlib.import_module("linattn.ops.linear_attn.triton")
    seen = []
    original = module.simple_gla_triton

    def spy(q, k, v, g, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, g, **kw)

    monkeypatch.setattr(module, "simple_gla_triton", spy)
    q, k, v, s0 = make(1, 45, 2, 16, 32, 16, True, seed=2)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))

    def both(q, k, v, s0, backend):
        if backend == "recurrent":
            q, k, v = q.float(), k.float(), v.float()
        o, s = run(q, k, v, s0, backend, feature_map="elu", normalize=True)
        assert o.dtype == q.dtype and s.dtype == torch.float32
        return o, s

    check_backends_agree(both, [qb, kb, vb, s0], ["q", "k", "v", "initial_state"], ["triton"], tol=5e-3,
                         grad_tol=1e-2, metric="rmse")
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_head_dim_256(dtype):
    """K = 256 takes other launch settings (float32: 32-token chunks inside simple_gla's kernels)."""
    q, k, v, s0 = make(1, 40, 1, 256, 24, 256, True, seed=3)
    xs = [q.to(dtype), k.to(dtype), v.to(dtype), s0]

    def fn(q, k, v, s0, backend):
        if backend == "recurrent":
            q, k, v = q.float(), k.float(), v.float()
        return run(q, k, v, s0, backend, chunk_size=64, feature_map="relu", normalize=True)

    if dtype == torch.float32:
        check_backends_agree(fn, xs, ["q", "k", "v", "initial_state"], ["triton"], tol=1e-5)
    else:
        check_backends_agree(fn, xs, ["q", "k", "v", "initial_state"], ["triton"], tol=5e-3, grad_tol=1e-2,
                             metric="rmse")


def test_triton_split_equals_whole_and_long_sequence_finite():
    q, k, v, s0 = make(1, 300, 1, 16, 16, 16, True, seed=4)
    kw = dict(feature_map="elu", normalize=True)
    o, s = run(q, k, v, s0, "triton", **kw)
    o1, s1 = run(q[:, :133], k[:, :133], v[:, :133], s0, "triton", **kw)
    o2, s2 = run(q[:, 133:], k[:, 133:], v[:, 133:], s1, "triton", **kw)
    assert torch.allclose(torch.cat([o1, o2], 1), o, rtol=1e-5, atol=1e-6)
    assert torch.allclose(s2, s, rtol=1e-5, atol=1e-4)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()


def test_triton_normaliser_compiles_without_graph_breaks():
    q, k, v, _ = make(1, 40, 2, 16, 16, 16, True, seed=5)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]

    def loss(q, k, v):
        o, s = linear_attn(q, k, v, feature_map="elu", normalize=True, output_final_state=True, backend="triton",
                           chunk_size=16)
        return o.square().sum() + s.sum()

    eager = loss(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    for a, b in zip(torch.autograd.grad(value, leaves), eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert torch.allclose(value, eager, rtol=1e-6)
