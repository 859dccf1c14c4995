"""mesa_net backend="triton" (CG over simple_gla's Triton scans, the exact solve in checkpointed blocks) == the
recurrent and chunk backends: outputs, final (G, H), every gradient; float32, bf16 and float64; odd lengths; strong
decay; no per-token K x K tensor on the CG path; NaN confinement and the named error; "auto" on CUDA.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import math

import pytest
import torch
from test_mesa_net import NAMES, make

from linattn.ops import get_op
from linattn.ops.common.triton_compat import triton_available
from linattn.ops.common.values import value_checks
from linattn.ops.mesa_net import NotPositiveDefiniteError, mesa_net
from linattn.testing import assert_close, check_backends_agree, grads

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1, 1, 4, 4), (2, 37, 2, 8, 6), (1, 70, 1, 16, 20)]  # B, T, H, K, V (odd lengths, partial chunks)


def inputs(*shape, dtype=torch.float32, seed=0, with_state=True):
    x = [t.to(DEVICE) for t in make(*shape, dtype=dtype, seed=seed)]
    return x if with_state else x[:6] + [None, None]


def run(q, k, v, g, beta, lamb, G0, H0, backend, chunk_size=16, **kw):
    state = None if G0 is None else (G0, H0)
    o, (G, Hs) = mesa_net(q, k, v, g, beta, lamb, initial_state=state, output_final_state=True, backend=backend,
                          chunk_size=chunk_size, **kw)
    return o, G, Hs


def symmetric_g0(grad):
    """Cholesky reads G0 as symmetric and returns the symmetrised gradient, CG the unsymmetrised one."""
    return [a if (a is None or name != "G0") else a + a.transpose(-1, -2) for name, a in zip(NAMES, grad)]


def compare(out, grad, ref_out, ref_grad, tol, what, metric="rel", grad_tol=None):
    for i, (a, e) in enumerate(zip(out, ref_out)):
        assert_close(a, e, tol, f"{what}: output {i}", metric)
    for name, a, e in zip(NAMES, symmetric_g0(grad), symmetric_g0(ref_grad)):
        if e is not None:
            assert a is not None, f"{what}: no gradient for {name}"
            assert_close(a, e, tol if grad_tol is None else grad_tol, f"{what}: grad of {name}", metric)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("solver", ["cg", "exact"])
def test_triton_matches_recurrent_fp32(shape, with_state, solver):
    """Against the recurrence's Cholesky solve, CG with K steps (exact in exact arithmetic) included. (The other
    backends' CG differentiates through its unrolled iterations, which in float32 is the less accurate gradient.)"""
    x = inputs(*shape, with_state=with_state)
    ref = grads(lambda *a: run(*a, "recurrent"), x)
    got = grads(lambda *a: run(*a, "triton", solver=solver), x)
    compare(*got, *ref, 1e-5, f"triton {solver}")


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_triton_cg_chunk_sizes(chunk_size):
    x = inputs(2, 45, 2, 8, 5, seed=1)
    ref = grads(lambda *a: run(*a, "recurrent"), x)
    got = grads(lambda *a: run(*a, "triton", chunk_size, solver="cg"), x)
    compare(*got, *ref, 1e-5, f"triton cg, chunk {chunk_size}")


def test_triton_exact_blocks_match_chunk():
    """The exact solver runs in checkpointed blocks of 4 chunks: several blocks, a partial last one."""
    x = inputs(2, 150, 2, 4, 3, seed=2)
    check_backends_agree(lambda *a, backend: run(*a, backend), x, NAMES, ["triton"], reference="chunk", tol=1e-5)


def test_float64_implicit_gradients_match_autograd_of_the_exact_solve():
    """float64 runs the same algorithm on simple_gla's PyTorch scans: the implicit-differentiation backward equals
    autograd through the chunk backend's Cholesky solve to rounding."""
    x = inputs(2, 40, 2, 6, 4, dtype=torch.float64, seed=3)
    ref = grads(lambda *a: run(*a, "chunk"), x)
    for steps in (6, 9):
        got = grads(lambda *a, s=steps: run(*a, "triton", solver="cg", cg_steps=s), x)
        compare(*got, *ref, 1e-8, f"float64 triton cg_steps={steps}")
    got = grads(lambda *a: run(*a, "triton"), x)
    compare(*got, *ref, 1e-12, "float64 triton exact")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fewer_cg_steps_give_the_chunk_backends_iterates(dtype):
    """With fewer than K steps the forward is the same truncated CG as the other backends' (the gradients differ:
    the triton backend's are the exact solve's at the approximate solution, not the truncated iteration's)."""
    x = inputs(2, 33, 2, 8, 4, dtype=dtype, seed=4)
    x[5] = torch.ones_like(x[5])  # G_t + I has few distinct eigenvalues for small t: many systems converge early
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    with torch.no_grad():
        for steps in (2, 3):
            got = run(*x, "triton", solver="cg", cg_steps=steps)
            ref = run(*x, "chunk", solver="cg", cg_steps=steps)
            for i, (a, e) in enumerate(zip(got, ref)):
                assert_close(a, e, tol, f"cg_steps={steps}: output {i}")
            assert (got[0] - run(*x, "chunk")[0]).abs().max() > 1e-4  # and it is an approximation


