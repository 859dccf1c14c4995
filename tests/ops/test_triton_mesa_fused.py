"""mesa_net's solver "cg" on its own kernels (mesa_net/triton_fused.py: the two scans' states in one launch, the
solve, the read-out, the reverse scans and the per-chunk gradients with beta, scale and the transposes folded in) ==
the composed path (simple_gla's Triton scans over float32 copies of the inputs and CG step by step, other kernels
than the fused path's; mesa_net/composed.py): outputs, final states and every gradient, float32 and bf16, odd
lengths, head dims that are not powers of two, a non-symmetric initial G, chunk sizes, launch settings that split
every kernel's tiles into several blocks, inputs of mixed dtypes, and which path the op takes.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch
from gate_precision import assert_gates_gradient_like_the_others
from test_mesa_net import NAMES, make

from linattn import settings
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import assert_close, grads

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(B, T, H, K, V, dtype=torch.float32, seed=0, with_state=True):
    """make()'s inputs with a non-symmetric G_0 (the kernels read it, and write dG_0, transposed)."""
    x = make(B, T, H, K, V, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x[6] = x[6] + 0.02 * torch.randn(B, H, K, K, dtype=torch.float64, generator=gen) / K
    x = [t.to(DEVICE, dtype) for t in x]
    return x if with_state else x[:6] + [None, None]


def fused(q, k, v, g, beta, lamb, G0, H0, chunk_size=16, cg_steps=None):
    from linattn.ops.mesa_net import mesa_net

    state = None if G0 is None else (G0, H0)
    o, (G, Hs) = mesa_net(q, k, v, g, beta, lamb, initial_state=state, output_final_state=True, backend="triton",
                          chunk_size=chunk_size, solver="cg", cg_steps=cg_steps)
    return o, G, Hs


def composed(q, k, v, g, beta, lamb, G0, H0, chunk_size=16, cg_steps=None):
    """mesa_net_composed over simple_gla's Triton scans, its CG one scan read and one update kernel a step."""
    from linattn.ops.mesa_net.composed import mesa_net_composed
    from linattn.ops.mesa_net.triton import TritonScan

    state = None if G0 is None else (G0, H0)
    scan = TritonScan(chunk_size, precision=None if q.dtype == torch.float32 else "tf32")
    o, (G, Hs) = mesa_net_composed(q, k, v, g, beta, lamb, scale=q.shape[-1] ** -0.5, initial_state=state,
                                   output_final_state=True, chunk_size=chunk_size, solver="cg", cg_steps=cg_steps,
                                   scan=scan)
    return o, G, Hs


def compare(got, want, tol, what, metric="rel", grad_tol=None):
    (out, grad), (ref_out, ref_grad) = got, want
    for i, (a, e) in enumerate(zip(out, ref_out)):
        assert a.dtype == e.dtype, f"{what}: output {i} is {a.dtype}, not {e.dtype}"
        assert_close(a.float(), e.float(), tol, f"{what}: output {i}", metric)
    for name, a, e in zip(NAMES, grad, ref_grad):
        if e is not None:
            assert a is not None and a.dtype == e.dtype, f"{what}: gradient of {name}"
            assert_close(a.float(), e.float(), tol if grad_tol is None else grad_tol, f"{what}: grad of {name}",
                         metric)


@pytest.mark.parametrize("shape", [(1, 37, 2, 24, 40), (2, 70, 1, 16, 20), (1, 5, 3, 8, 8)])  # B, T, H, K, V
@pytest.mark.parametrize("with_state", [True, False])
def test_fused_equals_composed_fp32(shape, with_state):
    """Loss on o, G_T and H_T (so the final states' cotangents reach the reverse scans and the gates)."""
    x = inputs(*shape, seed=shape[1], with_state=with_state)
    compare(grads(fused, x), grads(composed, x), 1e-5, f"float32 {shape}")


@pytest.mark.parametrize("chunk_size", [32, 64, 128])
def test_fused_chunk_sizes(chunk_size):
    """chunk_size 128 runs in chunks of LAUNCH["chunk"] (64) tokens: the same sums in another order."""
    x = inputs(2, 45, 2, 8, 5, seed=1)
    want = grads(lambda *a: composed(*a, chunk_size=chunk_size), x)
    compare(grads(lambda *a: fused(*a, chunk_size=chunk_size), x), want, 1e-5, f"chunk {chunk_size}")


def test_fused_bf16():
    """bf16 inputs: both paths compute in float32 (tf32 dots on a GPU; the fused solve's product operands in bf16)
    and round the results to bf16."""
    x = inputs(2, 45, 2, 16, 12, dtype=torch.bfloat16, seed=5)
    compare(grads(fused, x), grads(composed, x), 5e-3, "bf16", metric="rmse", grad_tol=1e-2)


def test_the_gates_gradient_keeps_its_precision_over_a_long_sequence(gpu_dot_rounding):
    """bf16 inputs with a GPU's tf32 products, T = 1024: the gates' gradient is as close to the float32 reference as
    the other gradients are (within 1.5x the largest of their errors). As one reverse sum over the whole sequence of
    x . dq - k . dk, whose terms cancel, it was 9.4e-3 off here against 2.5e-3 for the others (3.2e-2 on an H200 at
    T = 16384); summed within chunks, with the chunk ends' state terms, it is 2.6e-3."""
    assert_gates_gradient_like_the_others("mesa_net")


def test_fewer_steps_and_strong_decay():
    """A truncated solve (the same iterates on both paths), and a gate that nearly empties the state between
    chunks: there the gates' gradient (differences of large terms, then a long sum) is float32-limited, both paths
    about 1e-3 from float64's, so it is compared at 3e-3."""
    x = inputs(1, 40, 2, 8, 8, seed=3)
    for steps in (1, 3):
        want = grads(lambda *a, s=steps: composed(*a, cg_steps=s), x)
        compare(grads(lambda *a, s=steps: fused(*a, cg_steps=s), x), want, 1e-5, f"cg_steps={steps}")
    x[3] = torch.full_like(x[3], -8.0)
    (out, grad), (ref_out, ref_grad) = grads(fused, x), grads(composed, x)
    for i, (a, e) in enumerate(zip(out, ref_out)):
        assert_close(a, e, 1e-5, f"g = -8: output {i}")
    for name, a, e in zip(NAMES, grad, ref_grad):
        assert_close(a, e, 3e-3 if name == "g" else 1e-5, f"g = -8: grad of {name}")


def test_launch_settings_split_every_tile():
    """Blocks smaller than the head dims (several column blocks in the scans, value and key blocks in the
    gradient kernels, a chunk's rows over several solve programs) give the same numbers as the default ones."""
    x = inputs(1, 50, 2, 40, 36, seed=7)
    want = grads(lambda *a: fused(*a, chunk_size=32), x)
    small = {"chunk": 32, "cg_rows": 16, "scan_BV": 16, "out_BV": 16, "bscan_BV": 16, "grads_BV": 16, "grads_BK": 16,
             "kk_BV": 16}
    with settings(triton_launch={"mesa_net": small}):
        got = grads(lambda *a: fused(*a, chunk_size=32), x)
    compare(got, want, 1e-5, "small blocks")
    with settings(triton_launch={"mesa_net": {"chunk": 16}}):
        got = grads(lambda *a: fused(*a, chunk_size=32), x)
    compare(got, want, 1e-5, "chunks of 16")


def test_mixed_dtypes():
    """bf16 q, k, v with float32 gates, strengths, lamb and states: each gradient in its input's dtype, and the
    same numbers as with every input in float32 but q, k, v (read as the bf16 values)."""
    x = inputs(1, 33, 2, 8, 8, seed=9)
    x[:3] = [t.to(torch.bfloat16) for t in x[:3]]
    out, grad = grads(fused, x)
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == out[2].dtype == torch.float32
    assert [t.dtype for t in grad] == [t.dtype for t in x]
    ref_out, ref_grad = grads(fused, [t.float() for t in x])
    assert_close(out[0].float(), ref_out[0], 5e-3, "o", "rmse")
    for name, a, e in zip(NAMES, grad, ref_grad):
        assert_close(a.float(), e, 1e-2, f"grad of {name}", "rmse")


def test_the_op_takes_the_fused_path(monkeypatch):
    """solver "cg" at head dims up to 128 runs triton_fused.py's kernels, not the composed scans; float64 inputs and
    head dims above 128 take the composed path."""
    from linattn.ops.mesa_net import triton as mesa_triton

    def refuse(*args, **kwargs):
        raise AssertionError("the composed path was taken")

    x = inputs(1, 9, 1, 8, 8, seed=11)
    monkeypatch.setattr(mesa_triton, "mesa_net_composed", refuse)
    fused(*x)
    with pytest.raises(AssertionError, match="composed path"):
        fused(*[t.double() for t in x])
    with pytest.raises(AssertionError, match="composed path"):
        fused(*inputs(1, 2, 1, 130, 4, with_state=False))


def test_custom_ops_and_their_fake_kernels():
    """What torch.compile graphs call: the forward and backward ops give the eager results, and their fake kernels
    the shapes and dtypes (opcheck: schema, fake tensors, dispatch)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from linattn.ops.mesa_net.triton_fused import mesa_cg_backward, mesa_cg_forward

    q, k, v, g, beta, lamb, G0, H0 = inputs(1, 20, 2, 8, 6, dtype=torch.bfloat16, seed=13)
    args = (q, k, v, g, beta, lamb, G0, H0, 8 ** -0.5, 3, 16)
    got = torch.ops.linattn.mesa_net_cg_fwd(*args)
    for a, e in zip(got, mesa_cg_forward(*args)):
        assert torch.equal(a, e)
    o, x = got[0], got[1]
    bargs = (x, k, v, g, beta, lamb, G0, H0, torch.randn_like(o), None, torch.randn_like(H0), 8 ** -0.5, 3, 16)
    for a, e in zip(torch.ops.linattn.mesa_net_cg_bwd(*bargs), mesa_cg_backward(*bargs)):
        assert torch.equal(a, e)
    with FakeTensorMode() as mode:
        fake = torch.ops.linattn.mesa_net_cg_fwd(*(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                                                   for t in args))
        fake_grads = torch.ops.linattn.mesa_net_cg_bwd(*(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                                                         for t in bargs))
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in got]
    assert [(tuple(t.shape), t.dtype) for t in fake_grads] == [(tuple(t.shape), t.dtype) for t in (q, *args[1:8])]
    torch.library.opcheck(torch.ops.linattn.mesa_net_cg_fwd.default, args)
    torch.library.opcheck(torch.ops.linattn.mesa_net_cg_bwd.default, bargs)


def test_solve_products_in_the_input_dtype():
    """cg_dots "input" (the default): the solve's product operands rounded to bf16 for bf16 inputs (as FLA
    multiplies): x moves by about bf16's rounding and the op stays within the bf16 tolerances of the float32-operand
    path ("tf32"), gradients included; float32 and fp16 inputs are not affected (fp16 would overflow where bf16 does
    not)."""
    from linattn.ops.mesa_net.triton_fused import mesa_cg_forward

    x = inputs(2, 45, 2, 16, 12, dtype=torch.bfloat16, seed=5)
    q, k, v, g, beta, lamb, G0, H0 = x
    solve = []
    for dots in ("tf32", "input"):
        with settings(triton_launch={"mesa_net": {"cg_dots": dots}}):
            solve.append(mesa_cg_forward(q, k, v, g, beta, lamb, G0, H0, 0.25, 16, 16)[1])
    assert torch.equal(solve[1], mesa_cg_forward(q, k, v, g, beta, lamb, G0, H0, 0.25, 16, 16)[1]), "the default"
    assert not torch.equal(*solve), "the setting took effect"
    assert_close(solve[1], solve[0], 5e-3, "x with 16-bit product operands")
    compare(grads(fused, x), grads(composed, x), 5e-3, "bf16, 16-bit products", metric="rmse", grad_tol=1e-2)
    x32 = inputs(1, 20, 2, 8, 6, seed=2)
    for dtype in (torch.float32, torch.float16):
        xd = [t.to(dtype) for t in x32]
        with settings(triton_launch={"mesa_net": {"cg_dots": "tf32"}}):
            want = grads(fused, xd)
        compare(grads(fused, xd), want, 0.0, f"{dtype} inputs")
    with settings(triton_launch={"mesa_net": {"cg_dots": "bf16"}}), pytest.raises(ValueError, match="cg_dots"):
        fused(*x32)
