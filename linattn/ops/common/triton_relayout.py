"""Copies between packed tokens and the chunk-aligned layout of packed sequences, as Triton kernels (import only
where Triton is installed; :meth:`linattn.ops.common.packed_call.ChunkLayout.pack` and ``unpack`` choose them).

Packed tokens x [1, T, ...] and the chunk-aligned layout [1, padded, ...] (docs/ops/packed.md) agree chunk by
chunk: padded chunk c holds the rows ``start_c .. start_c + valid_c - 1`` of x (contiguous there) followed by
``chunk_size - valid_c`` padded rows. ``chunk_rows`` [chunks, 2] int64 holds (start_c, valid_c), built once per
layout on the device (``ChunkLayout.chunk_rows``). With the trailing shape flattened to D features, one kernel
copies in both directions:

- pack (to the padded layout): a program reads BR consecutive rows of x (one chunk's) and writes BR rows of the
  padded chunk, zeros in the rows past ``valid_c``; every padded row is written, so the output needs no zero-fill
  and the padding costs no launch of its own;
- unpack (from it): a program reads the valid rows of its padded block and writes them to x; padded rows are
  neither read nor written.

Pack's backward is unpack of the gradient (the padded rows' gradients dropped), unpack's backward is pack of the
gradient (zeros at the padded rows): both copies, no accumulation. Rows are contiguous runs of D elements in both
tensors, so loads and stores are coalesced; large D is split over a second grid axis in blocks of at most
``LAUNCH["max_block_d"]`` features. Values are moved, never converted: the copies equal index_copy and
index_select bit for bit in every dtype.

Tensors of one shape and dtype (q, k and p; v when V = K; g and beta) are copied by one launch, up to ``MAX_X``
of them: a third grid axis picks the tensor, so a layer's re-layout takes two or three launches rather than one
per tensor, forward and backward.

Eagerly the copies run through an autograd Function; under ``torch.compile`` (and for tensor subclasses) through the
custom op ``linattn::relayout`` (lists of tensors in, lists out; a flag for the direction) with a fake
kernel, so graphs do not break.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .registered_ops import define_op
from .triton_compat import patch_interpreter
from .triton_launch import fast_launch
from .triton_ops import distinct_tensors, eager_backward, traced
from .triton_utils import cdiv, next_power_of_2

patch_interpreter()

# elements: the tile a program moves (rows x features); 8192 keeps 64 elements a thread with 4 warps, enough
# bytes in flight per program for a copy while a chunk of 64 rows of 1024 features still spreads over 8 programs
LAUNCH = {"elements": 8192, "max_block_d": 1024, "warps": 4}
MAX_X = 4  # tensors a launch copies (the kernel's pointer pairs)


@fast_launch
@triton.jit
def _relayout_kernel(packed0, padded0, packed1, padded1, packed2, padded2, packed3, padded3, chunk_rows,
                     D: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, EVEN_D: tl.constexpr,
                     TO_PADDED: tl.constexpr, NX: tl.constexpr):
    """Grid (chunks * C // BR, cdiv(D, BD), NX): rows [j * BR, (j + 1) * BR) of padded chunk c and one block of
    features of tensor pair i (packed_i, padded_i; the pairs past NX are not read), copied from packed to padded
    (TO_PADDED, zeros past the chunk's valid rows) or back. D is a constexpr (a model has a few: H K, H V, H), so
    the compiler knows the rows' alignment: narrow rows (D = 8 gates) are vector accesses too, where an int D
    not divisible by 16 left them scalar."""
    i_r, i_d, i_x = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    packed = packed0
    padded = padded0
    if NX > 1:
        if i_x == 1:
            packed = packed1
            padded = padded1
    if NX > 2:
        if i_x == 2:
            packed = packed2
            padded = padded2
    if NX > 3:
        if i_x == 3:
            packed = packed3
            padded = padded3
    SUB: tl.constexpr = C // BR
    i_c = (i_r // SUB).to(tl.int64)
    r = (i_r % SUB) * BR + tl.arange(0, BR)
    start = tl.load(chunk_rows + 2 * i_c)
    valid = tl.load(chunk_rows + 2 * i_c + 1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_r = r < valid
    if EVEN_D:  # no feature mask: the row mask alone is constant along a row, so accesses stay vectorised
        m_read = m_r[:, None]
    else:
        m_d = o_d < D
        m_read = m_r[:, None] & m_d[None, :]
    p_packed = packed + (start + r)[:, None] * D + o_d[None, :]
    p_padded = padded + (i_c * C + r)[:, None] * D + o_d[None, :]
    if TO_PADDED:
        x = tl.load(p_packed, mask=m_read, other=0)
        if EVEN_D:
            tl.store(p_padded, x)
        else:
            tl.store(p_padded, x, mask=m_d[None, :])
    else:
        x = tl.load(p_padded, mask=m_read)
        tl.store(p_packed, x, mask=m_read)


@functools.cache
def _plan(D: int, C: int) -> tuple[int, int, bool, int]:
    """(BR, BD, EVEN_D, feature blocks) of a copy with D features and chunks of C rows, worked out once. Narrow
    rows (gates, beta: D = H) get a block of their own width, so that D = 8 is unmasked 16-byte accesses rather
    than half-masked blocks of 16 features."""
    BD = min(LAUNCH["max_block_d"], max(4, next_power_of_2(D)))
    BR = min(C, max(1, LAUNCH["elements"] // BD))
    return BR, BD, D % BD == 0, cdiv(D, BD)


def _copy(packed: list[torch.Tensor], padded: list[torch.Tensor], chunk_rows: torch.Tensor, C: int,
          to_padded: bool) -> None:
    """Copy between each packed[i] and padded[i] (contiguous, one shape and dtype), MAX_X pairs a launch."""
    chunks = chunk_rows.shape[0]
    D = math.prod(padded[0].shape[2:])
    if chunks == 0 or D == 0:
        return
    BR, BD, even, blocks = _plan(D, C)
    for i in range(0, len(packed), MAX_X):
        a, b = packed[i:i + MAX_X], padded[i:i + MAX_X]
        n = len(a)
        a, b = a + [a[0]] * (MAX_X - n), b + [b[0]] * (MAX_X - n)  # unread beyond NX
        _relayout_kernel[(chunks * (C // BR), blocks, n)](
            packed0=a[0], padded0=b[0], packed1=a[1], padded1=b[1], packed2=a[2], padded2=b[2], packed3=a[3],
            padded3=b[3], chunk_rows=chunk_rows, D=D, C=C, BR=BR, BD=BD, EVEN_D=even, TO_PADDED=to_padded, NX=n,
            num_warps=LAUNCH["warps"])


def _relayout_impl(xs: list[torch.Tensor], chunk_rows: torch.Tensor, size: int, chunk_size: int,
                   to_padded: bool) -> list[torch.Tensor]:
    """Each x copied into the padded layout (``to_padded``; ``size`` its padded rows) or out of it (``size`` the
    packed rows), in new tensors."""
    xs = [x.contiguous() for x in xs]
    outs = [torch.empty(x.shape[0], size, *x.shape[2:], device=x.device, dtype=x.dtype) for x in xs]
    if xs:
        _copy(xs if to_padded else outs, outs if to_padded else xs, chunk_rows, chunk_size, to_padded)
    return outs


def _relayout_fake(xs, chunk_rows, size, chunk_size, to_padded):
    return [x.new_empty(x.shape[0], size, *x.shape[2:]) for x in xs]


_relayout_op = define_op("relayout", _relayout_impl, _relayout_fake)


class _Relayout(torch.autograd.Function):
    """The copy, differentiable: the implementation eagerly, the registered op under torch.compile and for tensor
    subclasses (triton_ops.py says why). Gradients of outputs that are not used arrive as zeros (materialised),
    and their copies give zeros."""

    @staticmethod
    def forward(ctx, to_padded, chunk_rows, size, chunk_size, *xs):
        ctx.eager = not traced(*xs)
        outs = (_relayout_impl if ctx.eager else _relayout_op)(list(xs), chunk_rows, size, chunk_size, to_padded)
        ctx.save_for_backward(chunk_rows)
        ctx.rows, ctx.chunk_size, ctx.to_padded = xs[0].shape[1], chunk_size, to_padded
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        """The copy the other way: packing's gradient is read out of the layout, unpacking's written into it."""
        (chunk_rows,) = ctx.saved_tensors
        run = _relayout_impl if eager_backward(ctx) else _relayout_op
        back = run(list(grads), chunk_rows, ctx.rows, ctx.chunk_size, not ctx.to_padded)
        return None, None, None, None, *back


def _relayout(xs: list[torch.Tensor], chunk_rows: torch.Tensor, size: int, chunk_size: int,
              to_padded: bool) -> list[torch.Tensor]:
    if not xs:
        return []
    if torch.compiler.is_compiling():
        xs = distinct_tensors(xs)
    return list(_Relayout.apply(to_padded, chunk_rows, size, chunk_size, *xs))


def pack(xs: list[torch.Tensor], chunk_rows: torch.Tensor, padded: int, chunk_size: int) -> list[torch.Tensor]:
    """Each x [1, T, ...] of xs (one shape and dtype) as [1, padded, ...], zeros at the padded rows; differentiable.
    Up to MAX_X tensors a launch."""
    return _relayout(xs, chunk_rows, padded, chunk_size, True)


def unpack(xs: list[torch.Tensor], chunk_rows: torch.Tensor, T: int, chunk_size: int) -> list[torch.Tensor]:
    """Each x [1, padded, ...] of xs (one shape and dtype) read back at the T packed rows [1, T, ...];
    differentiable."""
    return _relayout(xs, chunk_rows, T, chunk_size, False)
