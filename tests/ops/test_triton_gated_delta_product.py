"""gated_delta_product backend="triton" == recurrent: outputs, final state and every gradient (q, k, v, g,
beta, initial state); fp32 and bf16; odd T, T = 1, K != V, n = 1..3 sub-steps, no gate, strong gates,
beta in (0, 2). Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.ops.common.triton_compat import triton_available
from linattn.ops.gated_delta_product import gated_delta_product
from linattn.testing import assert_close, check_backends_agree, l2norm, log_gate, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


def make(B, T, H, K, V, n, seed=0, low=-0.5, beta_max=1.0):
    """q [B, T, H, K]; unit-norm k, v and beta for n sub-steps per token; log gates g [B, T, H] in [low, 0);
    an initial state."""
    gen = torch.Generator().manual_seed(seed)
    xs = (randn(B, T, H, K, generator=gen), l2norm(randn(B, T * n, H, K, generator=gen)),
          randn(B, T * n, H, V, generator=gen), log_gate(B, T, H, generator=gen, low=low),
          beta_max * torch.rand(B, T * n, H, dtype=torch.float64, generator=gen).float(),
          randn(B, H, K, V, generator=gen))
    return [x.to(DEVICE) for x in xs]


def gdp(q, k, v, g, beta, s0, backend, chunk_size=16, final=True, neg=False):
    return gated_delta_product(q, k, v, g, beta, initial_state=s0, output_final_state=final, allow_neg_eigval=neg,
                               backend=backend, chunk_size=chunk_size)


@pytest.mark.parametrize("shape,n,chunk_size,with_state,final", [((1, 1, 1, 16, 16), 2, 16, False, True),
                                                                 ((2, 19, 2, 20, 24), 2, 16, True, True),
                                                                 ((1, 23, 1, 16, 32), 3, 32, True, False),
                                                                 ((1, 30, 1, 16, 16), 1, 16, True, True)])
def test_gated_delta_product_triton_matches_recurrent_fp32(shape, n, chunk_size, with_state, final):
    q, k, v, g, beta, s0 = make(*shape, n)
    check_backends_agree(lambda *xs, backend: gdp(*xs, backend, chunk_size, final=final),
                         [q, k, v, g, beta, s0 if with_state else None], NAMES, ["triton"], tol=1e-5)


def test_gated_delta_product_triton_without_gate_negative_eigenvalues():
    q, k, v, _, beta, s0 = make(1, 21, 1, 16, 16, 2, seed=1, beta_max=2.0)
    check_backends_agree(lambda *xs, backend: gdp(*xs, backend, neg=True), [q, k, v, None, beta, s0], NAMES,
                         ["triton"], tol=1e-5)


def test_gated_delta_product_triton_strong_decay():
    """g down to -20 on the first sub-step of each token: finite and exact to float32 resolution."""
    q, k, v, g, beta, s0 = make(1, 25, 2, 16, 16, 2, low=-20.0)
    check_backends_agree(lambda *xs, backend: gdp(*xs, backend), [q, k, v, g, beta, s0], NAMES, ["triton"], tol=1e-5)


def test_gated_delta_product_triton_bf16():
    q, k, v, g, beta, s0 = make(1, 23, 2, 16, 32, 2)

    def both(q, k, v, g, beta, s0, backend):
        if backend == "recurrent":  # float32 reference on the same rounded inputs
            q, k, v = q.float(), k.float(), v.float()
        return gdp(q, k, v, g, beta, s0, backend)

    bf = torch.bfloat16
    check_backends_agree(both, [q.to(bf), k.to(bf), v.to(bf), g, beta, s0], NAMES, ["triton"],
                         tol=5e-3, grad_tol=1e-2, metric="rmse")


def test_gated_delta_product_triton_split_sequence_carries_the_state():
    n = 2
    q, k, v, g, beta, s0 = make(1, 15, 1, 16, 16, n)
    o, s = gdp(q, k, v, g, beta, s0, "triton")
    o1, s1 = gdp(q[:, :8], k[:, :8 * n], v[:, :8 * n], g[:, :8], beta[:, :8 * n], s0, "triton")
    o2, s2 = gdp(q[:, 8:], k[:, 8 * n:], v[:, 8 * n:], g[:, 8:], beta[:, 8 * n:], s1, "triton")
    assert_close(torch.cat([o1, o2], dim=1), o, 1e-5, "output")
    assert_close(s2, s, 1e-5, "final state")
