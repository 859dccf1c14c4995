"""TTT-Linear with the inner LayerNorm + residual: the paper's dual form, one mini-batch per chunk.

With the norm the inner gradient is not linear in W, so mini-batches cannot be chained inside a
chunk by a linear solve; instead every chunk is exactly one mini-batch of b tokens (chunk_size is
not used). Entering mini-batch n with W_n, every token's gradient is taken at W_n (inner.py):

    err_s = dLN^T (k_s + LN(W_n^T k_s) - v_s)                   (all b tokens at once)
    W_t^T q_t = W_n^T q_t - sum_{s <= t} eta_s (q_t . k_s) err_s,     o_t = q_t + LN(W_t^T q_t)
    W_{n+1} = W_n - sum_s eta_s k_s err_s^T

The masked (Q K^T) products and the read-out are batched over all mini-batches; the loop over
mini-batches carries W and computes the errors (which depend on W_n).
"""

from __future__ import annotations

import torch

from ..common.checks import compute_dtype
from ..common.masking import tril_matmul
from ..common.state_scan import chunks_heads_first, chunks_heads_last
from .inner import error
from .reference import make_norm


def ttt_linear_norm_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    mini_batch_size: int,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and final W of TTT-Linear with inner norm (inputs validated by ``ttt_linear``)."""
    dt, in_dtype = compute_dtype(q), q.dtype
    B, T, H, K = q.shape
    b = mini_batch_size
    q, k, v = (chunks_heads_first(x.to(dt), b) for x in (q, k, v))  # [B, H, N, b, K or V]
    eta = chunks_heads_first(eta.to(dt), b)  # [B, H, N, b]; padded tokens have eta = 0: no update
    norm = make_norm(norm_weight, norm_bias, norm_eps, dt, 1)
    W = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(dt)
    Ws, errs = [], []
    # unbind once (its backward stacks once; indexing in the loop would be quadratic in T)
    for k_n, v_n, ek_n in zip(k.unbind(2), v.unbind(2), (eta[..., None] * k).unbind(2)):
        err = error(W, k_n, v_n, norm)  # [B, H, b, V]
        Ws.append(W)
        errs.append(err)
        W = W - ek_n.transpose(-1, -2) @ err
    W_in, err = torch.stack(Ws, dim=2), torch.stack(errs, dim=2)

    q = q * scale
    causal = torch.ones(b, b, dtype=torch.bool, device=q.device).tril()
    z = q @ W_in - tril_matmul(((q @ k.transpose(-1, -2)) * eta[..., None, :]).masked_fill(~causal, 0), err)
    o = q + make_norm(norm_weight, norm_bias, norm_eps, dt, 2).forward(z)[0]
    return chunks_heads_last(o, T).to(in_dtype), W
