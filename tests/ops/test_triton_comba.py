"""comba backend="triton" == recurrent: outputs, final state and every gradient (q, k, v, p, g, beta,
initial state); fp32 and bf16; odd T, T = 1, K != V, two key blocks, strong gates, beta in (0, 2).
Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.ops.comba import comba
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import assert_close, check_backends_agree, grads, l2norm, log_gate, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "p", "g", "beta", "initial_state"]


def make(B, T, H, K, V, seed=0, low=-0.5, beta_max=1.0):
    """q, unit-norm k, v, a read key p = d ⊙ k (d in (0, 1) per head and channel, as in the paper) plus a
    small independent part (so p is not parallel to k), log gates g in [low, 0), beta in (0, beta_max),
    an initial state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(B, T, H, K, generator=gen), l2norm(randn(B, T, H, K, generator=gen))
    v = randn(B, T, H, V, generator=gen)
    d = torch.sigmoid(randn(H, K, generator=gen))
    p = d * k + 0.1 * l2norm(randn(B, T, H, K, generator=gen))
    g = log_gate(B, T, H, generator=gen, low=low)
    beta = beta_max * torch.rand(B, T, H, dtype=torch.float64, generator=gen).float()
    return [x.to(DEVICE) for x in (q, k, v, p, g, beta, randn(B, H, K, V, generator=gen))]


def run(q, k, v, p, g, beta, s0, backend, chunk_size=16, final=True, neg=False):
    return comba(q, k, v, p, g, beta, initial_state=s0, output_final_state=final, allow_neg_eigval=neg,
                 backend=backend, chunk_size=chunk_size)


@pytest.mark.parametrize("shape,chunk_size,with_state,final", [((1, 1, 1, 16, 16), 16, False, True),
                                                               ((2, 37, 2, 20, 24), 16, True, True),
                                                               ((1, 70, 1, 32, 48), 32, True, False),
                                                               ((1, 130, 1, 16, 16), 64, False, True),
                                                               ((1, 40, 1, 80, 16), 16, True, True),  # two key blocks
                                                               ((2, 23, 3, 80, 16), 16, True, True)])  # and B*H > 1
def test_comba_triton_matches_recurrent_fp32(shape, chunk_size, with_state, final):
    q, k, v, p, g, beta, s0 = make(*shape)
    check_backends_agree(lambda *xs, backend: run(*xs, backend, chunk_size, final=final),
                         [q, k, v, p, g, beta, s0 if with_state else None], NAMES, ["triton"], tol=1e-5)


def test_comba_triton_strong_decay():
    """g down to -20: finite and exact to float32 resolution (16-token chunks)."""
    q, k, v, p, g, beta, s0 = make(1, 50, 2, 16, 16, low=-20.0)
    check_backends_agree(lambda *xs, backend: run(*xs, backend), [q, k, v, p, g, beta, s0], NAMES, ["triton"],
                         tol=1e-5)


def test_comba_triton_negative_eigenvalues():
    q, k, v, p, g, beta, s0 = make(1, 40, 1, 16, 16, seed=1, beta_max=2.0)
    check_backends_agree(lambda *xs, backend: run(*xs, backend, neg=True), [q, k, v, p, g, beta, s0], NAMES,
                         ["triton"], tol=1e-5)


def test_comba_triton_bf16():
    q, k, v, p, g, beta, s0 = make(1, 45, 2, 16, 32)

    def both(q, k, v, p, g, beta, s0, backend):
        if backend == "recurrent":  # float32 reference on the same rounded inputs
            q, k, v, p = q.float(), k.float(), v.float(), p.float()
        return run(q, k, v, p, g, beta, s0, backend)

    bf = torch.bfloat16
    check_backends_agree(both, [q.to(bf), k.to(bf), v.to(bf), p.to(bf), g, beta, s0], NAMES, ["triton"],
                         tol=5e-3, grad_tol=1e-2, metric="rmse")


def test_comba_triton_with_p_equal_k_is_the_gated_delta_rule():
    """p = k through the read-key path (dp apart from dk) gives gated_delta_rule's Triton numbers, dk + dp its dk."""
    from linattn.ops.gated_delta_rule import gated_delta_rule

    q, k, v, _, g, beta, s0 = make(1, 30, 1, 16, 16)
    out, (dq, dk, dv, dp, dg, dbeta, ds0) = grads(lambda *xs: run(*xs, "triton"), [q, k, v, k, g, beta, s0])
    out_gdn, grad_gdn = grads(lambda q, k, v, g, beta, s0: gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, backend="triton", chunk_size=16),
        [q, k, v, g, beta, s0])
    for name, a, e in zip(["output", "final state"], out, out_gdn):
        assert_close(a, e, 1e-6, name)
    for name, a, e in zip(["q", "k", "v", "g", "beta", "initial_state"], [dq, dk + dp, dv, dg, dbeta, ds0], grad_gdn):
        assert_close(a, e, 1e-6, f"grad of {name}")


def test_comba_triton_split_sequence_carries_the_state():
    q, k, v, p, g, beta, s0 = make(1, 30, 1, 16, 16)
    o, s = run(q, k, v, p, g, beta, s0, "triton")
    o1, s1 = run(*(x[:, :17] for x in (q, k, v, p, g, beta)), s0, "triton")
    o2, s2 = run(*(x[:, 17:] for x in (q, k, v, p, g, beta)), s1, "triton")
    assert_close(torch.cat([o1, o2], dim=1), o, 1e-5, "output")
    assert_close(s2, s, 1e-5, "final state")
