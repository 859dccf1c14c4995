"""``backend="triton"`` for the delta rule: the gated delta rule's kernels with no gate.

    S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,        o_t = S_t^T (scale q_t)

With g = None the kernels skip the decay entirely (D is the causal mask, gamma = 1) rather than
reading and exponentiating zeros; see linattn/ops/gated_delta_rule/triton.py for the algorithm.
"""

from __future__ import annotations

from ..gated_delta_rule.triton import gated_delta_triton
from .api import _without_gate

TRITON_BACKENDS = {"delta_rule": _without_gate(gated_delta_triton)}
