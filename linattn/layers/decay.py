"""Layers of the additive family with decays: linear attention, RetNet, GLA."""

from __future__ import annotations

import torch
from torch import Tensor

from linattn.ops.common.positions import apply_rope
from linattn.ops.gla import gla, gla_step
from linattn.ops.linear_attn import linear_attn, linear_attn_step
from linattn.ops.retention import retention, retention_step

from .base import MixerLayer, MixOut, Streams
from .gates import LowRankLogSigmoidGate


class LinearAttentionLayer(MixerLayer):
    """Linear attention (Katharopoulos et al., 2020) on :func:`linattn.ops.linear_attn.linear_attn`.

    phi = elu + 1 (``feature_map``), S_t = S_{t-1} + phi(k_t) v_t^T,
    o_t = S_t^T phi(q_t) / (z_t^T phi(q_t) + eps), z_t = sum_{s<=t} phi(k_s) (``normalize=True``),
    no query scaling, no ShortConv and no output norm by default (the paper's layer).
    """

    op = staticmethod(linear_attn)
    op_step = staticmethod(linear_attn_step)
    step_inplace = True
    default_output_norm = False
    scale = 1.0

    def __init__(self, d_model: int, n_heads: int, *, feature_map: str = "elu", normalize: bool = True,
                 **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        if feature_map not in ("identity", "elu", "relu"):
            raise ValueError(f"feature_map must be one of 'identity', 'elu', 'relu' for the layer; got {feature_map!r}")
        self.feature_map, self.normalize = feature_map, bool(normalize)

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int | Tensor,
                   streams: Streams) -> MixOut:
        return q, k, v, {}, {"feature_map": self.feature_map, "normalize": self.normalize}

    def static_state(self, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """[B, H, K, V + 1] with the normaliser (z rides along as the last value column), else [B, H, K, V]."""
        V = self.head_dim_v + int(self.normalize)
        return torch.zeros(batch_size, self.n_heads, self.head_dim, V, dtype=dtype, device=device)


class RetNetLayer(MixerLayer):
    """Multi-scale retention (RetNet, arXiv 2307.08621) on :func:`linattn.ops.retention.retention`.

    q, k rotated by RoPE (the texts' complex decay; ``rope_theta`` its base, None drops it), fixed per-head decay
    gamma_h = 1 - 2^(-5-h): S_t = gamma_h S_{t-1} + k_t v_t^T, o_t = S_t^T (q_t / sqrt(K));
    output GroupNorm per head (an RMSNorm here) times SiLU(W_g x); value heads twice as wide
    (``head_dim_v`` = 2 head_dim by default); no ShortConv by default.
    """

    op = staticmethod(retention)
    op_step = staticmethod(retention_step)
    step_inplace = True
    default_output_gate = True

    def __init__(self, d_model: int, n_heads: int, *, rope_theta: float | None = 10000.0,
                 head_dim: int | None = None, head_dim_v: int | None = None, **kwargs) -> None:
        if head_dim_v is None and not kwargs.get("tie_kv", False):
            head_dim_v = 2 * (head_dim or max(d_model // n_heads, 1))
        super().__init__(d_model, n_heads, head_dim=head_dim, head_dim_v=head_dim_v, **kwargs)
        self.rope = None if rope_theta is None else {"theta": float(rope_theta)}

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int | Tensor,
                   streams: Streams) -> MixOut:
        if self.rope is not None:
            q, k = apply_rope(q, offset, **self.rope), apply_rope(k, offset, **self.rope)
        return q, k, v, {}, {}


class GLALayer(MixerLayer):
    """Gated linear attention (GLA, arXiv 2312.06635) on :func:`linattn.ops.gla.gla`.

    g_t = logsigmoid(W_2 W_1 x_t + b) / 16 per key channel (rank 16), S_t = diag(exp(g_t)) S_{t-1} +
    k_t v_t^T, o_t = S_t^T (q_t / sqrt(K)); output RMSNorm per head times SiLU(W_g x); no ShortConv
    by default.
    """

    op = staticmethod(gla)
    op_step = staticmethod(gla_step)
    step_inplace = True
    default_output_gate = True

    def __init__(self, d_model: int, n_heads: int, *, gate_rank: int = 16, gate_normaliser: float = 16.0,
                 **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.gate = LowRankLogSigmoidGate(d_model, n_heads, self.head_dim, gate_rank, gate_normaliser)

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        return q, k, v, {"g": self.gate(x).to(q.dtype)}, {}
