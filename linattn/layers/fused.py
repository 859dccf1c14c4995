"""Where the layers' fused Triton kernels run: the per-head norms (norms.py) and the Mamba2 decay gate (gates.py).

The setting ``fused_backend`` (``linattn.settings(fused_backend=...)``, ``LINATTN_FUSED_BACKEND``;
linattn/switches.py) is "auto" (the Triton kernels for CUDA tensors when Triton imports, PyTorch otherwise),
"torch", or "triton" (CUDA, or the CPU under TRITON_INTERPRET=1); both compute the same functions in float32.
"""

from __future__ import annotations

import torch

from linattn import switches
from linattn.ops.common.triton_compat import triton_importable

FUSED_BACKENDS = switches.FUSED_BACKENDS


def set_fused_backend(backend: str) -> None:
    """Use ``backend`` ("auto", "torch", "triton") for the layers' fused kernels from now on."""
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, FUSED_BACKENDS))}; got {backend!r}")
    switches.configure(fused_backend=backend)


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether the fused Triton kernels run for input ``x`` under the current ``fused_backend`` setting."""
    backend = switches.current().fused_backend
    if backend == "auto":
        return x.is_cuda and triton_importable()
    return backend == "triton"
