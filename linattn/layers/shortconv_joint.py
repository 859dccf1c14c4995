"""A layer's ShortConvs as one differentiable op over the joint projection they read (Triton kernels).

A layer projects its input once for every stream of :meth:`~linattn.layers.base.MixerLayer.x_projections`: y = x W^T
with the streams' weights stacked, each stream a range of y's columns, the ShortConv streams (q, k, v) first and
the small per-head streams (a gate's, a step size's) after them. This op takes y whole:

    outputs = [act(conv_i(y[:, :, C_i])) for each conv stream i] + [y[:, :, C_j] for each other stream j]

(C_i: stream i's column range; one depthwise kernel per stream, the rows of ``weight``). Forward: the ShortConvs
of all conv streams in one launch of shortconv_triton.py's forward kernel, each output a tensor of its own (so
what a consumer keeps of one stream does not keep the others alive), and a copy of each small stream. Backward:
y's gradient is written in place, each conv stream's dx by the dx kernel straight into its columns and each small
stream's gradient copied into its columns. Convolved one slice at a time instead, autograd assembles y's gradient
from a gradient per slice: a concatenation when eager, and under torch.compile a copy kernel per slice (on an
H100, 2.3 ms of the benchmark model's 75 ms training step). Packed sequences (y [1, T, ...]) pass ``pos``, each
row's position inside its own sequence: every sequence is convolved alone (shortconv_triton.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ops.common.registered_ops import define_op
from ..ops.common.triton_ops import eager_backward, op_function
from .shortconv_triton import conv_streams_bwd, conv_streams_fwd, rows_contiguous


def _fwd(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_widths: list[int],
         pass_widths: list[int], silu: bool, pos: torch.Tensor | None = None) -> list[torch.Tensor]:
    y, weight, bias, pos = _kernel_layouts(y, weight, bias, pos)
    Dc = sum(conv_widths)
    outs = conv_streams_fwd(y if Dc == y.shape[-1] else y[..., :Dc], None, weight, bias, silu, conv_widths, pos)
    first = Dc
    for width in pass_widths:
        outs.append(y[..., first:first + width].contiguous())
        first += width
    return outs


def _fwd_fake(y, weight, bias, conv_widths, pass_widths, silu, pos=None):
    B, T, _ = y.shape
    return [y.new_empty(B, T, width) for width in (*conv_widths, *pass_widths)]


def _kernel_layouts(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pos: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The arguments as the kernels take them: y with unit channel stride (its batch and row strides are free, so
    a padded matmul output is read in place), the rest contiguous. The ops accept any strides (``any_strides``):
    under torch.compile these calls copy nothing unless inductor chose an unusual layout."""
    return (rows_contiguous(y), weight.contiguous(), None if bias is None else bias.contiguous(),
            None if pos is None else pos.contiguous())


_fwd_op = define_op("short_conv_streams_fwd", _fwd, _fwd_fake, any_strides=True)


def _bwd(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_widths: list[int],
         pass_widths: list[int], silu: bool, grads: list[torch.Tensor | None], pos: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, d_weight, d_bias (empty without a bias)) from the gradients of the outputs (None: zeros)."""
    y, weight, bias, pos = _kernel_layouts(y, weight, bias, pos)
    Dc, n = sum(conv_widths), len(conv_widths)
    dy = y.new_empty(y.shape)  # contiguous, whatever y's row stride
    conv_grads = [torch.zeros_like(y[..., :w]) if g is None else g for g, w in zip(grads[:n], conv_widths)]
    _, _, dw, db = conv_streams_bwd(y if Dc == y.shape[-1] else y[..., :Dc], None, weight, bias, silu, conv_grads,
                                    dx=dy if Dc == y.shape[-1] else dy[..., :Dc], pos=pos)
    first = Dc
    for width, g in zip(pass_widths, grads[n:]):
        if g is None:
            dy[..., first:first + width].zero_()
        else:
            dy[..., first:first + width].copy_(g)
        first += width
    return dy, dw, db


def _bwd_fake(y, weight, bias, conv_widths, pass_widths, silu, grads, pos=None):
    db = weight.new_empty(weight.shape[0] if bias is not None else 0,
                          dtype=weight.dtype if bias is None else bias.dtype)
    return y.new_empty(y.shape), weight.new_empty(weight.shape), db


_bwd_op = define_op("short_conv_streams_bwd", _bwd, _bwd_fake, any_strides=True)


def _joint_weight(weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The streams' depthwise kernels as one [sum D_i, W] tensor (each weight [D_i, W] or a Conv1d's [D_i, 1, W])."""
    rows = [w.reshape(w.shape[0], w.shape[-1]) for w in weights]
    return rows[0].contiguous() if len(rows) == 1 else torch.cat(rows)


def _forward(y, bias, pos, conv_widths, pass_widths, silu, *weights):
    return tuple(_fwd(y, _joint_weight(weights), bias, conv_widths, pass_widths, silu, pos))


def _forward_op(y, bias, pos, conv_widths, pass_widths, silu, *weights):
    return tuple(_fwd_op(y, _joint_weight(weights), bias, conv_widths, pass_widths, silu, pos))


def _setup_context(ctx, inputs, output):
    y, bias, pos, conv_widths, pass_widths, silu, *weights = inputs
    ctx.save_for_backward(y, bias, pos, *weights)
    ctx.widths, ctx.silu = (conv_widths, pass_widths), silu


def _backward(ctx, *grads):
    y, bias, pos, *weights = ctx.saved_tensors
    run_bwd = _bwd if eager_backward(ctx) else _bwd_op
    dy, dw, db = run_bwd(y, _joint_weight(weights), bias, *ctx.widths, ctx.silu, list(grads), pos)
    # each stream's kernel gets its rows of the joint gradient, shaped like its weight (no copies)
    dws = [d.view(w.shape) for d, w in zip(dw.split(ctx.widths[0]), weights)] if len(weights) > 1 else \
        [dw.view(weights[0].shape)]
    return (dy, (db if bias is not None else None), None, None, None, None, *dws)


_differentiable = op_function("ShortConvStreams", _forward, _forward_op, _setup_context, _backward)


def conv_streams(y: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor], bias: torch.Tensor | None,
                 conv_widths: list[int], pass_widths: list[int], silu: bool, pos: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, ...]:
    """The streams of a joint projection y [B, T, sum(conv_widths) + sum(pass_widths)] (contiguous): one
    ShortConv output per conv stream (``weight`` [sum(conv_widths), W], or one weight per conv stream, [D_i, W] or
    a Conv1d's [D_i, 1, W], e.g. the ShortConvs' own parameters: joined inside the op, which saves the autograd
    nodes of their slicing and concatenation; ``bias`` the same rows or None; SiLU when ``silu``), then a copy of
    each other stream; each [B, T, width]. Differentiable in y, the weights and bias (module docstring). ``pos``:
    packed sequences (y [1, T, ...]), each row's position inside its own sequence. CUDA tensors, or the CPU under
    TRITON_INTERPRET=1; checked by the layer."""
    weights = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
    if len(weights) != 1 and [w.shape[0] for w in weights] != list(conv_widths):
        raise ValueError(f"weight: one [D_i, W] tensor per conv stream of widths {list(conv_widths)}, got shapes "
                         f"{[tuple(w.shape) for w in weights]}")
    return _differentiable(y.contiguous(), bias, None if pos is None else pos.contiguous(), list(conv_widths),
                           list(pass_widths), bool(silu), *weights)
