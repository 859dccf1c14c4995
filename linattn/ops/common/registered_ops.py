"""Python functions registered with the dispatcher as ``linattn::<name>`` ops, for torch.compile graphs.

:func:`define_op` registers an implementation (one kernel for every device) and a fake kernel for tracing, and lets
autograd fall through: a compiled graph calls the op at the cost of the dispatcher alone, and sees it as one opaque
node (inductor neither traces into it nor fuses it into its consumers). No ``torch.library.custom_op`` wrapper:
its generated autograd kernel and alias checks run Python on every call (about 10 us more per call on a 2-core
CPU host, more on a GPU host). What needs gradients wraps the op in an autograd Function
(:func:`linattn.ops.common.triton_ops.op_function`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LIBRARY = torch.library.Library("linattn", "FRAGMENT")


def define_op(name: str, implementation: Callable, fake: Callable, *, any_strides: bool = False
              ) -> torch._ops.OpOverload:
    """Register ``implementation`` (type-hinted; returns new tensors, mutates none) as ``linattn::<name>`` for
    every device, with ``fake`` (same arguments: empty tensors of the outputs' shapes) for tracing; return the
    op to call. Autograd falls through the op (its outputs never require grad).

    ``any_strides``: the implementation takes its tensor arguments with any strides, so inductor may hand it the
    layouts it chose (tag ``flexible_layout``). Without it inductor gives every argument the strides it had when
    traced, copying where its own layout differs: on CUDA it pads the row stride of a matmul's output whose rows
    are not a multiple of 128 bytes (``comprehensive_padding``), and an op over such an output then costs a full
    copy of it."""
    schema = torch.library.infer_schema(implementation, mutates_args=())
    LIBRARY.define(name + schema, tags=(torch.Tag.flexible_layout,) if any_strides else ())
    LIBRARY.impl(name, implementation, "CompositeExplicitAutograd")
    # autograd passes straight through (no fallback kernel runs per call)
    LIBRARY.impl(name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"linattn::{name}", fake, lib=LIBRARY)
    return getattr(torch.ops.linattn, name).default
