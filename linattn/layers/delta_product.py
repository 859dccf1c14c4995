"""Gated DeltaProduct layer: n_h Householder (delta-rule) steps per token."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from linattn.ops.gated_delta_product import gated_delta_product, gated_delta_product_step

from .base import MixerLayer, MixOut, Streams, TokenArgs
from .checks import check_positive_int
from .gates import MambaDecay
from .norms import l2norm


class GatedDeltaProductLayer(MixerLayer):
    """Gated DeltaProduct (arXiv 2502.10297) on :func:`linattn.ops.gated_delta_product.gated_delta_product`.

    Per token t, n = ``num_householder`` (2) keys k_{t,j} (L2-normalised), values v_{t,j} and
    b_{t,j} = sigmoid(W_b x_t)_j (times 2 with ``allow_neg_eigval``) from n-times wider projections;
    g_t = -exp(A_log) softplus(W_a x_t + dt_bias) (``use_gate=False``: no decay, DeltaProduct);
    S <- exp(g_t) S, then S <- (I - b_{t,j} k_{t,j} k_{t,j}^T) S + b_{t,j} k_{t,j} v_{t,j}^T for j < n;
    o_t = S^T (q_t / sqrt(K)) with q L2-normalised. ShortConv on q, k, v; output RMSNorm times SiLU(W_g x).
    """

    op = staticmethod(gated_delta_product)
    op_step = staticmethod(gated_delta_product_step)
    default_short_conv = "qkv"
    default_output_gate = True

    def __init__(self, d_model: int, n_heads: int, *, num_householder: int = 2, use_gate: bool = True,
                 allow_neg_eigval: bool = False, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.num_householder = check_positive_int("num_householder", num_householder)
        self.allow_neg_eigval = bool(allow_neg_eigval)
        self.set_kv_heads(n_heads * num_householder)
        self.b_proj = nn.Linear(d_model, n_heads * num_householder, bias=False)
        self.decay = MambaDecay(d_model, n_heads) if use_gate else None

    def x_projections(self) -> dict[str, nn.Linear]:
        extra = {"b": self.b_proj} if self.decay is None else {"b": self.b_proj, "a": self.decay.a_proj}
        return {**super().x_projections(), **extra}

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        B, T, H, K = q.shape
        n = self.num_householder
        k = l2norm(k.reshape(B, T * n, H, K))
        v = v.reshape(B, T * n, H, -1)
        beta = torch.sigmoid(streams["b"]).reshape(B, T * n, H) * (2 if self.allow_neg_eigval else 1)
        g = None if self.decay is None else self.decay.from_projection(streams["a"])[0].to(q.dtype)
        kw = {"num_householder": n, "allow_neg_eigval": self.allow_neg_eigval}
        return l2norm(q), k, v, {"g": g, "beta": beta.to(q.dtype)}, kw

    def step(self, q: Tensor, k: Tensor, v: Tensor, args: TokenArgs, kwargs: dict[str, Any],
             state: Any) -> tuple[Tensor, Any]:
        """One token: its n sub-steps are k, v, beta [B, n, ...] as they are."""
        g = args["g"]
        o, state = self.op_step(q[:, 0], k, v, g=None if g is None else g[:, 0], beta=args["beta"], state=state,
                                scale=self.scale, **kwargs)
        return o[:, None], state
