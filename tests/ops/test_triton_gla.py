"""gla backend="triton" == recurrent: outputs, final state, every gradient; fp32 and bf16.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py). The
interpreter's cost grows with B * H * T (one Python pass per 16-token sub-chunk), so shapes are small.
"""

import importlib

import pytest
import torch
from gate_precision import assert_gates_gradient_like_the_others, gates_gradient_ratio

from linattn.ops.common.triton_compat import triton_available
from linattn.ops.gla import gla
from linattn.testing import check_backends_agree, log_gate, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "g", "initial_state"]


def make(B, T, H, K, V, seed=0, low=-0.5):
    gen = torch.Generator().manual_seed(seed)
    xs = (randn(B, T, H, K, generator=gen), randn(B, T, H, K, generator=gen), randn(B, T, H, V, generator=gen),
          log_gate(B, T, H, K, generator=gen, low=low), randn(B, H, K, V, generator=gen))
    return [x.to(DEVICE) for x in xs]


def run(q, k, v, g, s0, backend, chunk_size=16, final=True):
    return gla(q, k, v, g, initial_state=s0, output_final_state=final, backend=backend, chunk_size=chunk_size)


@pytest.mark.parametrize("shape,chunk_size,with_state", [
    ((2, 1, 2, 16, 16), 16, True),  # T = 1, B and H > 1
    ((1, 37, 2, 20, 24), 16, True),  # odd T and head dims, K != V, several chunks
    ((1, 70, 1, 16, 40), 32, False),  # two sub-chunks per chunk, partial last chunk
])
def test_triton_matches_recurrent_fp32(shape, chunk_size, with_state):
    q, k, v, g, s0 = make(*shape)
    check_backends_agree(lambda *xs, backend: run(*xs, backend, chunk_size), [q, k, v, g, s0 if with_state else None],
                         NAMES, ["triton"], tol=1e-5)


def test_triton_strong_decay_without_final_state():
    """g down to -20 per token and channel: nothing overflows, 1e-5 agreement (16-token chunks)."""
    q, k, v, g, s0 = make(1, 50, 1, 16, 16, seed=1, low=-20.0)
    check_backends_agree(lambda *xs, backend: run(*xs, backend, 16, final=False), [q, k, v, g, s0],
                         NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("mixed", [False, True])
def test_triton_strong_decay_long_chunks(mixed):
    """g down to -20 in 64-token chunks, 1e-5 agreement; ``mixed``: sub-chunks 0 and 2 have weak gates
    (factored diagonal blocks), 1 and 3 strong ones (explicit blocks). Decays formed as differences of
    in-chunk cumulative gates (~1000 here) would be off by ~1e-5 (the PyTorch chunk backend is at 1.7e-5
    on these inputs); the kernels sum g over each interval instead."""
    q, k, v, g, s0 = make(1, 50, 1, 16, 16, seed=1, low=-20.0)
    if mixed:
        g[:, :16] *= 1e-3
        g[:, 32:48] *= 1e-3
    check_backends_agree(lambda *xs, backend: run(*xs, backend, 64), [q, k, v, g, s0], NAMES, ["triton"], tol=1e-5)


def test_triton_explicit_diagonal_blocks(monkeypatch):
    """Every diagonal block summed channel by channel (the path strong gates take), ordinary gates."""
    monkeypatch.setattr(importlib.import_module("linattn.ops.gla.triton"), "FACTOR_LIMIT", -1.0)
    q, k, v, g, s0 = make(1, 40, 1, 16, 24, seed=4)
    check_backends_agree(lambda *xs, backend: run(*xs, backend, 32), [q, k, v, g, s0], NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("low", [-0.5, -20.0])
def test_triton_bf16(low):
    q, k, v, g, s0 = make(1, 45, 1, 16, 32, seed=2, low=low)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))

    def both(q, k, v, g, s0, backend):
        if backend == "recurrent":  # float32 reference on the same bf16-rounded inputs
            q, k, v = q.float(), k.float(), v.float()
        return run(q, k, v, g, s0, backend, 64 if low < -1 else 32)

    check_backends_agree(both, [qb, kb, vb, g, s0], NAMES, ["triton"], tol=5e-3, grad_tol=1e-2, metric="rmse")


@pytest.mark.parametrize("dots", ["input", "tf32"])
def test_triton_bf16_intra_products_either_way(dots):
    """The intra-chunk gradient products with operands in bf16 or float32 (the default), strong gates too (the
    explicit diagonal blocks), within the bf16 tolerances of the float32 recurrence."""
    from linattn import settings

    q, k, v, g, s0 = make(1, 45, 1, 16, 32, seed=2, low=-20.0)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))

    def both(q, k, v, g, s0, backend):
        if backend == "recurrent":
            return run(q.float(), k.float(), v.float(), g, s0, backend, 64)
        with settings(triton_launch={"gla": {"intra_dots": dots}}):
            return run(q, k, v, g, s0, backend, 64)

    check_backends_agree(both, [qb, kb, vb, g, s0], NAMES, ["triton"], tol=5e-3, grad_tol=1e-2, metric="rmse")


def test_float32_intra_products_keep_the_gates_gradient_precise(gpu_dot_rounding):
    """With a GPU's tf32 rounding and intra_dots "tf32" (the default), T = 1024: dg is as close to the float32
    reference as the other gradients (2.7e-3); with bf16 operands ("input", as FLA's kernel) it is 1.1e-2, which the
    same check refuses."""
    assert_gates_gradient_like_the_others("gla")
    assert gates_gradient_ratio("gla", launch={"gla": {"intra_dots": "input"}}) > 1.5


def test_a_bad_intra_dots_setting_is_named():
    from linattn import settings

    q, k, v, g, _ = make(1, 8, 1, 16, 16)
    with settings(triton_launch={"gla": {"intra_dots": "bf16"}}), pytest.raises(ValueError, match="intra_dots"):
        run(q, k, v, g, None, "triton")  # the forward pass already names it


def test_triton_split_sequence_equals_whole():
    """Running [0:t] then [t:T] with the final state carried equals running [0:T]."""
    q, k, v, g, _ = make(1, 40, 1, 16, 16, seed=3)
    o, S = run(q, k, v, g, None, "triton")
    o1, S1 = run(q[:, :23], k[:, :23], v[:, :23], g[:, :23], None, "triton")
    o2, S2 = run(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], S1, "triton")
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S2, S, rtol=1e-5, atol=1e-5)


def test_triton_rejects_unsupported_chunk_size():
    q, k, v, g, _ = make(1, 4, 1, 16, 16)
    with pytest.raises(ValueError, match="chunk_size"):
        run(q, k, v, g, None, "triton", chunk_size=48)
