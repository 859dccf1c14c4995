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


def l2norm_pair(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`l2norm` of q, of k); one fused kernel each way for both where the fused kernels run and the two
    have one shape and dtype."""
    if use_fused_kernels(q) and q.shape == k.shape and q.dtype == k.dtype:
        from .norms_triton import l2norm_pair_triton

        return l2norm_pair_triton(q, k, L2_EPS)
    return l2norm(q), l2norm(k)


def rms_norm_gated(o: torch.Tensor, norm: nn.RMSNorm, gate: torch.Tensor | None) -> torch.Tensor:
    """``norm(o)`` over the last dim (a head's channels), times SiLU(gate) (``gate`` shaped like o) when given.
    Returns the gate's dtype (o's without a gate) on the Triton path; PyTorch's follows autocast."""
    return _norm_gate(o, norm.weight, norm.eps, gate)


def _norm_gate(o: torch.Tensor, weight: torch.Tensor, eps: float | None, gate: torch.Tensor | None) -> torch.Tensor:
    """:func:`rms_norm_gated` with the norm's weight and eps given as such (the weight then can be an input whose
    gradient autograd returns)."""
    if use_fused_kernels(o):
        from .norms_triton import rms_norm_gated_triton

        return rms_norm_gated_triton(o, weight, gate, _eps(eps))
    y = F.rms_norm(o, (o.shape[-1],), weight, eps)  # what nn.RMSNorm.forward computes
    return y if gate is None else y * F.silu(gate)


class NormGateProject(torch.autograd.Function):
    """out = rms_norm_gated(o, weight, gate) flattened over the heads, @ proj_weight^T; the norm's output y is
    recomputed in the backward pass instead of being kept.

    Kept as autograd would run it, the projection keeps y for its weight gradient while the norm keeps o and the
    gate for its own: y is a third tensor of o's size. Recomputing it costs one elementwise pass over o and the
    gate (one fused kernel on CUDA) in the backward pass, against the projection's two matmuls there, and saves
    y's bytes in every layer from the forward pass to the backward pass. The projection's gradients are formed
    as autograd's linear forms them (in the autocast dtype when autocast was on in the forward pass), and the
    norm's by autograd through the recomputed y."""

    @staticmethod
    def forward(ctx, o, weight, gate, proj_weight, eps, flat_shape):
        dev = o.device.type
        ctx.autocast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        ctx.eps, ctx.flat_shape = eps, flat_shape
        ctx.fused = use_fused_kernels(o)
        if ctx.fused:  # the kernels directly: the backward pass then needs no autograd graph of its own
            from .norms_triton import rms_norm_gated_forward

            o = o.contiguous()
            gate = None if gate is None else gate.contiguous()
            y, rstd = rms_norm_gated_forward(o, weight.contiguous(), gate, _eps(eps))
            ctx.save_for_backward(o, weight, gate, proj_weight, rstd)
        else:
            ctx.save_for_backward(o, weight, gate, proj_weight)
            y = _norm_gate(o, weight, eps, gate)
        return F.linear(y.reshape(flat_shape), proj_weight)  # autocast casts y and the weight as nn.Linear would

    @staticmethod
    def backward(ctx, dout):
        if ctx.fused:
            return NormGateProject.fused_backward(ctx, dout)
        o, weight, gate, proj_weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with torch.enable_grad():
            ins = [x.detach().requires_grad_(need) for x, need in ((o, needs[0]), (weight, needs[1]))]
            gate_in = None if gate is None else gate.detach().requires_grad_(needs[2])
            with torch.autocast(o.device.type, dtype=ctx.autocast or torch.bfloat16, enabled=ctx.autocast is not None):
                y = _norm_gate(ins[0], ins[1], ctx.eps, gate_in).reshape(ctx.flat_shape)
            # the linear's operands as autocast cast them in the forward pass
            yc = y.to(ctx.autocast) if ctx.autocast is not None else y
        w = proj_weight.to(yc.dtype)
        d2 = dout.reshape(-1, dout.shape[-1])
        dproj = (d2.t() @ yc.detach().reshape(-1, yc.shape[-1])).to(proj_weight.dtype) if needs[3] else None
        dy = (d2 @ w).view(yc.shape)
        wrt = [x for x in (ins[0], ins[1], gate_in) if x is not None and x.requires_grad]
        grads = iter(torch.autograd.grad(yc, wrt, dy) if wrt else ())
        do, dweight = (next(grads) if x.requires_grad else None for x in ins)
        dgate = next(grads) if gate_in is not None and gate_in.requires_grad else None
        return do, dweight, dgate, dproj, None, None

    @staticmethod
    def fused_backward(ctx, dout):
        """The backward pass on the Triton kernels, which :meth:`backward` would reach through autograd: dy from
        the projection, then one kernel for the norm's gradients and y again (for the projection's weight
        gradient), with the forward's per-row rstd."""
        from .norms_triton import rms_norm_gated_backward

        o, weight, gate, proj_weight, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        y_dtype = o.dtype if gate is None else gate.dtype
        # the projection's operands as autocast cast them in the forward pass
        lin_dtype = ctx.autocast if ctx.autocast is not None else y_dtype
        d2 = dout.reshape(-1, dout.shape[-1])
        dy = (d2 @ proj_weight.to(lin_dtype)).view(o.shape).to(y_dtype)
        do, dweight, dgate, y = rms_norm_gated_backward(o, weight.contiguous(), gate, rstd, dy, output=needs[3])
        dproj = (d2.t() @ y.reshape(-1, ctx.flat_shape[-1]).to(lin_dtype)).to(proj_weight.dtype) if needs[3] else None
        return (do if needs[0] else None, dweight if needs[1] else None,
                dgate if gate is not None and needs[2] else None, dproj, None, None)


def _eps(eps: float | None) -> float:
    """The norm's eps as RMSNorm takes it: None means float32's machine epsilon."""
    return eps if eps is not None else torch.finfo(torch.float32).eps


def norm_gate_project(o: torch.Tensor, norm: nn.RMSNorm, gate: torch.Tensor | None, proj: nn.Linear,
                      flat_shape: tuple[int, ...]) -> torch.Tensor:
    """proj(rms_norm_gated(o, norm, gate).reshape(flat_shape)) for a bias-free ``proj``, without keeping the norm's
    output for the backward pass (:class:`NormGateProject`). Under torch.compile, and where no gradient is
    needed, the plain composition runs (the compiler's partitioner chooses what to keep and recompute itself)."""
    tensors = [x for x in (o, gate, norm.weight, proj.weight) if x is not None]
    plain = (torch.compiler.is_compiling() or proj.bias is not None or norm.weight is None
             or not torch.is_grad_enabled() or not any(x.requires_grad for x in tensors)
             or any(type(x) is not torch.Tensor and not isinstance(x, nn.Parameter) for x in tensors))
    if plain:
        return proj(rms_norm_gated(o, norm, gate).reshape(flat_shape))
    return NormGateProject.apply(o, norm.weight, gate, proj.weight, norm.eps, tuple(flat_shape))
