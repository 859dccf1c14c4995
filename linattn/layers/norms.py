"""The per-head normalisations around a mixer, with fused Triton kernels on CUDA (norms_triton.py).

- :func:`l2norm`: x / max(||x||, eps) over the last dim (q and k of the delta rules), computed in float32 and
  returned in x's dtype (under autocast a float32 q/k would send the op's kernels down their exact-float32 path).
- :func:`rms_norm_gated`: a layer's output RMSNorm per head, times SiLU(gate) when the layer has an output gate.

``NORM_BACKEND`` picks the implementation: "auto" (the Triton kernels for CUDA tensors when Triton imports,
PyTorch otherwise), "torch", or "triton" (CUDA, or the CPU under TRITON_INTERPRET=1); both compute the same
function in float32. Set it with :func:`set_norm_backend` or the environment variable ``LINATTN_NORM_BACKEND``.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from linattn.ops.common.triton_compat import triton_available

NORM_BACKENDS = ("auto", "torch", "triton")
NORM_BACKEND = os.environ.get("LINATTN_NORM_BACKEND", "auto")
L2_EPS = 1e-6

_triton_available = functools.cache(triton_available)


def set_norm_backend(backend: str) -> None:
    """Use ``backend`` ("auto", "torch", "triton") for :func:`l2norm` and :func:`rms_norm_gated` from now on."""
    global NORM_BACKEND
    if backend not in NORM_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, NORM_BACKENDS))}; got {backend!r}")
    NORM_BACKEND = backend


def _use_triton(x: torch.Tensor) -> bool:
    if NORM_BACKEND == "auto":
        return x.is_cuda and _triton_available()
    if NORM_BACKEND not in NORM_BACKENDS:
        raise ValueError(f"LINATTN_NORM_BACKEND must be one of {', '.join(NORM_BACKENDS)}; got {NORM_BACKEND!r}")
    return NORM_BACKEND == "triton"


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / max(||x||, 1e-6) over the last dim, computed in float32, returned in x's dtype."""
    if _use_triton(x):
        from .norms_triton import l2norm_triton

        return l2norm_triton(x, L2_EPS)
    return F.normalize(x.float(), p=2.0, dim=-1, eps=L2_EPS).to(x.dtype)


def rms_norm_gated(o: torch.Tensor, norm: nn.RMSNorm, gate: torch.Tensor | None) -> torch.Tensor:
    """``norm(o)`` over the last dim (a head's channels), times SiLU(gate) (``gate`` shaped like o) when given.
    Returns the gate's dtype (o's without a gate) on the Triton path; PyTorch's follows autocast."""
    if _use_triton(o):
        from .norms_triton import rms_norm_gated_triton

        eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        return rms_norm_gated_triton(o, norm.weight, gate, eps)
    y = norm(o)
    return y if gate is None else y * F.silu(gate)