@pytest.mark.parametrize("solver", ["cg", "exact"])
def test_triton_bf16(solver):
    x = [None if t is None else t.to(torch.bfloat16) for t in inputs(2, 45, 2, 8, 8, dtype=torch.float64, seed=5)]
    ref = grads(lambda *a: run(*a, "recurrent"), [t.float() for t in x])
    out, grad = grads(lambda *a: run(*a, "triton", solver=solver), x)
    assert out[0].dtype == torch.bfloat16 and all(a.dtype == torch.bfloat16 for a in grad)
    compare(out, grad, *ref, 5e-3, f"bf16 triton {solver}", metric="rmse", grad_tol=1e-2)


def test_final_state_only_and_no_grad():
    """A loss on the final states alone (no output gradient), and a call with nothing requiring grad."""
    x = inputs(1, 20, 2, 4, 4, seed=6)
    for solver in ("cg", "exact"):
        ref = grads(lambda *a: run(*a, "recurrent")[1:], x)
        got = grads(lambda *a, s=solver: run(*a, "triton", solver=s)[1:], x)
        compare(*got, *ref, 1e-5, f"{solver}: final states only")
        with torch.no_grad():
            o, _ = mesa_net(*x[:6], solver=solver, backend="triton", chunk_size=16)
            expected, _ = mesa_net(*x[:6], backend="recurrent")
        assert_close(o, expected, 1e-5, f"{solver}: no grad")


@pytest.mark.parametrize("g_value", [-20.0, 0.0])
def test_strong_decay_and_long_sequence_finite(g_value):
    T = 2048 if DEVICE == "cpu" else 65536
    q, k, v, _, beta, lamb, _, _ = inputs(1, T, 1, 16, 16, seed=7)
    g = torch.full((1, T, 1), g_value, device=DEVICE)
    o, (G, Hs) = mesa_net(q, k, v, g, beta, lamb, output_final_state=True, backend="triton", solver="cg",
                          cg_steps=4)
    assert torch.isfinite(o).all() and torch.isfinite(G).all() and torch.isfinite(Hs).all()
    ref, (Gr, Hr) = mesa_net(q, k, v, g, beta, lamb, output_final_state=True, backend="chunk", solver="cg",
                             cg_steps=4)
    assert_close(o, ref, 1e-4, f"g = {g_value}: output")
    # With g = 0 nothing decays: G sums all 65536 terms k k^T on the GPU, in float32 and in another order
    # than the chunk backend, so about 1e-5 relative error is rounding, not a bug.
    assert_close(G, Gr, 3e-5, f"g = {g_value}: G")


def _largest_tensors(fn):
    """Run fn() (forward and backward) and return the size in bytes of the largest tensor an op produced (bytes:
    Triton's interpreter copies storages as bytes)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Largest(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    Largest.nbytes = max(Largest.nbytes, t.numel() * t.element_size())
            return out

    with Largest():
        fn()
    return Largest.nbytes


def test_cg_path_creates_no_per_token_matrix():
    """Every tensor of the CG path's forward and backward is far below one K x K matrix per token (the chunk
    backend's G_t for all t), and the exact path's below one block's."""
    B, T, H, K, V = 1, 256, 2, 16, 16
    x = [t.requires_grad_() for t in inputs(B, T, H, K, V, seed=8)]

    def loss(**kw):
        o, G, Hs = run(*x, "triton", **kw)
        (o.square().sum() + G.sum() + Hs.sum()).backward()

    per_token_matrices = B * T * H * K * K * 4  # bytes in float32
    cg = _largest_tensors(lambda: loss(solver="cg", cg_steps=3))
    assert cg <= per_token_matrices // 8, f"CG path: a tensor of {cg} bytes"
    block = 4 * 16  # EXACT_BLOCK_CHUNKS chunks of 16 tokens
    exact = _largest_tensors(lambda: loss())
    assert exact <= B * block * H * K * K * 4, f"exact path: a tensor of {exact} bytes"
    chunk = _largest_tensors(lambda: run(*x, "chunk", solver="cg", cg_steps=3)[0].sum().backward())
    assert chunk >= per_token_matrices  # what the triton backend avoids


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NumPy on NaN
def test_cg_nonfinite_input_stays_after_its_position():
    from test_nan_confinement import _check

    _check("mesa_net", "triton", {"solver": "cg"}, positions=(21,), bad_values=(math.nan,))
    _check("mesa_net", "triton", {"solver": "cg"}, positions=(32,), bad_values=(math.inf,))


