"""The two reference kernels of softmax attention (the blockwise one is common/blockwise_softmax.py).

    o_i = sum_j P_ij v_j,   P = softmax_j(q_i . k_j scale + bias_ij),   bias_ij = -inf where j is hidden,
    bias_ij = -slope_h |i - j|  (ALiBi)  +  G_i - G_j, G = cumsum(g)  (FoX forgetting gate)

Queries sit at the last Tq of the Tk key positions (a KV cache of Tk - Tq keys comes first). Every
kernel has the signature of :func:`~linattn.ops.common.blockwise_softmax.blockwise_attention`:
q [B, Tq, H, K], k [B, Tk, H_kv, K], v [B, Tk, H_kv, V], H_kv dividing H; log_gates [B, Tk, H].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.positions import alibi_bias, visibility_mask


def expand_kv_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """[B, T, H_kv, D] -> [B, T, H, D]: query head h reads key/value head h // (H // H_kv)."""
    return x.repeat_interleave(H // x.shape[2], dim=2)


def attention_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, window_size: int | None,
                   alibi_slopes: torch.Tensor | None, log_gates: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """Additive logits bias [B or 1, H or 1, Tq, Tk] from ALiBi and the forgetting gates, -inf where hidden;
    None when there is neither (the mask alone is then given by :func:`visibility_mask`)."""
    if alibi_slopes is None and log_gates is None:
        return None
    bias = torch.zeros(1, 1, len(q_pos), len(k_pos), dtype=dtype, device=q_pos.device)
    if alibi_slopes is not None:
        bias = bias + alibi_bias(alibi_slopes.to(dtype), q_pos, k_pos)[None]
    if log_gates is not None:
        G = torch.cumsum(log_gates.to(dtype), dim=1).transpose(1, 2)  # [B, H, Tk]
        bias = bias + (G[..., q_pos, None] - G[..., None, :])
    visible = visibility_mask(q_pos, k_pos, causal=causal, window_size=window_size)
    return bias.masked_fill(~visible, float("-inf"))


def masked_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                             causal: bool = True, window_size: int | None = None,
                             alibi_slopes: torch.Tensor | None = None, log_gates: torch.Tensor | None = None,
                             chunk_size: int = 64) -> torch.Tensor:
    """The explicit [Tq, Tk] masked softmax, read next to the equation (the "recurrent" backend)."""
    Tq, Tk, H = q.shape[1], k.shape[1], q.shape[2]
    k, v = expand_kv_heads(k, H), expand_kv_heads(v, H)
    q_pos = torch.arange(Tk - Tq, Tk, device=q.device)
    k_pos = torch.arange(Tk, device=q.device)
    logits = torch.einsum("bihk,bjhk->bhij", q, k) * scale
    bias = attention_bias(q_pos, k_pos, causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                          log_gates=log_gates, dtype=q.dtype)
    if bias is not None:
        logits = logits + bias
    visible = visibility_mask(q_pos, k_pos, causal=causal, window_size=window_size)
    logits = logits.masked_fill(~visible, float("-inf"))  # by selection: NaN + (-inf) would be NaN
    P = torch.softmax(logits, dim=-1)
    return torch.einsum("bhij,bjhv->bihv", P, v)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True,
                   window_size: int | None = None, alibi_slopes: torch.Tensor | None = None,
                   log_gates: torch.Tensor | None = None, chunk_size: int = 64) -> torch.Tensor:
    """torch's scaled_dot_product_attention (the "parallel" backend): ``is_causal`` when the mask is plain
    causal, a boolean mask for windows and caches, an additive float mask only for ALiBi / forgetting."""
    Tq, Tk, H = q.shape[1], k.shape[1], q.shape[2]
    q_pos = torch.arange(Tk - Tq, Tk, device=q.device)
    k_pos = torch.arange(Tk, device=q.device)
    bias = attention_bias(q_pos, k_pos, causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                          log_gates=log_gates, dtype=q.dtype)
    is_causal, mask = False, bias
    if bias is None and window_size is None and (Tq == Tk or not causal):
        is_causal = causal  # SDPA's is_causal is aligned top-left: only right when there is no cache
    elif bias is None:
        mask = visibility_mask(q_pos, k_pos, causal=causal, window_size=window_size)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, expand_kv_heads(k, H), expand_kv_heads(v, H)))
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal, scale=scale)
    return o.transpose(1, 2)
