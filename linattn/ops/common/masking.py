"""Causal masking that cannot leak: a non-finite input at position t reaches no output before t.

A mask applied by multiplication leaks: 0 x NaN = NaN and 0 x inf = NaN. So every causal mask of the
backends is a *selection*: entries a position must not see are replaced (``masked_fill``,
``torch.where``) before they are multiplied, and log-decay differences are masked to -inf before they
are exponentiated.

One product cannot be fixed by selecting entries of a matrix: ``A @ X`` with A causal (row i is 0
beyond its visible keys) and a non-finite row j of X. The matmul still forms A[i, j] X[j] = 0 x NaN for
i < j. There X is split into its finite part, which the matmul reads, and the non-finite rest, which is
added back only to the rows that may see it:

    A @ X  =  A @ X_fin  +  sum_{j <= i} (X - X_fin)_j      (X_fin = X where finite, 0 elsewhere)

The sum is 0 for a row that sees only finite values (so the result is the plain product, bit for bit)
and non-finite for a row that sees a non-finite value (as the plain product would be). The softmax
family does the same with its visibility pattern (windows, caches): :func:`confine_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def all_finite_here(*xs: torch.Tensor) -> bool:
    """True when every ``xs`` is on the CPU and holds only finite values (eager mode): the guarded products may
    then run plain. Reading a tensor on the host is free on the CPU; on CUDA it would be a synchronisation and
    under torch.compile a graph break, so there the answer is False and the branch-free forms run (the same
    results: on finite inputs they equal the plain products bit for bit)."""
    if torch.compiler.is_compiling() or any(x.device.type != "cpu" for x in xs):
        return False
    return all(bool(torch.isfinite(x).all()) for x in xs)


def attention_guard_skipped(*xs: torch.Tensor) -> bool:
    """Whether softmax attention may run its kernel plainly on these keys and values: on the CPU when they are
    finite (:func:`all_finite_here`). Elsewhere the guard always runs: fused on eager CUDA
    (:func:`fused_guard_applies`), as PyTorch ops otherwise (fused into the graph under torch.compile)."""
    return all_finite_here(*xs)


def fused_guard_applies(keys: torch.Tensor, window_size: int | None) -> bool:
    """Whether the guard of softmax attention runs as the two fused Triton kernels of ``triton_confine``: eager
    CUDA tensors without a sliding window (whose per-query visible range the kernels do not compute)."""
    if torch.compiler.is_compiling() or not keys.is_cuda or window_size is not None or type(keys) is not torch.Tensor:
        return False
    from .triton_compat import triton_importable

    return triton_importable()


def finite_part(x: torch.Tensor) -> torch.Tensor:
    """x where finite, 0 where NaN or +-inf (gradients flow to the finite entries only)."""
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def tril_matmul(A: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """A @ X for a lower-triangular A [..., C, C] (0 above the diagonal) and X [..., C, D] such that row i
    reads only X[j] for j <= i: a non-finite X[j] makes rows >= j non-finite and leaves rows < j exact.

    The entries of A above the diagonal must be exact zeros, made by selection (A itself may hold NaN or
    inf only in rows that see a non-finite input).
    """
    if all_finite_here(X):
        return A @ X
    X_fin = finite_part(X)
    with torch.no_grad():  # 0 or non-finite: no gradient to carry
        rest = (X - X_fin).cumsum(-2)
    return A @ X_fin + rest


def sees_nonfinite(bad: torch.Tensor, Tq: int, *, causal: bool = True,
                   window_size: int | None = None) -> torch.Tensor:
    """Which queries see a bad key: ``bad`` [..., Tk] bool (a non-finite value at key j) -> [..., Tq] bool.

    Query i sits at position Tk - Tq + i (a cache of Tk - Tq keys comes first) and sees key j when j <= i
    (``causal``), within i - w < j (window w; |i - j| < w when not causal): the visibility of
    :func:`~linattn.ops.common.positions.visibility_mask`. Counted with a cumulative sum (no [Tq, Tk] mask).
    """
    Tk = bad.shape[-1]
    count = F.pad(bad.to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))  # count[j] = bad keys before j
    pos = torch.arange(Tk - Tq, Tk, device=bad.device)
    hi = pos + 1 if causal else torch.full_like(pos, Tk)  # keys [lo, hi) are visible
    if window_size is not None and not causal:
        hi = (pos + window_size).clamp_max(Tk)
    lo = torch.zeros_like(pos) if window_size is None else (pos - window_size + 1).clamp_min(0)
    return (count[..., hi] - count[..., lo]) > 0


def confine_attention(o: torch.Tensor, bad: torch.Tensor, *, causal: bool = True,
                      window_size: int | None = None) -> torch.Tensor:
    """NaN in the rows of ``o`` [..., Tq, D] whose query sees a bad key (``bad`` [..., Tk], see
    :func:`sees_nonfinite`); ``o`` was computed from the values' :func:`finite_part`, so every other row is
    the exact attention output."""
    seen = sees_nonfinite(bad, o.shape[-2], causal=causal, window_size=window_size)
    return o.masked_fill(seen[..., None], float("nan"))


def nonfinite_rows(v: torch.Tensor) -> torch.Tensor:
    """[..., T, D] -> bool [..., T]: whether row t has a NaN or inf entry."""
    return ~torch.isfinite(v).all(-1)


def confined_attention(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                       window_size: int | None = None) -> torch.Tensor:
    """``attend(q, k, v)`` (softmax attention, q [..., Tq, K] the last Tq of the Tk positions of k [..., Tk, K],
    v [..., Tk, V]) run on the finite parts of k and v, then NaN in the rows that see a non-finite key or value:
    rows that see only finite ones are exact, whatever the keys and values they must not see hold."""
    if all_finite_here(k, v):
        return attend(q, k, v)
    o = attend(q, finite_part(k), finite_part(v))
    return confine_attention(o, nonfinite_rows(k) | nonfinite_rows(v), causal=causal, window_size=window_size)
