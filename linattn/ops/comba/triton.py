"""``backend="triton"`` for comba: the gated delta rule's kernels with a separate read key p.

    S_t = exp(g_t) S_{t-1} + b_t k_t (v_t - exp(g_t) S_{t-1}^T p_t)^T,      o_t = S_t^T (scale q_t)

In the chunkwise WY / UT form the read key enters only A_ts = b_t (p_t . k_s) D_ts and
W = (I + A)^-1 diag(b gamma) P (the state scan, the outputs and the state update use k); the kernels of
linattn/ops/gated_delta_rule/triton.py take p under a compile-time flag and return its gradient dp
(the derivation is in that module's docstring).
"""

from __future__ import annotations

from ..gated_delta_rule.triton import gated_delta_triton
from .api import _with_read_key

TRITON_BACKENDS = {"comba": _with_read_key(gated_delta_triton)}
