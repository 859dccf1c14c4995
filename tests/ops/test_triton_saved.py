"""What the Triton forward passes keep for their backward passes, and the gates read in their own dtype.

The delta family keeps Tm = (I + A)^-1 per chunk, gla keeps the intra-chunk scores A (not the chunk states h); the
backward pass that reads them must give the same gradients as one that recomputes them, and nothing is kept when no
backward pass can follow. gla and simple_gla read bf16 gates as they are (no float32 copy) and return dg in g's dtype.
Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import importlib

import pytest
import torch

from linattn.ops.common.triton_compat import triton_available
from linattn.ops.gla import gla
from linattn.ops.simple_gla import simple_gla
from linattn.testing import l2norm, log_gate, randn, rel_rmse

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _module(family: str):
    return importlib.import_module(f"linattn.ops.{family}.triton")


def _delta_inputs(B=1, T=45, H=2, K=16, V=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(B, T, H, K, generator=gen), l2norm(randn(B, T, H, K, generator=gen))
    v = randn(B, T, H, V, generator=gen)
    g = log_gate(B, T, H, generator=gen, low=-1.0)
    beta = torch.rand(B, T, H, dtype=torch.float64, generator=gen).float()
    do = randn(B, T, H, V, generator=gen)
    return [x.to(DEVICE).contiguous() for x in (q, k, v, g, beta, do)]


@pytest.mark.parametrize("gated", [True, False])
def test_delta_backward_with_kept_tm_equals_recomputed(gated):
    m = _module("gated_delta_rule")
    q, k, v, g, beta, do = _delta_inputs()
    g = g if gated else None
    o, ht, tm = m.gated_delta_triton_forward(q, k, v, g, beta, 0.25, None, 16, keep_tm=True)
    assert tm.shape == (*q.shape[:3], 16) and tm.dtype == q.dtype
    o2, ht2, none = m.gated_delta_triton_forward(q, k, v, g, beta, 0.25, None, 16)
    assert none is None and torch.equal(o, o2) and torch.equal(ht, ht2)
    kept = m.gated_delta_triton_backward(q, k, v, g, beta, 0.25, None, 16, do, None, tm=tm)
    recomputed = m.gated_delta_triton_backward(q, k, v, g, beta, 0.25, None, 16, do, None)
    for a, b in zip(kept, recomputed):
        assert (a is None and b is None) or torch.equal(a, b)


def test_delta_keeps_tm_only_when_a_backward_can_follow(monkeypatch):
    m = _module("gated_delta_rule")
    seen = []
    original = m.gated_delta_triton_forward
    monkeypatch.setattr(m, "gated_delta_triton_forward",
                        lambda *a, **kw: seen.append(a[-1]) or original(*a, **kw))
    q, k, v, g, beta, _ = _delta_inputs()
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        m.gated_delta_triton(q, k, v, g, beta, scale=scale, chunk_size=16)
    m.gated_delta_triton(q, k, v, g, beta, scale=scale, chunk_size=16)  # nothing requires grad
    m.gated_delta_triton(q.requires_grad_(), k, v, g, beta, scale=scale, chunk_size=16)
    assert seen == [False, False, True]


def _gla_inputs(dtype, B=1, T=40, H=2, K=16, V=24, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (randn(B, T, H, d, generator=gen) for d in (K, K, V))
    g = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64).float()
    do = randn(B, T, H, V, generator=gen)
    return [x.to(DEVICE, dtype).contiguous() for x in (q, k, v, g, do)]


def test_gla_backward_with_kept_scores_equals_recomputed():
    m = _module("gla")
    q, k, v, g, do = _gla_inputs(torch.float32)
    o, ht, h, A = m.gla_triton_forward(q, k, v, g, 0.25, None, 16, keep=True)
    assert h is None and A.shape == (1, 40, 2, 16)  # the states are recomputed by the backward pass
    assert len(m.gla_triton_forward(q, k, v, g, 0.25, None, 16)) == 2
    kept = m.gla_triton_backward(q, k, v, g, 0.25, None, 16, do, None, (h, A))
    recomputed = m.gla_triton_backward(q, k, v, g, 0.25, None, 16, do, None)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    # through the op: what autograd keeps is A, the states' place an empty tensor
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, _ = gla(*leaves, scale=0.25, backend="triton", chunk_size=16)
    assert sorted(x.numel() for x in saved if x.dim() == 5) == []
    assert any(x.shape == (1, 40, 2, 16) for x in saved)


@pytest.mark.parametrize("op", ["gla", "simple_gla"])
def test_bf16_gates_are_read_as_given_and_dg_keeps_their_dtype(op):
    q, k, v, g, do = _gla_inputs(torch.bfloat16)
    if op == "simple_gla":
        g = g[..., 0].contiguous()
    fn = gla if op == "gla" else simple_gla
    grads = []
    for gate in (g, g.float()):  # the same values, bf16 and float32
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, gate)]
        o, _ = fn(*xs, backend="triton", chunk_size=16)
        o.backward(do)
        grads.append([x.grad for x in xs])
    (dq, dk, dv, dg), (dq32, dk32, dv32, dg32) = grads
    assert dg.dtype == torch.bfloat16 and dg32.dtype == torch.float32
    for a, b in ((dq, dq32), (dk, dk32), (dv, dv32)):
        assert torch.equal(a, b)
    assert rel_rmse(dg.float(), dg32) < 4e-3  # dg32 rounded to bf16
