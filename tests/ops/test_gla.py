"""gla: the identity with simple_gla, the stable intra-chunk scores, bad inputs."""

import pytest
import torch

from linattn.ops.common.registry import get_op
from linattn.ops.gla import gla, gla_step
from linattn.ops.gla.chunk import gla_intra_chunk_scores
from linattn.ops.simple_gla import simple_gla
from linattn.testing import assert_close, grads, log_gate, randn


def make(B=2, T=23, H=3, K=5, V=4, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (randn(B, T, H, K, dtype=dtype, generator=gen), randn(B, T, H, K, dtype=dtype, generator=gen),
            randn(B, T, H, V, dtype=dtype, generator=gen), log_gate(B, T, H, dtype=dtype, generator=gen),
            randn(B, H, K, V, dtype=dtype, generator=gen))


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_equals_simple_gla_when_gate_is_equal_across_k(backend):
    q, k, v, g, s0 = make()
    K = q.shape[-1]
    run_gla = lambda q, k, v, g, s0: gla(q, k, v, g[..., None].expand(*g.shape, K), initial_state=s0,
                                         output_final_state=True, backend=backend, chunk_size=16)
    run_sgla = lambda q, k, v, g, s0: simple_gla(q, k, v, g, initial_state=s0, output_final_state=True,
                                                 backend=backend, chunk_size=16)
    out_a, grad_a = grads(run_gla, [q, k, v, g, s0])
    out_b, grad_b = grads(run_sgla, [q, k, v, g, s0])
    for i, (a, b) in enumerate(zip(out_a, out_b)):
        assert_close(a, b, 1e-12, f"gla vs simple_gla output {i}")
    for name, a, b in zip(["q", "k", "v", "g", "initial_state"], grad_a, grad_b):
        assert_close(a, b, 1e-12, f"gla vs simple_gla grad of {name}")


@pytest.mark.parametrize("C", [16, 48, 64, 20])
@pytest.mark.parametrize("low, factor_diagonal", [(-0.5, True), (-0.5, False), (-20.0, False), (-20.0, None)])
def test_intra_chunk_scores_match_explicit_decay_tensor(C, low, factor_diagonal):
    """Both forms of the diagonal blocks equal the explicit [C, C, K] form; float32 with decays down to
    exp(-2560) stays finite (None must pick the explicit blocks there)."""
    gen = torch.Generator().manual_seed(1)
    q, k = randn(2, C, 6, dtype=torch.float64, generator=gen), randn(2, C, 6, dtype=torch.float64, generator=gen)
    G = torch.cumsum(log_gate(2, C, 6, dtype=torch.float64, generator=gen, low=low), dim=1)
    diff = (G[:, :, None] - G[:, None, :]).masked_fill(~torch.ones(C, C, dtype=torch.bool).tril()[..., None],
                                                       float("-inf"))
    expected = torch.einsum("btk,bsk,btsk->bts", q, k, torch.exp(diff))
    for dtype, tol in [(torch.float64, 1e-12), (torch.float32, 1e-5)]:
        A = gla_intra_chunk_scores(q.to(dtype), k.to(dtype), G.to(dtype), factor_diagonal=factor_diagonal)
        assert torch.isfinite(A).all()
        assert_close(A, expected, tol, f"intra-chunk scores {dtype}")
        assert (A.triu(1) == 0).all()


def test_step_and_registry():
    q, k, v, g, s0 = make(T=3)
    gk = g[..., None].expand(*g.shape, q.shape[-1]).contiguous()
    o, s = gla(q, k, v, gk, initial_state=s0, output_final_state=True, backend="recurrent")
    o0, s1 = gla_step(q[:, 0], k[:, 0], v[:, 0], gk[:, 0], state=s0)
    assert_close(o0, o[:, 0], 1e-14, "first step")
    spec = get_op("gla")
    assert {"recurrent", "parallel", "chunk"} <= set(spec.info()["backends"]) and spec.step is gla_step
    inputs = spec.example_inputs(1, 5, 2, 4, 3, g_value=-1.0)
    assert inputs["g"].shape == (1, 5, 2, 4) and (inputs["g"] == -1.0).all()
    assert spec.fn(**inputs)[0].shape == (1, 5, 2, 3)


def test_bad_inputs():
    q, k, v, g, s0 = make(dtype=torch.float32)
    gk = g[..., None].expand(*g.shape, q.shape[-1])
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H, K\]"):
        gla(q, k, v, g)  # a scalar gate where gla needs one per key channel
    with pytest.raises(ValueError, match="g must have shape"):
        gla(q, k, v, gk[:, :, :, :2])
    with pytest.raises(ValueError, match="q must have shape"):
        gla(q[..., 0], k, v, gk)
    with pytest.raises(ValueError, match="v must have shape"):
        gla(q, k, v[:1], gk)
    with pytest.raises(TypeError, match="g must be a floating tensor"):
        gla(q, k, v, gk.long())
    with pytest.raises(ValueError, match="initial_state"):
        gla(q, k, v, gk, initial_state=s0.transpose(-1, -2))
    with pytest.raises(ValueError, match="backend"):
        gla(q, k, v, gk, backend="Chunk")
    with pytest.raises(ValueError, match=r"^g must have shape \[B, H, K\]"):
        gla_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0])
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H\]"):
        simple_gla(q, k, v, gk)  # and the converse for simple_gla
