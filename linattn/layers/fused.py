"""Where the layers' fused Triton kernels run: the per-head norms (norms.py) and the Mamba2 decay gate (gates.py).

``FUSED_BACKEND`` is "auto" (the Triton kernels for CUDA tensors when Triton imports, PyTorch otherwise),
"torch", or "triton" (CUDA, or the CPU under TRITON_INTERPRET=1); both compute the same functions in float32.
Set it with :func:`set_fused_backend` or the environment variable ``LINATTN_FUSED_BACKEND``.
"""

from __future__ import annotations

import os

import torch

from linattn.ops.common.triton_compat import triton_importable

FUSED_BACKENDS = ("auto", "torch", "triton")
FUSED_BACKEND = os.environ.get("LINATTN_FUSED_BACKEND", "auto")


def set_fused_backend(backend: str) -> None:
    """Use ``backend`` ("auto", "torch", "triton") for the layers' fused kernels from now on."""
    global FUSED_BACKEND
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, FUSED_BACKENDS))}; got {backend!r}")
    FUSED_BACKEND = backend


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether the fused Triton kernels run for input ``x`` under the current ``FUSED_BACKEND``."""
    if FUSED_BACKEND == "auto":
        return x.is_cuda and triton_importable()
    if FUSED_BACKEND not in FUSED_BACKENDS:
        raise ValueError(f"LINATTN_FUSED_BACKEND must be one of {', '.join(FUSED_BACKENDS)}; got {FUSED_BACKEND!r}")
    return FUSED_BACKEND == "triton"
