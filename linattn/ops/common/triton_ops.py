"""Turning a gated linear RNN's Triton forward and backward into a differentiable backend.

simple_gla and gla share the calling convention ``forward(q, k, v, g, scale, initial_state, C) ->
(o, final_state)`` and ``backward(q, k, v, g, scale, initial_state, C, do, d_final_state) ->
(dq, dk, dv, dg, d_initial_state)``. :func:`gated_rnn_backend` registers the two as
``torch.library`` custom ops (so ``torch.compile`` graphs do not break on them), wires autograd,
and returns the ``backend="triton"`` implementation with the op's keyword signature.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .checks import CHUNK_SIZES


def gated_rnn_backend(name: str, forward: Callable, backward: Callable) -> Callable:
    """Register ``linattn::<name>_fwd`` / ``_bwd`` and return the implementation
    ``impl(q, k, v, g, *, scale, initial_state=None, output_final_state=False, chunk_size=64)``."""

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None,
            scale: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(q, k, v, g, scale, initial_state, chunk_size)

    def bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None,
            scale: float, chunk_size: int, do: torch.Tensor, dht: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward(q, k, v, g, scale, initial_state, chunk_size, do, dht)

    fwd_op = torch.library.custom_op(f"linattn::{name}_fwd", fwd, mutates_args=())
    bwd_op = torch.library.custom_op(f"linattn::{name}_bwd", bwd, mutates_args=())

    def final_state_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, H, K = q.shape
        return q.new_empty(B, H, K, v.shape[-1], dtype=torch.float32)

    @fwd_op.register_fake
    def _(q, k, v, g, initial_state, scale, chunk_size):
        return torch.empty_like(v), final_state_like(q, v)

    @bwd_op.register_fake
    def _(q, k, v, g, initial_state, scale, chunk_size, do, dht):
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
                final_state_like(q, v))

    def setup_context(ctx, inputs, output):
        q, k, v, g, initial_state, scale, chunk_size = inputs
        ctx.save_for_backward(q, k, v, g, initial_state)
        ctx.scale, ctx.chunk_size = scale, chunk_size

    def backward_rule(ctx, do, dht):
        q, k, v, g, initial_state = ctx.saved_tensors
        dq, dk, dv, dg, dh0 = bwd_op(q, k, v, g, initial_state, ctx.scale, ctx.chunk_size, do.contiguous(),
                                     None if dht is None else dht.contiguous())
        return dq, dk, dv, dg, (dh0 if initial_state is not None else None), None, None

    fwd_op.register_autograd(backward_rule, setup_context=setup_context)

    def implementation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, scale: float,
                       initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                       chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
        if chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size must be 16, 32, 64 or 128 for backend='triton', got {chunk_size}")
        dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
        s0 = None if initial_state is None else initial_state.float().contiguous()
        o, ht = fwd_op(q, k, v, g.float().contiguous(), s0, float(scale), chunk_size)
        return o, (ht if output_final_state else None)

    implementation.__name__ = implementation.__qualname__ = name
    implementation.__doc__ = (f"backend='triton' ({name}): Triton kernels forward and backward, inputs validated by "
                              "the public op; chunk_size 16, 32, 64 or 128.")
    return implementation
