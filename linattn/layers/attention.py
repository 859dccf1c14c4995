"""Layers of the softmax family (state = a KVCache): softmax attention, FoX, DeltaFormer, PaTH."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linattn.ops.deltaformer import deltaformer, deltaformer_step
from linattn.ops.forgetting_attn import forgetting_attn, forgetting_attn_step
from linattn.ops.path_attn import path_attn, path_attn_step
from linattn.ops.softmax_attn import softmax_attn, softmax_attn_step

from .base import MixerLayer, MixOut, Streams
from .cache import LayerCache
from .checks import check_positive_int
from .norms import l2norm
from .shortconv import ShortConv


class _GQALayer(MixerLayer):
    """Softmax-family frame: optional grouped-query attention (``n_kv_heads`` dividing n_heads) and
    sliding window (``window_size``); no ShortConv, output norm or gate by default."""

    default_output_norm = False

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 window_size: int | None = None, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        if n_kv_heads is not None:
            check_positive_int("n_kv_heads", n_kv_heads)
            if n_heads % n_kv_heads:
                raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads} "
                                 f"(valid: {[h for h in range(1, n_heads + 1) if n_heads % h == 0]})")
            self.set_kv_heads(n_kv_heads)
        if window_size is not None:
            check_positive_int("window_size", window_size)
        self.n_kv_heads, self.window_size = n_kv_heads or n_heads, window_size


class SoftmaxAttentionLayer(_GQALayer):
    """Softmax attention (Vaswani et al. 2017) on :func:`linattn.ops.softmax_attn.softmax_attn`.

    o_t = sum_{s<=t} softmax_s(q_t.k_s / sqrt(K)) v_s with RoPE on q, k (``rope_theta`` 10000; None
    for none), keys limited to the last ``window_size`` when given, ``n_kv_heads`` for GQA.
    """

    op = staticmethod(softmax_attn)
    op_step = staticmethod(softmax_attn_step)

    def __init__(self, d_model: int, n_heads: int, *, rope_theta: float | None = 10000.0, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.rope = None if rope_theta is None else {"theta": float(rope_theta)}

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        return q, k, v, [], {"window_size": self.window_size, "rope": self.rope}


class ForgettingAttentionLayer(_GQALayer):
    """Forgetting Transformer (FoX, arXiv 2503.02130) on :func:`linattn.ops.forgetting_attn.forgetting_attn`.

    f_t = sigmoid(W_f x_t + b_f) per head (b_f = 3 at init: f ≈ 0.95), g_t = log f_t,
    o_t = sum_{s<=t} softmax_s(q_t.k_s / sqrt(K) + G_t - G_s) v_s, G = cumsum g; no RoPE (FoX's
    default; ``rope_theta`` to add it), ``window_size`` and ``n_kv_heads`` as softmax attention.
    """

    op = staticmethod(forgetting_attn)
    op_step = staticmethod(forgetting_attn_step)

    def __init__(self, d_model: int, n_heads: int, *, rope_theta: float | None = None, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.rope = None if rope_theta is None else {"theta": float(rope_theta)}
        self.f_proj = nn.Linear(d_model, n_heads, bias=True)
        nn.init.constant_(self.f_proj.bias, 3.0)

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        g = F.logsigmoid(self.f_proj(x)).to(q.dtype)
        return q, k, v, [(g, True)], {"window_size": self.window_size, "rope": self.rope}


class DeltaFormerLayer(MixerLayer):
    """DeltaFormer (arXiv 2505.19488) on :func:`linattn.ops.deltaformer.deltaformer`.

    beta_t = sigmoid(W_b x_t) per head; u_t = v_t - b_t sum_{s<t} kappa_ts u_s with the softmax kernel
    kappa_ts = softmax_{s<t}(k_t.k_s / sqrt(K)), then o_t = sum_{s<=t} softmax_s(q_t.k_s / sqrt(K)) u_s;
    no ShortConv, output norm or gate by default.
    """

    op = staticmethod(deltaformer)
    op_step = staticmethod(deltaformer_step)
    default_output_norm = False

    def __init__(self, d_model: int, n_heads: int, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        return q, k, v, [(torch.sigmoid(self.b_proj(x)).to(q.dtype), True)], {}


class PaTHLayer(MixerLayer):
    """PaTH attention (arXiv 2505.16381) on :func:`linattn.ops.path_attn.path_attn`.

    w_t = L2norm(ShortConv(W_w x)_t) (its own learned ShortConv, the paper's choice),
    beta_t = 2 sigmoid(W_b x_t) in (0, 2), H_r = I - b_r w_r w_r^T,
    logit_ts = q_t^T H_t ... H_{s+1} k_s / sqrt(K) (+ G_t - G_s with ``forget_gate=True``,
    g = logsigmoid(W_f x + b_f), b_f = 3 at init); o_t = sum_{s<=t} softmax_s(logit_t.) v_s; no RoPE.
    """

    op = staticmethod(path_attn)
    op_step = staticmethod(path_attn_step)
    default_output_norm = False

    def __init__(self, d_model: int, n_heads: int, *, forget_gate: bool = False, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        H, K = n_heads, self.head_dim
        self.w_proj = nn.Linear(d_model, H * K, bias=False)
        self.w_conv = ShortConv(H * K, self._conv_args["kernel_size"])
        self.b_proj = nn.Linear(d_model, H, bias=False)
        self.f_proj = nn.Linear(d_model, H, bias=True) if forget_gate else None
        if self.f_proj is not None:
            nn.init.constant_(self.f_proj.bias, 3.0)

    def streams(self, x: Tensor, cache: LayerCache | None) -> tuple[Streams, Streams]:
        out, new_conv = super().streams(x, cache)
        out["w"], new_conv["w"] = self.w_conv(self.w_proj(x), None if cache is None else cache.conv.get("w"))
        return out, new_conv

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        B, T, H, K = q.shape
        w = l2norm(streams["w"].view(B, T, H, K))
        args = [(w, True), ((2 * torch.sigmoid(self.b_proj(x))).to(q.dtype), True)]
        if self.f_proj is not None:
            args.append((F.logsigmoid(self.f_proj(x)).to(q.dtype), True))
        return q, k, v, args, {}
