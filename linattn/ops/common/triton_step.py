"""Which implementation runs one decoding step: the fused Triton kernel on CUDA, PyTorch elsewhere.

The ops' public step functions (``simple_gla_step``, ``gla_step``, ``delta_rule_step``,
``gated_delta_rule_step``) validate their inputs, then ask :func:`select_step` for the function to
call. The fused kernel (``triton_step_kernel.py``: state tile read once and written once, decay,
delta correction, rank-1 update and read-out in one launch) is chosen when

- the step backend is "auto" and every tensor is on CUDA, or it is "triton" (also on the CPU under
  ``TRITON_INTERPRET=1``: how the tests run it),
- Triton imports, every tensor is float32, bfloat16 or float16 (float64 stays on PyTorch), the key
  dim fits the kernel's tile, and
- no autograd graph is being recorded through the inputs (the kernel has no backward; decoding runs
  under ``torch.no_grad()``).

Otherwise the op's PyTorch step (its reference) runs. Both return (o_t in q_t's dtype, new float32
state) and agree to float32 rounding.

``inplace=True`` (the static decoding path) asks for the new state to be written into the state tensor
the step was given: the fused kernel reads and writes that buffer itself; the PyTorch step's result is
copied into it. Either way the caller's buffer keeps its address, as a captured CUDA graph needs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from linattn import switches

from .checks import check_choice
from .triton_compat import triton_importable

STEP_BACKENDS = switches.STEP_BACKENDS
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def set_step_backend(name: str) -> str:
    """Choose the step implementation from now on (the setting ``step_backend``: ``linattn.settings``,
    ``LINATTN_STEP_BACKEND``): "auto" (fused kernel on CUDA, default), "torch" (always PyTorch) or "triton"
    (fused wherever Triton can run: CUDA, or the CPU under TRITON_INTERPRET=1). Returns the previous setting."""
    check_choice("step backend", name, STEP_BACKENDS)
    return switches.configure(step_backend=name).step_backend


def get_step_backend() -> str:
    """The current step backend setting ("auto", "torch" or "triton")."""
    return switches.current().step_backend


def _fused_ok(q_t: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> bool:
    backend = switches.current().step_backend
    if backend == "torch" or not triton_importable():
        return False
    on_cuda = all(x.is_cuda for x in tensors)
    if not (on_cuda or (backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1")):
        return False
    if any(x.dtype not in _FUSED_DTYPES for x in tensors):
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return False
    from .triton_step_kernel import fits

    return fits(q_t.shape[-1])


def check_inplace(inplace: object, state: object) -> bool:
    """``inplace`` is a bool; when True, ``state`` must be a tensor to write the new state into."""
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    if inplace and not isinstance(state, torch.Tensor):
        raise ValueError("inplace=True needs the state tensor to write the new state into, got state=None")
    return inplace


def _into_state(reference: Callable) -> Callable:
    """``reference`` with its new state copied into the state it was given (its last positional argument)."""

    def step(*args: torch.Tensor | None, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        o_t, new = reference(*args, **kwargs)
        state = args[-1]
        state.copy_(new)
        return o_t, state

    return step


def select_step(family: str, reference: Callable, *tensors: torch.Tensor | None, inplace: bool = False) -> Callable:
    """The fused Triton step of ``family`` ("simple_gla", "gla" or "gated_delta_rule"; the latter also serves
    the delta rule with g_t = None) when it may run on ``tensors`` (q_t first; None entries ignored),
    else ``reference``. Both take the reference step's arguments (the state last). ``inplace``: the returned
    step writes the new state into the state it is given and returns that tensor (module docstring)."""
    present = tuple(x for x in tensors if x is not None)
    if not _fused_ok(present[0], present):
        return _into_state(reference) if inplace else reference
    from .triton_step_kernel import STEP_KERNELS

    kernel = STEP_KERNELS[family]
    return functools.partial(kernel, inplace=True) if inplace else kernel
