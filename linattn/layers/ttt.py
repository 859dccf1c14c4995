"""Layers of the online learners: TTT-Linear and Titans (mini-batch gradient descent inside the layer).

The ops close a mini-batch at the end of every call, so a layer with a cache runs the op only on whole
mini-batches and steps the tokens that fill a partial one: prefill of any length then single-token
steps equals one full forward (whose mini-batches start at position 0).

Static decoding keeps the current weights and each row's mini-batch start weights in buffers; a row's
place in its mini-batch is pos % mini_batch_size (rows of a batch may differ), and the start weights are
replaced per row by a ``torch.where`` at the row's mini-batch end, so no step branches on a position.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from linattn.ops.ttt import MiniBatchState, titans, titans_step, ttt_linear, ttt_linear_step

from .base import MixerLayer, MixOut, Streams, TokenArgs
from .norms import l2norm_pair
from .static_cache import StaticLayerCache, StaticMiniBatch, copy_rows_


class _MiniBatchLayer(MixerLayer):
    """Shared by TTT-Linear and Titans: mini-batch-aligned op calls (see the module docstring)."""

    def __init__(self, d_model: int, n_heads: int, *, mini_batch_size: int = 16, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        if not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}")
        self.mini_batch_size = mini_batch_size

    def run_op(self, q: Tensor, k: Tensor, v: Tensor, args: TokenArgs, kwargs: dict[str, Any], state: Any,
               use_cache: bool) -> tuple[Tensor, Any]:
        mbs, T = self.mini_batch_size, q.shape[1]
        count = state.count if isinstance(state, MiniBatchState) else 0
        head = min(T, (mbs - count) % mbs)  # tokens that complete the current mini-batch
        body = (T - head) // mbs * mbs if use_cache else T - head  # whole mini-batches for the op
        outs = []
        for t in range(T):
            if head <= t < head + body:
                if t == head:
                    if isinstance(state, MiniBatchState):  # at a boundary: the op takes W, or (M, S)
                        state = state.current[0] if len(state.current) == 1 else tuple(state.current)
                    sl = slice(head, head + body)
                    o, state = self.op(q[:, sl], k[:, sl], v[:, sl], **{n: a[:, sl] for n, a in args.items()},
                                       scale=self.scale, initial_state=state, output_final_state=use_cache,
                                       **kwargs, **self.op_kwargs())
                    outs.append(o)
                continue
            sl = slice(t, t + 1)
            o, state = self.step(q[:, sl], k[:, sl], v[:, sl], {n: a[:, sl] for n, a in args.items()}, kwargs,
                                 state)
            outs.append(o)
        return torch.cat(outs, dim=1), state

    n_weights = 1  # tensors in the learner's state: ttt_linear (W,), titans (M, S)

    def static_state(self, batch_size: int, max_length: int, dtype: torch.dtype,
                     device: torch.device) -> StaticMiniBatch:
        shape = (batch_size, self.n_heads, self.head_dim, self.head_dim_v)
        current = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_weights))
        return StaticMiniBatch(current, torch.zeros(shape, dtype=dtype, device=device))

    def load_static_state(self, buffers: StaticMiniBatch, state: Any, rows: Tensor) -> None:
        """The cached path's state: the op's final state (a mini-batch boundary) or a MiniBatchState."""
        if isinstance(state, MiniBatchState):
            current, start = state.current, state.start
        else:
            current = (state,) if isinstance(state, Tensor) else tuple(state)
            start = current[0]
        copy_rows_(buffers.current, current, rows)
        copy_rows_(buffers.start, start, rows)

    def static_op_step(self, q: Tensor, k: Tensor, v: Tensor, args: TokenArgs, kwargs: dict[str, Any],
                       cache: StaticLayerCache) -> Tensor:
        """The op's step from each row's mini-batch start, then start <- current where the row's mini-batch ends."""
        buf: StaticMiniBatch = cache.state
        o, state = self.step(q, k, v, args, kwargs, MiniBatchState(buf.current, buf.start, 0))
        for dst, src in zip(buf.current, state.current):
            dst.copy_(src)
        ends = ((cache.pos + 1) % self.mini_batch_size == 0).view(-1, 1, 1, 1)
        buf.start.copy_(torch.where(ends, buf.current[0], buf.start))
        return o


