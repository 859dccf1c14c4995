"""Segmented state scans (linattn/ops/common/scan_segments.py, triton_scan_segments.py): the host's plans, and the
Triton scans of gla (a decay per key channel) and simple_gla (one per head) cut into segments giving the outputs,
final states and gradients of the uncut scans and of each sequence run alone (unpacked rows and packed sequences,
odd lengths, with and without initial states; fp32 and bf16).

The Triton cases run on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from linattn import settings
from linattn.ops import get_op
from linattn.ops.common.scan_segments import packed_segments, segment_length, unpacked_segments
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, K, V, CHUNK = 2, 32, 16, 16


def test_unpacked_plan_cuts_only_rows_much_longer_than_the_work_per_slot() -> None:
    cpu = torch.device("cpu")  # planned as on an H100: 132 SMs, two scan programs each
    assert segment_length(8 * 32, 32, cpu, 8) == 32
    assert unpacked_segments(8, 32, 32, cpu, 8) is None  # 8 x 2048 tokens: the rows already fill the GPU
    one = unpacked_segments(1, 512, 32, cpu, 8)  # one row of 32768 tokens, 32 programs a chunk column
    assert one is not None and one.table is None and one.count == one.per_row
    assert (one.per_row - 1) * one.length < 512 <= one.per_row * one.length  # no empty segment, every chunk in one
    assert (one.per_row, one.length) == (9, 57)  # 512 chunks x 32 programs over 264 slots: 63, evened out
    assert unpacked_segments(1, 512, 32, cpu, 8, mode="never") is None
    forced = unpacked_segments(2, 5, 4, cpu, 2, mode="always")
    assert forced is not None and (forced.count, forced.per_row, forced.length) == (6, 3, 2)
    assert unpacked_segments(2, 2, 4, cpu, 2, mode="always") is None  # one segment a row: nothing to cut


def test_packed_table_cuts_each_sequence_evenly_and_is_kept_for_the_backward_pass() -> None:
    offsets = (0, 100, 5000, 5050, 5051)  # 2, 77, 1 and 1 chunks of 64 tokens
    cu_chunks = torch.tensor([0, 2, 79, 80, 81], dtype=torch.int32)
    plan = packed_segments(cu_chunks, offsets, 64, 81, 32, 8, mode="always")
    assert plan is not None and plan.length == 10
    rows = plan.table.tolist()
    assert [r[2] for r in rows] == [0] + [1] * 8 + [2, 3]  # 77 chunks in 8 pieces of at most 10
    assert rows[0] == [0, 2, 0, 0, 0] and rows[-1] == [80, 81, 3, 10, 10]
    pieces = rows[1:9]
    assert [r[:2] for r in pieces] == [[2 + 10 * j, min(12 + 10 * j, 79)] for j in range(8)]
    assert all(r[3:] == [1, 8] for r in pieces)
    # the backward pass has no offsets: it finds the forward's table on cu_chunks, or none on another tensor
    assert packed_segments(cu_chunks, None, 64, 81, 32, 8, mode="always") is plan
    assert packed_segments(cu_chunks.clone(), None, 64, 81, 32, 8, mode="always") is None
    with pytest.raises(RuntimeError, match="3 sequences of 80 chunks in the offsets, 4 of 81 in cu_chunks"):
        packed_segments(cu_chunks.clone(), offsets[:-1], 64, 81, 32, 8, mode="always")
    with pytest.raises(RuntimeError, match="4 sequences of 81 chunks in the offsets, 4 of 82 in cu_chunks"):
        packed_segments(cu_chunks.clone(), offsets, 64, 82, 32, 8, mode="always")
    rows_of_2048 = tuple(range(0, 8 * 2048 + 1, 2048))  # 32 chunks each: as long as the work per slot
    assert packed_segments(torch.arange(0, 257, 32, dtype=torch.int32), rows_of_2048, 64, 256, 32, 8) is None


MODULES = {"gla": "linattn.ops.gla.triton", "simple_gla": "linattn.ops.simple_gla.triton"}


def _run(op: str, lengths: tuple[int, ...] | None, B: int, T: int, dtype: torch.dtype, with_state: bool, mode: str,
         calls: list[bool]):
    """``op`` with backend="triton" under segment mode ``mode`` (segments of 2 chunks where cut): (outputs, final
    state, gradients of every input and the initial state). ``calls`` records the fix-up launches (reverse flag)."""
    spec = get_op(op)
    module = importlib.import_module(MODULES[op])
    gen = torch.Generator().manual_seed(7)
    inputs = {a: x.to(DEVICE, dtype if a in ("q", "k", "v") else torch.float32).requires_grad_()
              for a, x in spec.example_inputs(B, T, H, K, V, seed=5).items()}
    rows = B if lengths is None else len(lengths)
    init = torch.randn(rows, H, K, V, generator=gen).to(DEVICE).requires_grad_() if with_state else None
    kw = {} if lengths is None else {"cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                                dtype=torch.int32)}
    fix = module.fix_segments

    def counted(*args, **kwargs):
        calls.append(kwargs["reverse"])
        return fix(*args, **kwargs)

    module.fix_segments = counted
    try:
        with settings(triton_launch={op: {"segments": mode, "seg_min": 2}}):
            o, final = spec.fn(**inputs, initial_state=init, backend="triton", chunk_size=CHUNK,
                               output_final_state=True, **kw)
            wo = torch.linspace(-1, 1, o.numel(), device=o.device).reshape(o.shape)
            ws = torch.linspace(0.5, -0.5, final.numel(), device=o.device).reshape(final.shape)
            loss = (o.float() * wo).sum() + (final * ws).sum()
            leaves = list(inputs.values()) + ([init] if with_state else [])
            grads = torch.autograd.grad(loss, leaves)
    finally:
        module.fix_segments = fix
    return [o.float(), final, *(g.float() for g in grads)]


CASES = {"one row": (None, 1, 147), "two rows": (None, 2, 100), "packed": ((37, 5, 90, 1, 33), 1, 166)}


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", list(MODULES))
@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_segmented_scans_equal_the_uncut_ones_fp32(op: str, case: str, with_state: bool) -> None:
    lengths, B, T = CASES[case]
    cut_calls, uncut_calls = [], []
    cut = _run(op, lengths, B, T, torch.float32, with_state, "always", cut_calls)
    uncut = _run(op, lengths, B, T, torch.float32, with_state, "never", uncut_calls)
    # the forward's and the backward's recomputed states, then the state gradients' reverse scan
    assert cut_calls == [False, False, True] and uncut_calls == []
    names = ["output", "final state", "dq", "dk", "dv", "dg"] + (["d initial state"] if with_state else [])
    for name, a, b in zip(names, cut, uncut, strict=True):
        assert_close(a, b, 1e-5, name)


@pytest.mark.parametrize("op", list(MODULES))
@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_segmented_packed_equals_each_sequence_alone_fp32(op: str) -> None:
    """Against the token recurrence run on each sequence alone, from its own initial state."""
    lengths = (37, 5, 90, 1, 33)
    cut = _run(op, lengths, 1, sum(lengths), torch.float32, True, "always", [])
    spec = get_op(op)
    gen = torch.Generator().manual_seed(7)
    inputs = {a: x.to(DEVICE).requires_grad_()
              for a, x in spec.example_inputs(1, sum(lengths), H, K, V, seed=5).items()}
    init = torch.randn(len(lengths), H, K, V, generator=gen).to(DEVICE).requires_grad_()
    outs, finals, start = [], [], 0
    for i, n in enumerate(lengths):
        o, f = spec.fn(**{a: x[:, start:start + n] for a, x in inputs.items()}, initial_state=init[i:i + 1],
                       backend="recurrent", output_final_state=True)
        outs.append(o)
        finals.append(f)
        start += n
    o, final = torch.cat(outs, 1), torch.cat(finals, 0)
    wo = torch.linspace(-1, 1, o.numel(), device=o.device).reshape(o.shape)
    ws = torch.linspace(0.5, -0.5, final.numel(), device=o.device).reshape(final.shape)
    grads = torch.autograd.grad((o * wo).sum() + (final * ws).sum(), [*inputs.values(), init])
    names = ["output", "final state", "dq", "dk", "dv", "dg", "d initial state"]
    for name, a, b in zip(names, cut, [o, final, *grads], strict=True):
        assert_close(a, b, 1e-5, name)


@pytest.mark.parametrize("op", list(MODULES))
@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_a_bad_segments_setting_is_named_before_any_compute(op: str) -> None:
    inputs = {a: x.to(DEVICE) for a, x in get_op(op).example_inputs(1, 20, H, K, V).items()}
    with settings(triton_launch={op: {"segments": "most"}}), pytest.raises(
            ValueError, match=f"{op} launch setting segments must be one of 'auto', 'always', 'never', got 'most'"):
        get_op(op).fn(**inputs, backend="triton")


@pytest.mark.parametrize("case", ["one row", "packed"])
@pytest.mark.parametrize("op", list(MODULES))
@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_segmented_scans_equal_the_uncut_ones_bf16(op: str, case: str) -> None:
    """Under the bf16 tolerances of the Triton tests: rmse 5e-3 for outputs and states, 1e-2 for gradients."""
    lengths, B, T = CASES[case]
    cut = _run(op, lengths, B, T, torch.bfloat16, True, "always", [])
    uncut = _run(op, lengths, B, T, torch.bfloat16, True, "never", [])
    for i, (a, b) in enumerate(zip(cut, uncut, strict=True)):
        assert_close(a, b, 5e-3 if i < 2 else 1e-2, f"tensor {i}", metric="rmse")
