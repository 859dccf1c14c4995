"""delta_rule and gated_delta_rule backend="triton" == recurrent: outputs, final state, every gradient
(q, k, v, g, beta, initial state); fp32 and bf16; odd T, T = 1, K != V, strong gates, beta in (0, 2).

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.ops.common.triton_compat import triton_available
from linattn.ops.delta_rule import delta_rule
from linattn.ops.gated_delta_rule import gated_delta_rule
from linattn.testing import assert_close, check_backends_agree, l2norm, log_gate, randn

if triton_available():
    import triton
    import triton.language as tl

    from linattn.ops.common.triton_tril import unit_lower_inverse

    @triton.jit
    def _inverse_kernel(a, t, C: tl.constexpr):
        o = tl.arange(0, C)
        tile = o[:, None] * C + o[None, :]
        tl.store(t + tile, unit_lower_inverse(tl.load(a + tile), C, "ieee"))

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


def make(B, T, H, K, V, seed=0, low=-0.5, beta_max=1.0):
    """q, unit-norm k, v, log gates g in [low, 0), beta in (0, beta_max), an initial state."""
    gen = torch.Generator().manual_seed(seed)
    xs = (randn(B, T, H, K, generator=gen), l2norm(randn(B, T, H, K, generator=gen)), randn(B, T, H, V, generator=gen),
          log_gate(B, T, H, generator=gen, low=low),
          beta_max * torch.rand(B, T, H, dtype=torch.float64, generator=gen).float(), randn(B, H, K, V, generator=gen))
    return [x.to(DEVICE) for x in xs]


def gdn(q, k, v, g, beta, s0, backend, chunk_size=16, final=True, neg=False):
    return gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=final, allow_neg_eigval=neg,
                            backend=backend, chunk_size=chunk_size)


def dn(q, k, v, g, beta, s0, backend, chunk_size=16, final=True, neg=False):
    """delta_rule with gated_delta_rule's argument list (g is ignored: pass None)."""
    return delta_rule(q, k, v, beta, initial_state=s0, output_final_state=final, allow_neg_eigval=neg,
                      backend=backend, chunk_size=chunk_size)


@pytest.mark.parametrize("shape,chunk_size,with_state", [((1, 1, 1, 16, 16), 16, False),
                                                         ((2, 37, 2, 20, 24), 16, True),
                                                         ((1, 70, 1, 32, 48), 32, True),
                                                         ((1, 130, 1, 16, 16), 64, False),
                                                         ((1, 40, 1, 80, 16), 16, True),  # two key blocks
                                                         # ... and several batch-heads: where each block's share
                                                         # of the gate's gradient lies depends on B*H
                                                         ((2, 23, 3, 80, 16), 16, True)])