@pytest.mark.parametrize("solver", ["exact", "cg"])
def test_not_positive_definite_named(solver):
    x = get_op("mesa_net").example_inputs(1, 4, 2, 4, 4, device=DEVICE)
    x["k"][0, 2, 0, 1] = math.nan
    with value_checks("strict"), pytest.raises(NotPositiveDefiniteError,
                                           match=r"^mesa_net: G_t \+ diag\(lamb\) is not positive definite"):
        get_op("mesa_net").fn(**x, backend="triton", solver=solver, chunk_size=16)


def test_auto_takes_triton_on_cuda_and_refuses_odd_chunks():
    spec = get_op("mesa_net")
    assert spec.resolve("auto", torch.device("cuda"), 64) is spec.implementations["triton"]
    assert spec.resolve("auto", torch.device("cuda"), 48) is spec.implementations["chunk"]
    x = inputs(1, 5, 1, 4, 4)
    with pytest.raises(ValueError, match="chunk_size must be 16, 32, 64 or 128 for backend='triton'"):
        run(*x, "triton", chunk_size=48)


def test_split_equals_full():
    x = inputs(2, 41, 2, 4, 5, seed=9)
    q, k, v, g, beta, lamb, G0, H0 = x
    for solver in ("cg", "exact"):
        o, G, Hs = run(*x, "triton", solver=solver)
        o1, G1, H1 = run(q[:, :19], k[:, :19], v[:, :19], g[:, :19], beta[:, :19], lamb, G0, H0, "triton",
                         solver=solver)
        o2, G2, H2 = run(q[:, 19:], k[:, 19:], v[:, 19:], g[:, 19:], beta[:, 19:], lamb, G1, H1, "triton",
                         solver=solver)
        assert_close(torch.cat([o1, o2], 1), o, 1e-5, f"{solver}: split output")
        assert_close(G2, G, 1e-5, f"{solver}: split G")
        assert_close(H2, Hs, 1e-5, f"{solver}: split H")


def test_compiles_without_graph_breaks():
    torch._dynamo.reset()
    x = [t.detach().clone().requires_grad_(True) for t in inputs(1, 40, 2, 16, 16, seed=10)[:6]]

    def loss(*xs):
        o, _ = mesa_net(*xs, backend="triton", chunk_size=16, solver="cg", cg_steps=3)
        return o.float().square().sum()

    eager = torch.autograd.grad(loss(*x), x)
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*x)
    compiled = torch.autograd.grad(value, x)
    assert torch.allclose(value, loss(*x), rtol=1e-6)
    for a, b in zip(compiled, eager):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_layer_on_the_triton_backend():
    """MesaNetLayer with backend="triton" (both solvers) == the chunk backend's exact solve: output and gradients."""
    from linattn.layers import build_mixer

    results = {}
    for backend, solver in (("chunk", "exact"), ("triton", "cg"), ("triton", "exact")):
        torch.manual_seed(0)
        layer = build_mixer("mesa_net", 32, 2, backend=backend, solver=solver, chunk_size=16).to(DEVICE)
        x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE).requires_grad_()
        y = layer(x)[0]
        y.square().sum().backward()
        results[backend, solver] = (y.detach(), x.grad, layer.lamb_raw.grad, layer.a_proj.weight.grad)
    for key in (("triton", "cg"), ("triton", "exact")):
        for what, a, e in zip(("output", "dx", "dlamb_raw", "da_proj"), results[key], results["chunk", "exact"]):
            assert_close(a, e, 1e-5, f"{key}: {what}")


@pytest.mark.parametrize("steps", [1, 3, 12])
def test_fused_cg_steps_equal_cg_solve(steps):
    """The fused CG kernel's iterates == cg_solve's on the same product, freezing rule included: a zero right-hand
    side stays zero and a diagonal system (solved in one step) stops moving."""
    from linattn.ops.mesa_net.solve import cg_solve
    from linattn.ops.mesa_net.triton_cg import fused_cg_solve

    B, T, H, K = 2, 5, 3, 12
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(B, T, H, K, K, generator=gen) / K ** 0.5
    A = (M @ M.transpose(-1, -2)).to(DEVICE)
    A[0, 1, 2] = torch.eye(K) * 2.0  # solved exactly in one step: later steps must be exactly zero
    b = torch.randn(B, T, H, K, generator=gen).to(DEVICE)
    b[1, 3] = 0.0
    lamb = torch.rand(H, K, generator=gen) + 0.5
    lamb[2] = 0.75  # head 2's A + diag(lamb) at [0, 1] is a multiple of the identity
    lamb = lamb.to(DEVICE)

    def product(p):
        return (A @ p[..., None]).squeeze(-1)

    fused = fused_cg_solve(product, lamb, b.contiguous(), steps)
    plain = cg_solve(lambda p: product(p) + lamb * p, b, steps)
    assert_close(fused, plain, 1e-5, f"fused vs cg_solve after {steps} steps")
    assert torch.equal(fused[1, 3], torch.zeros_like(fused[1, 3]))
    assert_close(fused[0, 1, 2], b[0, 1, 2] / 2.75, 1e-6, "a multiple of the identity")
