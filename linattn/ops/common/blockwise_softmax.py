"""Blockwise softmax attention in plain PyTorch: online softmax over key blocks, memory T x C (not T x T).

    o_i = sum_j softmax_j(q_i . k_j scale + bias_ij + mask_ij) v_j

for queries at the last Tq of the Tk key positions (a KV cache of length Tk - Tq before them), with an
optional causal / sliding-window mask, ALiBi bias -slope_h |i - j| and a data-dependent "forgetting"
bias G_i - G_j, G = cumsum of per-position log gates g <= 0 (FoX, arXiv 2503.02130).

Layout: the key sequence is padded at the front so that the first query starts a block of C = chunk_size
positions, and at the end to a multiple of C; query block a is then key block n0 + a. The work is
batched over all blocks at once for one "lag" d = (query block) - (key block) at a time, so the only
Python loop is over lags (over ceil(window / C) + 1 of them with a sliding window). Per lag:

  * the relative distance i - j = d C + t - s is the same for every block pair (one [C, C] pattern);
  * the forgetting bias is c_t - c_s + O_d, with c the block-local cumulative gates and O_d the sum of
    the gate totals of the d blocks in between, accumulated lag by lag: no cumulative sum over the
    whole sequence is ever formed, so nothing loses precision or overflows for long T.

A lag is skipped when an upper bound of its logits (|q_t| max |k_s| + the largest gate / ALiBi bias) is
more than 80 below every row's running max: its weights would be < 2e-35. With forgetting gates g <= 0 or
ALiBi the bias only falls with the lag, so the first lag pruned by a sequence-wide bound ends the loop:
strong forgetting costs O(T) per query instead of O(T^2). Skipping reads tensor values, so it is done in
eager mode only: under torch.compile every lag is computed (a skipped lag adds exactly nothing, so the result is
the same; only the work differs) and the graph has no data-dependent branch. Which entries of a lag are masked
depends on positions alone and is decided from Python ints, the same eager and compiled.

Forward keeps the running max, normaliser and output (flash-attention style) and saves only the
row log-sum-exp; backward recomputes each lag's probabilities (dS = P (dP - rowsum(dO o))), so
memory stays linear in T for training too. Gradients of the gates: dG_r = -(column sum of dS at key r)
(row sums of dS are zero), and dg = reverse cumulative sum of dG.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    log_gates: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """softmax(q k^T scale + bias + mask) v, blockwise over keys, differentiable in q, k, v, log_gates.

    Args: q [B, Tq, H, K] (queries at positions Tk - Tq .. Tk - 1); k [B, Tk, H_kv, K]; v [B, Tk, H_kv, V]
    with H_kv dividing H (query head h reads key/value head h // (H // H_kv)); window_size w: each query
    sees keys with i - w < j <= i (|i - j| < w if not causal); alibi_slopes [H]: bias -slope_h |i - j|;
    log_gates [B, Tk, H]: bias G_i - G_j, G = cumsum(log_gates) (causal only). All tensors in one
    floating dtype (the math runs in it). Returns o [B, Tq, H, V].
    """
    if log_gates is not None and not causal:
        raise ValueError("log_gates (forgetting bias) needs causal=True")
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} positions, more than the {k.shape[1]} keys")
    return _BlockwiseAttention.apply(q, k, v, log_gates, alibi_slopes, scale, causal, window_size, chunk_size)


@dataclass
class _Lag:
    """One lag d: query blocks a0:a1 against key blocks j0:j1 (j = n0 + a - d)."""

    d: int
    a0: int
    a1: int
    j0: int
    j1: int
    logits: torch.Tensor  # [B, H_kv, nb, G C, C] (rows: the G query heads of a kv head), hidden entries -inf


class _Blocks:
    """Blocked views of one call's inputs and the per-lag logits (shared by forward and backward).

    Queries [B, H_kv, Nq, G C, K] stack the G query heads that share a key/value head as rows, so one
    batched matmul per lag serves grouped-query attention without copying keys or values.
    """

    def __init__(self, q, k, v, log_gates, slopes, scale, causal, window_size, C):
        B, Tq, H, K = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        self.causal, self.window, self.C = causal, window_size, C
        self.Tq, self.Tk, self.Hkv, self.G = Tq, Tk, Hkv, H // Hkv
        T0 = Tk - Tq
        self.P0 = (-T0) % C  # front padding of the keys: the queries start a block
        self.n0 = (T0 + self.P0) // C  # key block of the first query block
        self.Nq = -(-Tq // C)
        self.Nk = self.n0 + self.Nq
        self.end_pad_q = self.Nq * C - Tq
        self.end_pad_k = self.Nk * C - self.P0 - Tk
        self.q = self.block_queries(q * scale)  # pre-scaled queries [B, H_kv, Nq, G C, K]
        self.k = self.block_keys(k)  # [B, H_kv, Nk, C, K]
        self.v = self.block_keys(v)
        pos = torch.arange(self.Nk * C, device=q.device) - self.P0
        self.key_valid = ((pos >= 0) & (pos < Tk)).view(self.Nk, C)
        t = torch.arange(C, device=q.device)
        self.in_block = t[:, None] - t[None, :]  # t - s
        self.slopes = None if slopes is None else slopes.to(q.dtype).reshape(1, Hkv, 1, self.G, 1, 1)
        self.c = None
        if log_gates is not None:
            g = F.pad(log_gates, (0, 0, self.P0, self.end_pad_k))  # neutral zeros: [B, Nk C, H]
            g = g.reshape(B, self.Nk, C, Hkv, self.G).permute(0, 3, 1, 4, 2)  # [B, H_kv, Nk, G, C]
            self.c = torch.cumsum(g, dim=-1)  # block-local cumulative gates
            self.totals = self.c[..., -1]  # [B, H_kv, Nk, G]
        # lags are skipped only in eager mode (module docstring): the bounds read tensor values
        self.prunable = (self.c is not None or self.slopes is not None) and may_skip_lags()
        if self.prunable:  # what bounds a lag's logits (see _pruned)
            self.q_norm = self.q.norm(dim=-1).view(B, Hkv, self.Nq, self.G, C)
            self.k_norm_max = self.k.norm(dim=-1).amax(dim=-1)  # [B, H_kv, Nk]
            self.c_min = None if self.c is None else self.c.amin(dim=-1)  # [B, H_kv, Nk, G]
            self.q_valid = (torch.arange(self.Nq * C, device=q.device) < Tq).view(self.Nq, C)

    def block_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Tq, H, D] -> [B, H_kv, Nq, G C, D] (zero-padded at the end)."""
        B, D = x.shape[0], x.shape[-1]
        x = F.pad(x, (0, 0, 0, 0, 0, self.end_pad_q))
        x = x.reshape(B, self.Nq, self.C, self.Hkv, self.G, D).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(B, self.Hkv, self.Nq, self.G * self.C, D)

    def unblock_queries(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`block_queries`."""
        B, D = x.shape[0], x.shape[-1]
        x = x.reshape(B, self.Hkv, self.Nq, self.G, self.C, D).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, self.Nq * self.C, self.Hkv * self.G, D)[:, : self.Tq]

    def block_keys(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Tk, H_kv, D] -> [B, H_kv, Nk, C, D] (zero-padded at both ends)."""
        B, _, Hkv, D = x.shape
        x = F.pad(x, (0, 0, 0, 0, self.P0, self.end_pad_k))
        return x.reshape(B, self.Nk, self.C, Hkv, D).permute(0, 3, 1, 2, 4).contiguous()

    def unblock_keys(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H_kv, Nk, C, D] -> [B, Tk, H_kv, D]."""
        B, Hkv, Nk, C, D = x.shape
        return x.permute(0, 2, 3, 1, 4).reshape(B, Nk * C, Hkv, D)[:, self.P0: self.P0 + self.Tk]

    def unblock_gates(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H_kv, Nk, G, C] per key position -> [B, Nk C, H] (padding kept)."""
        B, Hkv, Nk, G, C = x.shape
        return x.permute(0, 2, 4, 1, 3).reshape(B, Nk * C, Hkv * G)

    def lag_runs(self) -> tuple[range, ...]:
        """Lags in runs of growing distance: 0, 1, 2, ... then, when not causal, -1, -2, ... Lag 0 comes first
        (every query sees itself there, so running maxima become finite)."""
        C, w = self.C, self.window
        reach = self.Nk - 1 if w is None else min(self.Nk - 1, (w + C - 2) // C)
        runs = (range(reach + 1),)
        if not self.causal:
            runs += (range(-1, -min(reach, self.Nq - 1) - 1, -1),)
        return runs

    def iter_logits(self, reference: torch.Tensor) -> Iterator[_Lag]:
        """Masked, biased logits of every lag with at least one block pair, except the lags whose logits are
        provably all below ``reference`` + UNDERFLOW for every row (``reference`` [B, H_kv, Nq, G C]: the
        running max in forward, read as it is updated; the log-sum-exp in backward)."""
        offset = None if self.c is None else torch.zeros_like(self.totals[:, :, : self.Nq])
        # with g <= 0 (block totals <= 0) and ALiBi, the bias only falls as the lag grows: once a bound that
        # holds for every block of the sequence prunes a lag, it prunes all the farther ones of the run too
        monotone = self.prunable and (self.c is None or bool((self.totals <= 0).all()))
        for run in self.lag_runs():
            for d in run:
                a0, a1 = max(0, d - self.n0), min(self.Nq, self.Nq + d)
                if a0 >= a1:
                    continue
                j0, j1 = self.n0 + a0 - d, self.n0 + a1 - d
                if offset is not None and d > 0:  # O_d = O_{d-1} + total of the key block j = n0 + a - d
                    offset[:, :, a0:a1] += self.totals[:, :, j0:j1]
                if d != 0 and monotone and self._pruned(d, a0, a1, None, offset, reference):
                    break
                if d != 0 and self.prunable and self._pruned(d, a0, a1, slice(j0, j1), offset, reference):
                    continue
                yield _Lag(d, a0, a1, j0, j1, self._logits(d, a0, a1, j0, j1, offset))

    def _pruned(self, d, a0, a1, keys, offset, reference) -> bool:
        """Whether every weight of the lag is below exp(UNDERFLOW), judged from an upper bound of its logits:
        q_t.k_s <= |q_t| max_s |k_s| (Cauchy-Schwarz), G_i - G_j <= c_t + O_d - min_s c_s, ALiBi
        -slope (smallest distance of the lag), with the maxima / minima over the lag's key blocks ``keys``
        or (None) over the whole sequence. Strong forgetting or ALiBi thus costs O(T) per query, not O(T^2)
        (the idea of adaptive computation pruning for FoX, arXiv 2504.06949)."""
        every = slice(None) if keys is None else keys
        k_max = self.k_norm_max[:, :, every]
        k_max = k_max.amax(dim=-1, keepdim=True) if keys is None else k_max
        bound = self.q_norm[:, :, a0:a1] * k_max[..., None, None]  # [B, H_kv, nb, G, C]
        if self.c is not None:
            c_min = self.c_min.amin(dim=2, keepdim=True) if keys is None else self.c_min[:, :, keys]
            c_q = self.c[:, :, self.n0 + a0: self.n0 + a1] + offset[:, :, a0:a1, :, None]
            bound = bound + (c_q - c_min[..., None])
        if self.slopes is not None:
            bound = bound - self.slopes[..., 0] * max(0, abs(d) * self.C - (self.C - 1))
        ref = reference[:, :, a0:a1].view(bound.shape)
        return bool(((bound - ref < UNDERFLOW) | ~self.q_valid[a0:a1, None, :]).all())

    def _logits(self, d, a0, a1, j0, j1, offset) -> torch.Tensor:
        logits = torch.matmul(self.q[:, :, a0:a1], self.k[:, :, j0:j1].transpose(-1, -2))
        B, Hkv, nb = logits.shape[:3]
        view = logits.view(B, Hkv, nb, self.G, self.C, self.C)  # [..., query head in group, t, s]
        dist = d * self.C + self.in_block  # i - j, the same for every block pair of this lag
        if self.slopes is not None:
            view.sub_(self.slopes * dist.abs().to(logits.dtype))
        if self.c is not None:  # G_i - G_j = (c_t + O_d) - c_s
            view.add_((self.c[:, :, self.n0 + a0: self.n0 + a1] + offset[:, :, a0:a1, :, None])[..., None])
            view.sub_(self.c[:, :, j0:j1, :, None, :])
        if self._masks_some(d, j0, j1):
            view.masked_fill_(~self._visible(dist, j0, j1)[:, None], float("-inf"))
        return logits

    def _visible(self, dist: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
        """[nb, C, C] which keys of blocks j0:j1 the queries see (causal, window, not padding)."""
        visible = dist >= 0 if self.causal else torch.ones_like(dist, dtype=torch.bool)
        if self.window is not None:
            visible = visible & (dist.abs() < self.window)
        return visible & self.key_valid[j0:j1, None, :]

    def _masks_some(self, d: int, j0: int, j1: int) -> bool:
        """Whether lag ``d`` (key blocks j0:j1) hides any entry of :meth:`_visible`, decided from Python ints (no
        tensor read, so no host sync and no graph break): the lag's distances i - j span d C - (C - 1) ..
        d C + (C - 1), and the padding keys lie in the first and the last key block."""
        C = self.C
        lowest, farthest = d * C - (C - 1), abs(d) * C + (C - 1)
        if self.causal and lowest < 0:
            return True
        if self.window is not None and farthest >= self.window:
            return True
        return (j0 == 0 and self.P0 > 0) or (j1 == self.Nk and self.end_pad_k > 0)


# exp of x <= -80 is below 2e-35, which no softmax sum in float32 or float64 can see: such weights are taken
# as 0. Mapping those logits to -inf first (one cheap pass) avoids the very slow underflow path of CPU exp
# (about 10x at x < -87), and a lag whose weights all are that small is skipped (strong forgetting, ALiBi).
UNDERFLOW = -80.0


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """In-place exp of shifted logits (all <= 0), with entries below UNDERFLOW set to exactly 0."""
    return F.threshold_(x, UNDERFLOW, float("-inf")).exp_()


def may_skip_lags() -> bool:
    """Whether lags may be skipped by reading tensor values: in eager mode only. Under torch.compile such a
    branch would break the graph (``bool(tensor)``); every lag is computed there, adding the same zeros."""
    return not torch.compiler.is_compiling()


def _negligible(row_max: torch.Tensor, base: torch.Tensor) -> bool:
    """True when every probability of a lag is below exp(UNDERFLOW): the lag is skipped (its weights are 0).
    Always False under torch.compile (:func:`may_skip_lags`)."""
    return may_skip_lags() and bool((row_max - base < UNDERFLOW).all())


def _safe(m: torch.Tensor) -> torch.Tensor:
    """Running maxima with -inf (no visible key yet) replaced by 0, so exp(-inf - m) is 0, not NaN."""
    return m.masked_fill(m == float("-inf"), 0.0)


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_gates, slopes, scale, causal, window_size, C):
        blocks = _Blocks(q, k, v, log_gates, slopes, scale, causal, window_size, C)
        shape = blocks.q.shape[:-1]  # rows [B, H_kv, Nq, G C]
        m = q.new_full(shape, float("-inf"))
        denom = q.new_zeros(shape)
        acc = q.new_zeros(*shape, v.shape[-1])
        for lag in blocks.iter_logits(m):
            a = slice(lag.a0, lag.a1)
            row_max = lag.logits.amax(dim=-1)
            m_new = torch.maximum(m[:, :, a], row_max)
            base = _safe(m_new)
            if _negligible(row_max, base):  # e.g. far lags under strong forgetting: nothing to add
                continue
            p = _exp_(lag.logits.sub_(base[..., None]))
            alpha = torch.exp(m[:, :, a] - base)
            denom[:, :, a] = denom[:, :, a] * alpha + p.sum(dim=-1)
            acc[:, :, a] = acc[:, :, a] * alpha[..., None] + torch.matmul(p, blocks.v[:, :, lag.j0: lag.j1])
            m[:, :, a] = m_new
        # a padding row may see no key at all (denom 0): give it o = 0 and a finite lse, so that its
        # probabilities exp(-inf - lse) are 0 in backward; real rows have denom >= 1 (their max gives 1)
        denom = denom.clamp_min(torch.finfo(denom.dtype).tiny)
        o = acc / denom[..., None]
        lse = _safe(m) + torch.log(denom)
        ctx.save_for_backward(q, k, v, log_gates, slopes, o, lse)
        ctx.options = (scale, causal, window_size, C)
        return blocks.unblock_queries(o)

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, log_gates, slopes, o, lse = ctx.saved_tensors
        scale, causal, window_size, C = ctx.options
        blocks = _Blocks(q, k, v, log_gates, slopes, scale, causal, window_size, C)
        do = blocks.block_queries(grad_o.to(q.dtype))
        delta = (do * o).sum(dim=-1)  # rowsum(dO o) = sum_s P dP
        dq, dk, dv = torch.zeros_like(blocks.q), torch.zeros_like(blocks.k), torch.zeros_like(blocks.v)
        dG = None if log_gates is None else torch.zeros_like(blocks.c)  # per key position [B, H_kv, Nk, G, C]
        for lag in blocks.iter_logits(lse):
            a, j = slice(lag.a0, lag.a1), slice(lag.j0, lag.j1)
            if _negligible(lag.logits.amax(dim=-1), lse[:, :, a]):
                continue
            p = _exp_(lag.logits.sub_(lse[:, :, a, :, None]))
            dv[:, :, j] += torch.matmul(p.transpose(-1, -2), do[:, :, a])
            ds = torch.matmul(do[:, :, a], blocks.v[:, :, j].transpose(-1, -2)).sub_(delta[:, :, a, :, None]).mul_(p)
            dq[:, :, a] += torch.matmul(ds, blocks.k[:, :, j])
            dk[:, :, j] += torch.matmul(ds.transpose(-1, -2), blocks.q[:, :, a])  # q pre-scaled: dK = dS^T Q scale
            if dG is not None:
                nb = lag.a1 - lag.a0
                dG[:, :, j] -= ds.view(*ds.shape[:2], nb, blocks.G, C, C).sum(dim=-2)
        dg = None
        if dG is not None:  # g_r enters every G_i with i >= r: reverse cumulative sum over positions
            flat = blocks.unblock_gates(dG)
            dg = flat.flip(1).cumsum(1).flip(1)[:, blocks.P0: blocks.P0 + blocks.Tk]
        return (blocks.unblock_queries(dq) * scale, blocks.unblock_keys(dk), blocks.unblock_keys(dv), dg,
                None, None, None, None, None)
