"""The per-head normalisations around a mixer, with fused Triton kernels on CUDA (norms_triton.py).

- :func:`l2norm`: x / max(||x||, eps) over the last dim (q and k of the delta rules), computed in float32 and
  returned in x's dtype (under autocast a float32 q/k would send the op's kernels down their exact-float32 path).
- :func:`rms_norm_gated`: a layer's output RMSNorm per head, times SiLU(gate) when the layer has an output gate.

fused.py decides between the Triton kernels and PyTorch (``set_fused_backend``, ``LINATTN_FUSED_BACKEND``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import use_fused_kernels

L2_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / max(||x||, 1e-6) over the last dim, computed in float32, returned in x's dtype."""
    if use_fused_kernels(x):
        from .norms_triton import l2norm_triton

        return l2norm_triton(x, L2_EPS)
    return F.normalize(x.float(), p=2.0, dim=-1, eps=L2_EPS).to(x.dtype)


def rms_norm_gated(o: torch.Tensor, norm: nn.RMSNorm, gate: torch.Tensor | None) -> torch.Tensor:
    """``norm(o)`` over the last dim (a head's channels), times SiLU(gate) (``gate`` shaped like o) when given.
    Returns the gate's dtype (o's without a gate) on the Triton path; PyTorch's follows autocast."""
    if use_fused_kernels(o):
        from .norms_triton import rms_norm_gated_triton

        eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        return rms_norm_gated_triton(o, norm.weight, gate, eps)
    y = norm(o)
    return y if gate is None else y * F.silu(gate)
