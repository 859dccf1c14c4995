"""The Triton copies into and out of the chunk-aligned layout of packed sequences (ops/common/triton_relayout.py)
equal the index_copy / index_select path bit for bit, forward and backward; a packed op run with them matches
running each sequence alone; they trace under torch.compile(fullgraph=True).

The kernels serve CUDA tensors only; here ``packed_call.RELAYOUT_KERNELS = "always"`` runs them on CPU tensors
through Triton's interpreter (tests/conftest.py), and "never" gives the index path to compare with."""

from __future__ import annotations

import pytest
import torch

import linattn.ops.common.packed_call as packed_call
from linattn.ops.common.packed_call import Packing, chunk_layout
from linattn.ops.common.triton_compat import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = {"mixed": (5, 1, 37, 16), "one": (23,), "short": (3, 7), "long": (70, 1, 129)}
BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _layout(lengths: tuple[int, ...], chunk_size: int):
    offsets = (0, *torch.tensor(lengths).cumsum(0).tolist())
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    return chunk_layout(Packing(cu, offsets), chunk_size, torch.device(DEVICE))


def _both(monkeypatch: pytest.MonkeyPatch, fn):
    """fn() on the index path, then on the kernels."""
    monkeypatch.setattr(packed_call, "RELAYOUT_KERNELS", "never")
    want = fn()
    monkeypatch.setattr(packed_call, "RELAYOUT_KERNELS", "always")
    return want, fn()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.contiguous().view(BITS[a.dtype]), b.contiguous().view(BITS[b.dtype]))