def test_gated_delta_triton_matches_recurrent_fp32(shape, chunk_size, with_state):
    q, k, v, g, beta, s0 = make(*shape)
    check_backends_agree(lambda *xs, backend: gdn(*xs, backend, chunk_size),
                         [q, k, v, g, beta, s0 if with_state else None], NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("shape,with_state,final,chunk_size", [((1, 1, 1, 16, 16), False, True, 16),
                                                               ((1, 37, 2, 20, 24), True, True, 16),
                                                               ((1, 45, 1, 16, 32), True, False, 16),
                                                               ((1, 150, 1, 16, 16), True, True, 64)])
def test_delta_triton_matches_recurrent_fp32(shape, with_state, final, chunk_size):
    q, k, v, _, beta, s0 = make(*shape)
    check_backends_agree(lambda *xs, backend: dn(*xs, backend, chunk_size, final=final),
                         [q, k, v, None, beta, s0 if with_state else None], NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("T,H,chunk_size,tol", [(50, 2, 16, 1e-5), (130, 1, 64, None)])
def test_gated_delta_triton_strong_decay_without_final_state(T, H, chunk_size, tol):
    """g down to -20: finite and exact to float32 resolution. In 64-token chunks the in-chunk cumulative gates b
    reach ~-640, which float32 holds to ulp(640) = 6.1e-5, so e^{b_t - b_s} carries up to ~6e-5 relative error
    whatever the order of the sums: tol None is 2 eps_32 max|b| (1.5e-4 here). dg is the output that shows it: vs
    the float32 recurrence it was 1.2e-5 under the CPU interpreter and 6.6e-5 on an H100 (Triton 3.6); the
    PyTorch chunk backend on the CPU, 2.3e-5. Every other output agrees to < 3e-6."""
    q, k, v, g, beta, _ = make(1, T, H, 16, 16, low=-20.0)
    if tol is None:
        chunks = torch.nn.functional.pad(g[0, :, 0].double(), (0, -T % chunk_size)).view(-1, chunk_size)
        tol = 2 * torch.finfo(torch.float32).eps * float(chunks.cumsum(1).abs().max())
    check_backends_agree(lambda *xs, backend: gdn(*xs, backend, chunk_size, final=False), [q, k, v, g, beta, None],
                         NAMES, ["triton"], tol=tol)


@pytest.mark.parametrize("op", [gdn, dn])
def test_triton_negative_eigenvalues(op):
    q, k, v, g, beta, s0 = make(1, 40, 1, 16, 16, seed=1, beta_max=2.0)
    check_backends_agree(lambda *xs, backend: op(*xs, backend, neg=True),
                         [q, k, v, g if op is gdn else None, beta, s0], NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("op,dtype,shape,chunk_size", [(gdn, torch.bfloat16, (1, 45, 2, 16, 32), 16),
                                                        (dn, torch.bfloat16, (1, 45, 2, 16, 32), 16),
                                                        (gdn, torch.float16, (1, 45, 2, 16, 32), 16),
                                                        (gdn, torch.bfloat16, (1, 130, 1, 16, 16), 64),
                                                        (gdn, torch.bfloat16, (1, 48, 1, 16, 16), 64)])
def test_triton_half_precision(op, dtype, shape, chunk_size):
    """The last two: 16-wide key and value blocks in 64-token chunks, where Triton 3.6 on an H100 miscompiled the
    prepare kernel's half-precision products (wrong W and U, or an illegal address; see _prepare_upcasts)."""
    q, k, v, g, beta, s0 = make(*shape)
    g = g if op is gdn else None

    def both(q, k, v, g, beta, s0, backend):
        if backend == "recurrent":  # float32 reference on the same rounded inputs
            q, k, v = q.float(), k.float(), v.float()
        return op(q, k, v, g, beta, s0, backend, chunk_size)

    check_backends_agree(both, [q.to(dtype), k.to(dtype), v.to(dtype), g, beta, s0], NAMES, ["triton"],
                         tol=5e-3, grad_tol=1e-2, metric="rmse")


@pytest.mark.parametrize("op", [gdn, dn])
def test_triton_split_sequence_carries_the_state(op):
    q, k, v, g, beta, s0 = make(1, 30, 1, 16, 16)
    g = g if op is gdn else None

    def part(x, sl):
        return None if x is None else x[:, sl]

    o, s = op(q, k, v, g, beta, s0, "triton")
    o1, s1 = op(*(part(x, slice(0, 17)) for x in (q, k, v, g, beta)), s0, "triton")
    o2, s2 = op(*(part(x, slice(17, 30)) for x in (q, k, v, g, beta)), s1, "triton")
    assert_close(torch.cat([o1, o2], dim=1), o, 1e-5, "output")
    assert_close(s2, s, 1e-5, "final state")


@pytest.mark.parametrize("chunk_size", [48, 128])
def test_triton_rejects_unsupported_chunk_size(chunk_size):
    q, k, v, g, beta, _ = make(1, 8, 1, 16, 16)
    with pytest.raises(ValueError, match="chunk_size must be 16, 32 or 64"):
        gdn(q, k, v, g, beta, None, "triton", chunk_size=chunk_size)



@pytest.mark.parametrize("C", [16, 32, 64])
def test_unit_lower_inverse_kernel(C):
    gen = torch.Generator().manual_seed(C)
    A = (0.3 * torch.randn(C, C, generator=gen)).to(DEVICE)  # the upper triangle must be ignored
    out = torch.empty(C, C, device=DEVICE)
    _inverse_kernel[(1,)](A, out, C)
    expected = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.double().tril(-1).cpu())
    assert (out.double().cpu() - expected).abs().max() / expected.abs().max() < 1e-5
