"""Mamba2-style layer on the simple_gla op (scalar data-dependent decay, SSD)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from linattn.ops.simple_gla import simple_gla, simple_gla_step

from .base import MixerLayer, MixOut, Streams
from .gates import MambaDecay


class Mamba2Layer(MixerLayer):
    """Mamba2 (SSD) token mixer, arXiv 2405.21060, on :func:`linattn.ops.simple_gla.simple_gla`.

    Per head h: dt_t = softplus(W_a x_t + dt_bias_h), A_h = -exp(A_log_h),
        S_t = exp(dt_t A_h) S_{t-1} + (dt_t B_t) x_t^T,   y_t = S_t^T C_t + D_h x_t
    with C = q, B = k, x = v (one B, C per head, i.e. ngroups = n_heads), no query scaling, the
    ShortConv on x, B and C by default (short_conv="qkv"), and the output RMSNorm(y) * SiLU(W_z x).
    """

    op = staticmethod(simple_gla)
    op_step = staticmethod(simple_gla_step)
    step_inplace = True
    default_short_conv = "qkv"
    default_output_gate = True
    scale = 1.0

    def __init__(self, d_model: int, n_heads: int, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.decay = MambaDecay(d_model, n_heads)
        self.D = nn.Parameter(torch.ones(n_heads))

    def x_projections(self) -> dict[str, nn.Linear]:
        return {**super().x_projections(), "a": self.decay.a_proj}

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        g, dt = self.decay.from_projection(streams["a"])
        return q, k * dt[..., None].to(k.dtype), v, [(g.to(q.dtype), True)], {}

    def skip(self, o: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return o + self.D[:, None].to(o.dtype) * v