class TTTLinearLayer(_MiniBatchLayer):
    """TTT-Linear (Sun et al., arXiv 2407.04620) on :func:`linattn.ops.ttt.ttt_linear`.

    Inner model f(x; W) = x + LN(W^T x) (``inner_norm=True``, learnable LN weight/bias per head; needs
    head_dim_v == head_dim), trained on l_t(W) = ½‖f(k_t; W) - v_t‖² by mini-batch gradient descent
    (``mini_batch_size`` 16, gradients at the mini-batch's start) with the learned per-token rate
    eta_t = (base_lr / K) sigmoid(W_eta x_t); output o_t = f(q_t / sqrt(K); W_t). ShortConv on q, k by
    default (the paper's Mamba-style backbone); output RMSNorm times SiLU(W_g x).
    """

    op = staticmethod(ttt_linear)
    op_step = staticmethod(ttt_linear_step)
    default_short_conv = "qk"
    default_output_gate = True
    qk_feature_map = "identity"

    def __init__(self, d_model: int, n_heads: int, *, inner_norm: bool = True, base_lr: float = 1.0,
                 **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        if inner_norm and self.head_dim_v != self.head_dim:
            raise ValueError(f"inner_norm=True needs head_dim_v == head_dim, got {self.head_dim_v} and {self.head_dim}")
        self.inner_norm, self.base_lr = bool(inner_norm), float(base_lr)
        self.eta_proj = nn.Linear(d_model, n_heads, bias=True)
        if self.inner_norm:
            self.ln_weight = nn.Parameter(torch.ones(n_heads, self.head_dim_v))
            self.ln_bias = nn.Parameter(torch.zeros(n_heads, self.head_dim_v))

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        eta = (self.base_lr / self.head_dim) * torch.sigmoid(self.eta_proj(x))
        kw: dict[str, Any] = {"mini_batch_size": self.mini_batch_size, "inner_norm": self.inner_norm}
        if self.inner_norm:
            kw.update(norm_weight=self.ln_weight, norm_bias=self.ln_bias)
        return q, k, v, {"eta": eta.to(q.dtype)}, kw


class TitansLayer(_MiniBatchLayer):
    """Titans' neural memory with a linear memory (Behrouz et al., arXiv 2501.00663) on
    :func:`linattn.ops.ttt.titans`.

    q, k L2-normalised (after the ShortConvs on q, k, v, the paper's default); per token and head
    theta_t = sigmoid(W_theta x_t) (learning rate), alpha_t = sigmoid(W_alpha x_t) (weight decay, bias
    -4 at init), eta_t = sigmoid(W_eta x_t) (momentum);
    S_t = eta_t S_{t-1} - theta_t k_t (M_0^T k_t - v_t)^T, M_t = (1 - alpha_t) M_{t-1} + S_t,
    o_t = M_t^T (q_t / sqrt(K)), mini-batches of ``mini_batch_size``; output RMSNorm times SiLU(W_g x).
    """

    op = staticmethod(titans)
    op_step = staticmethod(titans_step)
    default_short_conv = "qkv"
    qk_feature_map = "l2"
    default_output_gate = True
    n_weights = 2

    def __init__(self, d_model: int, n_heads: int, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        self.gate_proj = nn.Linear(d_model, 3 * n_heads, bias=True)
        with torch.no_grad():
            self.gate_proj.bias.view(3, n_heads)[1].fill_(-4.0)

    def mix_inputs(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, offset: int, streams: Streams) -> MixOut:
        theta, alpha, eta = torch.sigmoid(self.gate_proj(x)).to(q.dtype).chunk(3, dim=-1)
        args = {"theta": theta, "alpha": alpha, "eta": eta}
        return *l2norm_pair(q, k), v, args, {"mini_batch_size": self.mini_batch_size}

