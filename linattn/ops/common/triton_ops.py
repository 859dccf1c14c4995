"""Turning Triton forwards and backwards into differentiable backends that torch.compile traces without breaks.

Every Triton op of the library is two Python implementations (forward, backward) plus autograd rules:

- :func:`~linattn.ops.common.registered_ops.define_op` registers an implementation with the dispatcher as
  ``linattn::<name>``: one kernel for every device and a fake kernel for tracing, nothing else, so a compiled
  graph calls it at the cost of the dispatcher alone (a layer makes about 16 such calls per training step).
- :func:`op_function` wires autograd with a ``torch.autograd.Function`` that calls the implementations directly
  when eager (the least host time) and the registered ops under ``torch.compile`` or for tensor subclasses, which
  Dynamo traces as a forward and a backward graph of opaque ops.

simple_gla and gla share the calling convention ``forward(q, k, v, g, scale, initial_state, C, keep, cu_chunks,
chunk_rows) -> (o, final_state, *saved)`` and ``backward(q, k, v, g, scale, initial_state, C, do, d_final_state,
saved, cu_chunks, chunk_rows) -> (dq, dk, dv, dg, d_initial_state)`` (``cu_chunks``, ``chunk_rows``: packed
sequences, see
:func:`gated_rnn_backend`): with ``keep`` (a backward pass will follow) the forward may return up to two intermediate
tensors (``saved``; e.g. gla's chunk states and intra-chunk scores) that the backward then reads
instead of recomputing them; ``saved`` holds None where nothing was kept. :func:`gated_rnn_backend` registers the
two and returns the ``backend="triton"`` implementation with the op's keyword signature.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .checks import CHUNK_SIZES
from .packed_call import chunk_layout, current_packing
from .registered_ops import define_op


def op_function(name: str, forward: Callable, forward_op: Callable | None, setup_context: Callable,
                backward: Callable, non_differentiable: tuple[int, ...] = ()) -> Callable:
    """A differentiable call: a ``torch.autograd.Function`` that runs ``forward(*inputs)`` eagerly, or
    ``forward_op(*inputs)`` (the same implementation registered by :func:`define_op`; None: always ``forward``)
    under torch.compile and for tensor subclasses, then ``setup_context(ctx, inputs, output)`` and, in the backward
    pass, ``backward(ctx, *grads)``, which calls the backward implementation or its op as :func:`eager_backward`
    says. Outputs at ``non_differentiable`` (tensors kept for the backward pass) get no gradient; gradients of
    unused outputs arrive as None."""

    def fwd(ctx, *inputs):
        eager = forward_op is None or not traced(*inputs)
        output = (forward if eager else forward_op)(*inputs)
        setup_context(ctx, inputs, output)
        ctx.eager = eager
        ctx.set_materialize_grads(False)
        if non_differentiable:  # (Dynamo expects a tuple of outputs once this is called, even with nothing)
            ctx.mark_non_differentiable(*(output[i] for i in non_differentiable))
        return output

    function = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd),
                                                        "backward": staticmethod(backward)})

    def call(*inputs):
        if torch.compiler.is_compiling():
            inputs = distinct_tensors(inputs)
        return function.apply(*inputs)

    call.__name__ = call.__qualname__ = name
    return call


def distinct_tensors(inputs: tuple | list) -> list:
    """``inputs`` with a view in place of each tensor that appeared earlier in them: Dynamo does not trace an
    autograd Function given one tensor at two inputs (q = k in a test, or packing x, g, x); a view is another
    tensor to it, and gradients flow through it."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and any(x is y for y in out):
            x = x.view_as(x)
        out.append(x)
    return out


def traced(*inputs: object) -> bool:
    """Whether a call on ``inputs`` goes through the registered op: under torch.compile, and when a tensor among
    them is a subclass other than nn.Parameter (fake tensors of other tracers, functional tensors, DTensors);
    plain eager tensors and parameters call the implementation."""
    return torch.compiler.is_compiling() or any(
        isinstance(x, torch.Tensor) and type(x) not in _PLAIN_TENSORS for x in inputs)


# a layer's parameters (e.g. a gate's A_log, a norm's weight) are handed to the ops as they are: nn.Parameter is a
# subclass that dispatches as a plain tensor, so it takes the eager path (not the registered op's dispatcher)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def eager_backward(ctx) -> bool:
    """Whether a backward rule of an :func:`op_function` calls the backward implementation (the forward ran eagerly)
    rather than its registered op (the forward ran the op: torch.compile, tensor subclasses)."""
    return ctx.eager


