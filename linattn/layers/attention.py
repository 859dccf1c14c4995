"""Layers of the softmax family (state = a KVCache): softmax attention, FoX, DeltaFormer, PaTH.

Static decoding keeps keys and values in buffers of ``max_length`` positions (static_attention.py); each
layer's :meth:`static_op_step` writes its token at the row's position and attends over the buffer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from linattn.ops.common.checks import resolve_scale
from linattn.ops.common.kv_cache import KVCache
from linattn.ops.common.positions import rope_config
from linattn.ops.deltaformer import deltaformer, deltaformer_step
from linattn.ops.forgetting_attn import forgetting_attn, forgetting_attn_step
from linattn.ops.path_attn import path_attn, path_attn_step
from linattn.ops.softmax_attn import softmax_attn, softmax_attn_step

from .base import MixerLayer, MixOut, Streams, TokenArgs, run_conv
from .cache import LayerCache
from .checks import check_positive_int
from .norms import l2norm
from .shortconv import ShortConv
from .static_attention import allocate_kv, attend, key_mask, load_kv_rows, rope_at, write_at
from .static_cache import StaticKV, StaticLayerCache


class _KVLayer(MixerLayer):
    """Static decoding of the softmax family: KV buffers of max_length positions (``kv_extras``: per-position
    extras [B, H, L] by name, as the op's KVCache carries them)."""

    kv_extras: tuple[str, ...] = ()

    def kv_heads(self) -> int:
        return self.n_heads

    def static_state(self, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device) -> StaticKV:
        return allocate_kv(batch_size, self.kv_heads(), max_length, self.head_dim, self.head_dim_v, dtype=dtype,
                           device=device, extras=dict.fromkeys(self.kv_extras, self.n_heads))

    def load_static_state(self, buffers: StaticKV, state: KVCache, rows: torch.Tensor) -> None:
        load_kv_rows(buffers, state, rows)

    def token(self, q: Tensor, k: Tensor, v: Tensor, kv: StaticKV) -> tuple[Tensor, Tensor, Tensor, float]:
        """q_t, k_t, v_t [B, heads, *] in the buffers' dtype, and the attention scale."""
        dt = kv.k.dtype
        return q[:, 0].to(dt), k[:, 0].to(dt), v[:, 0].to(dt), resolve_scale(self.scale, self.head_dim)


class _GQALayer(_KVLayer):
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
        self.rope: dict | None = None

    def kv_heads(self) -> int:
        return self.n_kv_heads

    def static_op_step(self, q: Tensor, k: Tensor, v: Tensor, args: TokenArgs, kwargs: dict[str, Any],
                       cache: StaticLayerCache) -> Tensor:
        """RoPE at the row's position, k and v (and FoX's gate) written there, attention over the visible keys
        (FoX: plus G_t - G_s from the cumulative sum of the cached gates, as the cached path forms it)."""
        kv, pos = cache.state, cache.pos
        q_t, k_t, v_t, scale = self.token(q, k, v, kv)
        cfg = rope_config(self.rope)
        if cfg is not None:
            q_t, k_t = rope_at(q_t, pos, **cfg), rope_at(k_t, pos, **cfg)
        write_at(kv.k, pos, k_t)
        write_at(kv.v, pos, v_t)
        bias = None
        if "g" in kv.extras:
            write_at(kv.extras["g"], pos, args["g"][:, 0])
            G = torch.cumsum(kv.extras["g"], dim=-1)  # [B, H, L]
            bias = G.gather(-1, pos.view(-1, 1, 1).expand(*G.shape[:2], 1)) - G
        visible = key_mask(pos, kv.max_length, window_size=self.window_size)
        return attend(q_t, kv.k, kv.v, visible, scale, bias)[:, None].to(q.dtype)


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
        return q, k, v, {}, {"window_size": self.window_size, "rope": self.rope}


class ForgettingAttentionLayer(_GQALayer):
    """Forgetting Transformer (FoX, arXiv 2503.02130) on :func:`linattn.ops.forgetting_attn.forgetting_attn`.

    f_t = sigmoid(W_f x_t + b_f) per head (b_f = 3 at init: f ≈ 0.95), g_t = log f_t,
    o_t = sum_{s<=t} softmax_s(q_t.k_s / sqrt(K) + G_t - G_s) v_s, G = cumsum g; no RoPE (FoX's
    default; ``rope_theta`` to add it), ``window_size`` and ``n_kv_heads`` as softmax attention.
    """

    op = staticmethod(forgetting_attn)
    op_step = staticmethod(forgetting_attn_step)
    kv_extras = ("g",)

    def __init__(self, d_model: int, n_heads: int, *, rope_theta: float | None = None, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.rope = None if rope_theta is None else {"theta": float(rope_theta)}
        self.f_proj = nn.Linear(d_model, n_heads, bias=True)
        nn.init.constant_(self.f_proj.bias, 3.0)

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        g = F.logsigmoid(self.f_proj(x)).to(q.dtype)
        return q, k, v, {"g": g}, {"window_size": self.window_size, "rope": self.rope}


class DeltaFormerLayer(_KVLayer):
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

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int | Tensor,
                   streams: Streams) -> MixOut:
        return q, k, v, {"beta": torch.sigmoid(self.b_proj(x)).to(q.dtype)}, {}

    def static_op_step(self, q: Tensor, k: Tensor, v: Tensor, args: TokenArgs, kwargs: dict[str, Any],
                       cache: StaticLayerCache) -> Tensor:
        """u_t = v_t - b_t (softmax kernel over the strictly past keys) U, then u_t written as the value at the
        row's position and attention of q_t over keys and u's. A row without past keys reads none (its kernel
        row would be empty): it reads all positions, to stay NaN-free, and drops the result."""
        kv, pos = cache.state, cache.pos
        q_t, k_t, v_t, scale = self.token(q, k, v, kv)
        beta_t = args["beta"][:, 0].to(kv.k.dtype)
        past = key_mask(pos, kv.max_length, strict=True) | (pos == 0)[:, None]
        has_past = (pos > 0).to(kv.k.dtype)[:, None, None]
        u_t = v_t - beta_t[..., None] * attend(k_t, kv.k, kv.v, past, scale) * has_past
        write_at(kv.k, pos, k_t)
        write_at(kv.v, pos, u_t)
        return attend(q_t, kv.k, kv.v, key_mask(pos, kv.max_length), scale)[:, None].to(q.dtype)


class PaTHLayer(_KVLayer):
    """PaTH attention (arXiv 2505.16381) on :func:`linattn.ops.path_attn.path_attn`.

    w_t = L2norm(ShortConv(W_w x)_t) (its own learned ShortConv, the paper's choice),
    beta_t = 2 sigmoid(W_b x_t) in (0, 2), H_r = I - b_r w_r w_r^T,
    logit_ts = q_t^T H_t ... H_{s+1} k_s / sqrt(K) (+ G_t - G_s with ``forget_gate=True``,
    g = logsigmoid(W_f x + b_f), b_f = 3 at init); o_t = sum_{s<=t} softmax_s(logit_t.) v_s; no RoPE.
    """

    op = staticmethod(path_attn)
    op_step = staticmethod(path_attn_step)
    default_output_norm = False
    kv_extras = ("log_decay",)

    def __init__(self, d_model: int, n_heads: int, *, forget_gate: bool = False, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        H, K = n_heads, self.head_dim
        self.w_proj = nn.Linear(d_model, H * K, bias=False)
        self.w_conv = ShortConv(H * K, self._conv_args["kernel_size"])
        self.b_proj = nn.Linear(d_model, H, bias=False)
        self.f_proj = nn.Linear(d_model, H, bias=True) if forget_gate else None
        if self.f_proj is not None:
            nn.init.constant_(self.f_proj.bias, 3.0)

    def streams(self, x: Tensor, cache: LayerCache | StaticLayerCache | None,
                cu_seqlens: Tensor | None = None) -> tuple[Streams, Streams]:
        out, new_conv = super().streams(x, cache, cu_seqlens)
        out["w"], new_conv["w"] = run_conv(self.w_conv, "w", self.w_proj(x), cache, cu_seqlens)
        return out, new_conv

    def conv_modules(self) -> dict[str, ShortConv]:
        return {**super().conv_modules(), "w": self.w_conv}

    def static_op_step(self, q: Tensor, k: Tensor, v: Tensor, args: TokenArgs, kwargs: dict[str, Any],
                       cache: StaticLayerCache) -> Tensor:
        """Every buffered key moved by H_t = I - b_t w_t w_t^T (all L positions: the unwritten ones are zero and
        stay so), log decays advanced by g_t; then k_t, v_t and a zero decay written at the row's position and
        attention with the decays times scale as bias (path_attn's gate bias is inside the scale)."""
        kv, pos = cache.state, cache.pos
        q_t, k_t, v_t, scale = self.token(q, k, v, kv)
        dt = kv.k.dtype
        w_t, beta_t = args["w"][:, 0].to(dt), args["beta"][:, 0].to(dt)
        coef = torch.matmul(kv.k, w_t[..., None])  # [B, H, L, 1]: k~_s . w_t
        kv.k.sub_(beta_t[..., None, None] * coef * w_t[:, :, None, :])
        decay = kv.extras["log_decay"]
        if args.get("g") is not None:
            decay.add_(args["g"][:, 0].to(dt)[..., None])
        write_at(kv.k, pos, k_t)
        write_at(kv.v, pos, v_t)
        write_at(decay, pos, torch.zeros_like(beta_t))
        return attend(q_t, kv.k, kv.v, key_mask(pos, kv.max_length), scale, scale * decay)[:, None].to(q.dtype)

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        B, T, H, K = q.shape
        w = l2norm(streams["w"].view(B, T, H, K))
        beta = (2 * torch.sigmoid(self.b_proj(x))).to(q.dtype)
        g = None if self.f_proj is None else F.logsigmoid(self.f_proj(x)).to(q.dtype)
        return q, k, v, {"w": w, "beta": beta, "g": g}, {}