@pytest.mark.parametrize("trailing", [(2, 16), (3,)], ids=["HK", "H"])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("lengths", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_copies_equal_the_index_path(monkeypatch, dtype, lengths, chunk_size, trailing) -> None:
    layout = _layout(lengths, chunk_size)
    gen = torch.Generator().manual_seed(sum(lengths) + chunk_size)
    x = torch.randn(1, sum(lengths), *trailing, generator=gen).to(DEVICE, dtype).requires_grad_()
    y = torch.randn(1, layout.padded, *trailing, generator=gen).to(DEVICE, dtype).requires_grad_()
    w_packed = torch.randn(y.shape, generator=gen).to(DEVICE, dtype)
    w_tokens = torch.randn(x.shape, generator=gen).to(DEVICE, dtype)

    def run():
        packed, tokens = layout.pack(x), layout.unpack(y)
        dx, dy = torch.autograd.grad([packed, tokens], [x, y], [w_packed, w_tokens])
        return packed, tokens, dx, dy

    for want, got in zip(*_both(monkeypatch, run), strict=True):
        _same_bits(want, got)


@pytest.mark.parametrize("features", [40, 48], ids=["uneven", "even"])
def test_wide_rows_are_split_over_feature_blocks(monkeypatch, features) -> None:
    """Rows wider than a feature block: several programs a row block (with and without a masked last block)."""
    from linattn.ops.common import triton_relayout

    monkeypatch.setitem(triton_relayout.LAUNCH, "max_block_d", 16)
    triton_relayout._plan.cache_clear()
    try:
        assert triton_relayout._plan(features, 16)[3] == 3
        layout = _layout((5, 1, 37), 16)
        x = torch.randn(1, 43, 2, features // 2, device=DEVICE).requires_grad_()
        y = torch.randn(1, layout.padded, 2, features // 2, device=DEVICE).requires_grad_()

        def run():
            packed, tokens = layout.pack(x), layout.unpack(y)
            return (packed, tokens, *torch.autograd.grad([packed.square().sum(), tokens.sum()], [x, y]))

        for want, got in zip(*_both(monkeypatch, run), strict=True):
            _same_bits(want, got)
    finally:
        triton_relayout._plan.cache_clear()


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> list:
    from linattn.ops.common.triton_launch import FastKernel

    launches = []
    launch = FastKernel.launch

    def record(self, grid, args, kwargs):
        launches.append(grid)
        return launch(self, grid, args, kwargs)

    monkeypatch.setattr(FastKernel, "launch", record)
    return launches


def test_one_launch_a_copy_and_fallbacks(monkeypatch) -> None:
    """A pack and an unpack launch one kernel each (the padding is written by the same kernel); tensors the
    kernels do not take (not contiguous, float64) take the index path and give the same values."""
    launches = _count_launches(monkeypatch)
    monkeypatch.setattr(packed_call, "RELAYOUT_KERNELS", "always")
    layout = _layout((5, 1, 37), 16)
    x = torch.randn(1, 43, 3, device=DEVICE)
    layout.unpack(layout.pack(x))
    assert len(launches) == 2
    launches.clear()
    strided = torch.randn(1, 3, 43, device=DEVICE).transpose(1, 2)
    for t in (strided, x.double()):
        packed = layout.pack(t)
        torch.testing.assert_close(packed[0, layout.index], t[0], rtol=0, atol=0)
        rest = torch.ones(layout.padded, dtype=torch.bool, device=DEVICE)
        rest[layout.index] = False
        assert packed[0, rest].eq(0).all()
    assert not launches


def test_tensors_of_one_shape_share_launches(monkeypatch) -> None:
    """pack_many: q, k, v, p of one shape in one launch (MAX_X = 4 a launch: a fifth takes another), g and beta
    in another, a float64 tensor and None as on the index path; the same bits, and gradients, as packing one by
    one on the index path, also where an output is unused or an input needs no gradient."""
    layout = _layout((5, 1, 37, 16), 16)
    gen = torch.Generator().manual_seed(5)
    qkvp = [torch.randn(1, 59, 2, 8, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_() for _ in range(5)]
    gates = [torch.randn(1, 59, 2, generator=gen).to(DEVICE).requires_grad_(i == 0) for i in range(2)]
    wide = torch.randn(1, 59, 2, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    xs = [*qkvp[:2], None, gates[0], *qkvp[2:], wide, gates[1]]
    leaves = [x for x in xs if x is not None and x.requires_grad]

    def run():
        packed = layout.pack_many(*xs)
        used = [y for i, y in enumerate(packed) if y is not None and i != 1]  # k's output unused
        loss = sum((y.double() * torch.linspace(-1, 1, y.numel(), device=DEVICE).reshape(y.shape)).sum()
                   for y in used)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)  # k: None on the index path, zeros here
        return [y for y in packed if y is not None] + [torch.zeros_like(x) if d is None else d
                                                       for x, d in zip(leaves, grads, strict=True)]

    monkeypatch.setattr(packed_call, "RELAYOUT_KERNELS", "never")
    want = run()
    assert layout.pack_many(None, None) == [None, None]
    launches = _count_launches(monkeypatch)
    monkeypatch.setattr(packed_call, "RELAYOUT_KERNELS", "always")
    got = run()
    assert [g[2] for g in launches[:3]] == [4, 1, 2]  # 4 + 1 alike, 2 gates
    assert sorted(g[2] for g in launches[3:]) == [1, 2, 4]  # the same in the backward pass
    for a, b in zip(want, got, strict=True):
        _same_bits(a, b)


@pytest.mark.parametrize("name", ["simple_gla", "gla"])  # (the delta family reads packed tokens in place)
def test_packed_op_with_the_kernels_matches_separate_calls(monkeypatch, name) -> None:
    """The whole packed op with the copy kernels: outputs, final states and every gradient match running each
    sequence alone (the checks of tests/ops/test_triton_packed.py), and equal the index path's bit for bit."""
    from test_triton_packed import _loss, _packed_and_separate

    def run():
        (o, final), (o_ref, final_ref), leaves = _packed_and_separate(name, (5, 1, 37, 16), torch.float32, True)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, final_ref, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(_loss(o, final), leaves)
        for got, want in zip(grads, torch.autograd.grad(_loss(o_ref, final_ref), leaves), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return o, final, *grads

    for want, got in zip(*_both(monkeypatch, run), strict=True):
        _same_bits(want, got)


def test_compiles_without_graph_breaks(monkeypatch) -> None:
    """Under torch.compile the copies are custom ops with fake kernels: no graph break, the eager numbers."""
    torch._dynamo.reset()
    monkeypatch.setattr(packed_call, "RELAYOUT_KERNELS", "always")
    layout = _layout((5, 1, 37), 16)
    x = torch.randn(1, 43, 2, 8, device=DEVICE).requires_grad_()
    g = torch.randn(1, 43, 2, device=DEVICE).requires_grad_()

    def loss(x, g):
        a, b, c = layout.pack_many(x, g, x)
        return (layout.unpack(a * c) * x).sum() + (layout.unpack(b) * g).sum()

    eager = loss(x, g)
    eager_grads = torch.autograd.grad(eager, [x, g])
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(x, g)
    grads = torch.autograd.grad(value, [x, g])
    _same_bits(value.detach(), eager.detach())
    for a, b in zip(grads, eager_grads, strict=True):
        _same_bits(a, b)
    torch.testing.assert_close(grads[0], 3 * x.detach().square(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1], 2 * g.detach(), rtol=1e-6, atol=1e-6)


def test_new_offsets_with_the_same_chunk_count_compile_nothing(monkeypatch) -> None:
    """With the copy kernels, offsets that pad to the same chunk count still launch every kernel with one
    specialisation (the copies take no length: rows come from chunk_rows)."""
    from test_triton_packed import test_new_offsets_with_the_same_chunk_count_compile_nothing as same_keys

    monkeypatch.setattr(packed_call, "RELAYOUT_KERNELS", "always")
    same_keys("gla", monkeypatch)