def needs_backward(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will call the backward of an op on these inputs: a forward then keeps what the backward
    reads (nothing is kept for inference, under torch.no_grad() or without inputs that require grad)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def _no_saved(q, k, v, g, chunk_size):
    return ()


def gated_rnn_backend(name: str, forward: Callable, backward: Callable, saved_like: Callable = _no_saved
                      ) -> Callable:
    """Register ``linattn::<name>_fwd`` / ``_bwd`` and return the implementation
    ``impl(q, k, v, g, *, scale, initial_state=None, output_final_state=False, chunk_size=64)``.
    ``saved_like(q, k, v, g, chunk_size)``: empty tensors shaped like what the forward keeps (for tracing).
    ``forward`` and ``backward`` take keyword arguments ``cu_chunks`` and ``chunk_rows``: None, or for packed
    sequences (the call runs inside :func:`linattn.ops.common.packed_call.packed_call`, B = 1) the chunks of
    :func:`~linattn.ops.common.packed_call.chunk_layout`: each sequence's first chunk, [N + 1] int32 (states then
    [N, H, K, V]), and each chunk's first token and token count, [chunks, 2] int64; the kernels read the packed
    tokens where they lie."""

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None,
            scale: float, chunk_size: int, keep: bool = False, cu_chunks: torch.Tensor | None = None,
            chunk_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        o, ht, *saved = forward(q, k, v, g, scale, initial_state, chunk_size, keep, cu_chunks=cu_chunks,
                                chunk_rows=chunk_rows)
        return o, ht, *_pad_saved(q, saved)

    def bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None,
            scale: float, chunk_size: int, do: torch.Tensor, dht: torch.Tensor | None,
            saved0: torch.Tensor | None = None, saved1: torch.Tensor | None = None,
            cu_chunks: torch.Tensor | None = None, chunk_rows: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        saved = tuple(None if x is None or x.numel() == 0 else x for x in (saved0, saved1))
        return backward(q, k, v, g, scale, initial_state, chunk_size, do, dht, saved, cu_chunks=cu_chunks,
                        chunk_rows=chunk_rows)

    def final_state_like(q: torch.Tensor, v: torch.Tensor, cu_chunks: torch.Tensor | None) -> torch.Tensor:
        B, T, H, K = q.shape
        rows = B if cu_chunks is None else cu_chunks.shape[0] - 1
        return q.new_empty(rows, H, K, v.shape[-1], dtype=torch.float32)

    def fwd_fake(q, k, v, g, initial_state, scale, chunk_size, keep=False, cu_chunks=None, chunk_rows=None):
        saved = saved_like(q, k, v, g, chunk_size) if keep else ()
        return torch.empty_like(v), final_state_like(q, v, cu_chunks), *_pad_saved(q, saved)

    def bwd_fake(q, k, v, g, initial_state, scale, chunk_size, do, dht, saved0=None, saved1=None, cu_chunks=None,
                 chunk_rows=None):
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
                final_state_like(q, v, cu_chunks))

    fwd_op = define_op(f"{name}_fwd", fwd, fwd_fake)
    bwd_op = define_op(f"{name}_bwd", bwd, bwd_fake)

    def setup_context(ctx, inputs, output):
        q, k, v, g, initial_state, scale, chunk_size, keep, cu_chunks, chunk_rows = inputs
        ctx.save_for_backward(q, k, v, g, initial_state, output[2], output[3], cu_chunks, chunk_rows)
        ctx.scale, ctx.chunk_size = scale, chunk_size

    def backward_rule(ctx, do, dht, d_saved0, d_saved1):
        q, k, v, g, initial_state, saved0, saved1, cu_chunks, chunk_rows = ctx.saved_tensors
        run_bwd = bwd if eager_backward(ctx) else bwd_op
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dq, dk, dv, dg, dh0 = run_bwd(q, k, v, g, initial_state, ctx.scale, ctx.chunk_size, do,
                                      None if dht is None else dht.contiguous(), saved0, saved1, cu_chunks,
                                      chunk_rows)
        return dq, dk, dv, dg, (dh0 if initial_state is not None else None), None, None, None, None, None

    function = op_function(f"{name}_function", fwd, fwd_op, setup_context, backward_rule, non_differentiable=(2, 3))

    def implementation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, scale: float,
                       initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                       chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
        if chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size must be 16, 32, 64 or 128 for backend='triton', got {chunk_size}")
        dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
        s0 = None if initial_state is None else initial_state.float().contiguous()
        # the kernels read g in its own dtype (bf16 gates: half the bytes of float32) and compute in float32
        g = g.contiguous() if g.dtype in (torch.bfloat16, torch.float16, torch.float32) else g.float().contiguous()
        packing, cu_chunks, chunk_rows = current_packing(), None, None
        if packing is not None:  # packed sequences, read where they lie: the kernels take each chunk's tokens
            layout = chunk_layout(packing, chunk_size, q.device)
            cu_chunks, chunk_rows = layout.cu_chunks, layout.chunk_rows
        keep = needs_backward(q, k, v, g, s0)
        o, ht, _, _ = function(q, k, v, g, s0, float(scale), chunk_size, keep, cu_chunks, chunk_rows)
        return o, (ht if output_final_state else None)

    implementation.native_cu_seqlens = True  # packed sequences run in one call, where they lie
    implementation.__name__ = implementation.__qualname__ = name
    implementation.__doc__ = (f"backend='triton' ({name}): Triton kernels forward and backward, inputs validated by "
                              "the public op; chunk_size 16, 32, 64 or 128.")
    return implementation


def _pad_saved(q: torch.Tensor, saved) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly two tensors: what the forward kept in its places (an empty tensor for a None, which the backward
    recomputes), then empty tensors (custom ops have a fixed number of outputs)."""
    saved = [q.new_empty(0) if x is None else x for x in saved]
    if len(saved) > 2:
        raise ValueError(f"a gated RNN forward may keep at most two tensors, got {len(saved)}")
    return tuple(saved) + tuple(q.new_empty(0) for _ in range(2 - len(saved)))
