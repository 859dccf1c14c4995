"""mesa_net's CG solve in one Triton launch (mesa_net/triton_cg.py, ``_chunk_cg_kernel``, run by the fused forward
``mesa_cg_forward``) == the same CG as ``shifted_cg_solve`` over simple_gla's scan products (``TritonScan.reader``,
other kernels): step counts 0, 1, K and more, cg_solve's freezing rule, odd lengths, K not a power of two, chunk
sizes 16 and 64, programs holding part of a chunk, an initial state, a non-finite key.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn import settings
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import assert_close

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def system(B, T, H, K, seed=0, with_state=True):
    """The inputs of one solve: keys k, strengths beta (w = beta k), log gates g, initial state s0 of the scan
    S_t = exp(g_t) S_{t-1} + k_t w_t^T (G_t = S_t^T; or None), lamb, b."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, T, H, K, generator=gen) / K ** 0.5
    beta = torch.rand(B, T, H, generator=gen)
    g = -0.3 * torch.rand(B, T, H, generator=gen)
    M = torch.randn(B, H, K, K, generator=gen) / K
    s0 = M @ M.transpose(-1, -2) + 0.05 * torch.randn(B, H, K, K, generator=gen) / K  # not symmetric
    lamb = torch.rand(H, K, generator=gen) + 0.5
    b = torch.randn(B, T, H, K, generator=gen)
    out = [k, beta, g, s0 if with_state else None, lamb, b]
    return [None if x is None else x.to(DEVICE).contiguous() for x in out]


def reference(k, beta, g, s0, lamb, b, steps, chunk_size):
    """The per-step path: simple_gla's chunk states of (k, beta k) once, one output-kernel read and cg_solve's step
    per CG step. Returns (x, S_T)."""
    from linattn.ops.mesa_net.solve import shifted_cg_solve
    from linattn.ops.mesa_net.triton import TritonScan

    read = TritonScan(chunk_size).reader(k, (beta[..., None] * k).contiguous(), g, s0)
    return shifted_cg_solve(lambda p: read(p)[0], lamb, b, steps), read(b)[1]


def fused(k, beta, g, s0, lamb, b, steps, chunk_size):
    """The one-launch solve as mesa_net runs it: its own scan kernel's states (initial G_0 = s0^T), then the CG
    kernel with w = beta k made inside and b read as the queries at scale 1. Returns (x, S_T)."""
    from linattn.ops.mesa_net.triton_fused import mesa_cg_forward

    G0 = None if s0 is None else s0.transpose(-1, -2).contiguous()
    _, x, GT, _ = mesa_cg_forward(b, k, k, g, beta, lamb, G0, None, 1.0, steps, chunk_size)
    return x, GT.transpose(-1, -2)


@pytest.mark.parametrize("B,T,H,K,chunk_size,with_state,steps_list", [
    (1, 37, 2, 24, 16, True, (0, 1, 24, 30)),  # odd T, K not a power of two, K and more than K steps
    (1, 70, 2, 16, 64, False, (1, 5, 16)),  # chunk 64 with a partial second chunk, no initial state
    (1, 19, 1, 8, 16, True, (3, 8, 12)),
])
def test_fused_solve_equals_reader_and_cg_solve(B, T, H, K, chunk_size, with_state, steps_list):
    x = system(B, T, H, K, seed=T, with_state=with_state)
    for steps in steps_list:
        got, final = fused(*x, steps, chunk_size)
        want, want_final = reference(*x, steps, chunk_size)
        assert_close(got, want, 1e-5, f"x after {steps} steps")
        assert_close(final, want_final, 1e-5, "the scan's final state")
    assert torch.equal(fused(*x, 0, chunk_size)[0], torch.zeros_like(x[-1])), "no steps: x = 0"


def test_torch_scan_solves_the_same_system():
    """The Scan protocol's solve_system on the PyTorch scan (float64 and the fallback for other scans): reader and
    cg_solve, S_T from the first product or, with no steps, from a read of b."""
    from linattn.ops.mesa_net.composed import TorchScan

    x = system(1, 23, 2, 8, seed=5)
    k, beta, g, s0, lamb, b = x
    for steps in (0, 4):
        got, final = TorchScan(16).solve_system(k, beta[..., None] * k, g, s0, lamb, b, steps)
        want, want_final = fused(*x, steps, 16)
        assert_close(got, want, 1e-5, f"x after {steps} steps")
        assert_close(final, want_final, 1e-5, "S_T")


def test_programs_holding_part_of_a_chunk():
    """cg_rows below the chunk size: a chunk's tokens split over several programs, each reading the chunk's keys
    before its own rows."""
    x = system(1, 70, 2, 12, seed=1)
    want, _ = reference(*x, 7, 64)
    with settings(triton_launch={"mesa_net": {"cg_rows": 16}}):
        got, _ = fused(*x, 7, 64)
    assert_close(got, want, 1e-5, "16 rows per program, chunks of 64")


def test_freezing_rule():
    """Head 0's system is 0.75 I (no keys, lamb 0.75): solved in one step, after which it must not move at all;
    a zero right-hand side stays exactly zero (no 0/0); head 1 (a real system) matches cg_solve throughout."""
    k, beta, g, s0, lamb, b = system(1, 21, 2, 16, seed=2, with_state=False)
    beta[:, :, 0] = 0.0
    lamb[0] = 0.75
    b[0, 4] = 0.0
    one, _ = fused(k, beta, g, s0, lamb, b, 1, 16)
    later, _ = fused(k, beta, g, s0, lamb, b, 9, 16)
    assert_close(one[:, :, 0], b[:, :, 0] / 0.75, 1e-6, "one step solves 0.75 I")
    assert torch.equal(later[:, :, 0], one[:, :, 0]), "a converged system takes exactly zero steps"
    assert torch.equal(later[0, 4], torch.zeros_like(later[0, 4])), "b = 0 gives x = 0"
    assert_close(later, reference(k, beta, g, s0, lamb, b, 9, 16)[0], 1e-5, "both heads after 9 steps")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NumPy on NaN
def test_nonfinite_key_reaches_its_position_and_later_only():
    x = system(1, 29, 1, 8, seed=3)
    k = x[0].clone()
    k[0, 9, 0, 3] = float("nan")
    spoiled = [k, *x[1:]]
    got, _ = fused(*spoiled, 4, 16)
    clean, _ = fused(*x, 4, 16)
    assert_close(got[:, :9], clean[:, :9], 0.0, "tokens before the NaN key")
    assert not torch.isfinite(got[:, 9:16]).any(), "the NaN key's chunk from its position on"
    torch.testing.assert_close(got, reference(*spoiled, 4, 16)[0], rtol=1e-5, atol=1e-5, equal_nan=True)


def test_one_launch_solve_takes_head_dims_up_to_128():
    """K > 128: the kernel's tiles would not fit an H100's shared memory (the op then takes the composed path:
    test_triton_mesa_fused.py)."""
    from linattn.ops.mesa_net.triton_cg import chunk_cg_fits

    assert chunk_cg_fits(128) and chunk_cg_fits(100) and not chunk_cg_fits(129)
