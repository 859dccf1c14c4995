"""Token-by-token references of TTT-Linear (arXiv 2407.04620) and Titans' linear memory (arXiv 2501.00663).

Both train an inner linear model online by gradient descent on l_t(W) = 0.5 ||f(k_t; W) - v_t||^2
(see inner.py), in mini-batches of ``mini_batch_size`` tokens: every gradient of a mini-batch is
taken at the weights W_0 the mini-batch started with (the paper's dual form makes this parallel).

    ttt_linear:  W_t = W_{t-1} - eta_t grad l_t(W_0),               o_t = f(scale q_t; W_t)
    titans:      S_t = eta_t S_{t-1} - theta_t grad l_t(M_0)        (momentum, decayed by eta)
                 M_t = (1 - alpha_t) M_{t-1} + S_t                  (weight decay alpha)
                 o_t = M_t^T (scale q_t)

Computed in float32 (float64 for float64 inputs); outputs take the input dtype. The recurrences
are the step functions run over the sequence, so decoding and the reference share one code path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.checks import compute_dtype
from .inner import InnerNorm, error, read
from .state import MiniBatchState


def make_norm(norm_weight: torch.Tensor | None, norm_bias: torch.Tensor | None, norm_eps: float,
              dt: torch.dtype, n_mid: int) -> InnerNorm | None:
    """The inner LayerNorm with weight/bias [H, V] viewed as [H, 1 (x n_mid), V]; None when unused."""
    if norm_weight is None:
        return None
    shape = (norm_weight.shape[0],) + (1,) * n_mid + (norm_weight.shape[1],)
    return InnerNorm(norm_weight.to(dt).reshape(shape), norm_bias.to(dt).reshape(shape), norm_eps)


def ttt_token(state: MiniBatchState, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
              eta_t: torch.Tensor, norm: InnerNorm | None, mini_batch_size: int) -> tuple[torch.Tensor, MiniBatchState]:
    """One TTT token: q_t (scaled), k_t [B, H, K], v_t [B, H, V], eta_t [B, H] in the compute dtype."""
    (W,) = state.current
    err = error(state.start, k_t[..., None, :], v_t[..., None, :], norm)  # [B, H, 1, V], at W_0
    W = W - eta_t[..., None, None] * k_t[..., :, None] * err
    o_t = read(W, q_t[..., None, :], norm)[..., 0, :]
    return o_t, state.advance((W,), mini_batch_size)


def titans_token(state: MiniBatchState, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor,
                 theta_t: torch.Tensor, alpha_t: torch.Tensor, eta_t: torch.Tensor,
                 mini_batch_size: int) -> tuple[torch.Tensor, MiniBatchState]:
    """One Titans token: q_t (scaled), k_t [B, H, K], v_t [B, H, V], theta_t, alpha_t, eta_t [B, H]."""
    M, S = state.current
    err = error(state.start, k_t[..., None, :], v_t[..., None, :], None)  # [B, H, 1, V], at M_0
    S = eta_t[..., None, None] * S - theta_t[..., None, None] * k_t[..., :, None] * err
    M = (1 - alpha_t)[..., None, None] * M + S
    o_t = (q_t[..., None, :] @ M)[..., 0, :]
    return o_t, state.advance((M, S), mini_batch_size)


def run_tokens(token: Callable[..., tuple[torch.Tensor, MiniBatchState]], state: MiniBatchState, n: int,
               *xs: torch.Tensor) -> tuple[torch.Tensor, MiniBatchState]:
    """The first n tokens of ``xs`` ([B, T, ...] in the compute dtype, q scaled) through ``token(state, *x_t)``:
    (o [B, n, H, V], the state after them)."""
    outputs = []
    for t in range(n):
        o_t, state = token(state, *(x[:, t] for x in xs))
        outputs.append(o_t)
    return torch.stack(outputs, dim=1), state


def ttt_linear_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    mini_batch_size: int = 16,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token TTT-Linear (inner LayerNorm + residual when ``norm_weight`` is given)."""
    dt, in_dtype = compute_dtype(q), q.dtype
    B, T, H, K = q.shape
    q, k, v, eta = (x.to(dt) for x in (q, k, v, eta))
    W = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(dt)
    state = MiniBatchState.at_boundary((W,))
    norm = make_norm(norm_weight, norm_bias, norm_eps, dt, 1)
    outputs = []
    for t in range(T):
        o_t, state = ttt_token(state, q[:, t] * scale, k[:, t], v[:, t], eta[:, t], norm, mini_batch_size)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1)
    return o.to(in_dtype), (state.current[0] if output_final_state else None)


def titans_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    alpha: torch.Tensor,
    eta: torch.Tensor,
    *,
    scale: float,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    mini_batch_size: int = 16,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Token-by-token Titans linear memory with momentum and weight decay."""
    dt, in_dtype = compute_dtype(q), q.dtype
    B, T, H, K = q.shape
    q, k, v, theta, alpha, eta = (x.to(dt) for x in (q, k, v, theta, alpha, eta))
    if initial_state is None:
        current = (q.new_zeros(B, H, K, v.shape[-1]), q.new_zeros(B, H, K, v.shape[-1]))
    else:
        current = (initial_state[0].to(dt), initial_state[1].to(dt))
    state = MiniBatchState.at_boundary(current)
    outputs = []
    for t in range(T):
        o_t, state = titans_token(state, q[:, t] * scale, k[:, t], v[:, t], theta[:, t], alpha[:, t], eta[:, t],
                                  mini_batch_size)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1)
    return o.to(in_dtype), (state.current if output_final_state else None)
