"""``backend="triton"`` for the gated delta product: the gated delta rule's kernels on the sub-steps.

Per token t (n = num_householder sub-steps, k_{t,j} = k[:, t*n + j], likewise v and beta):

    S <- exp(g_t) S;   S <- S + b_{t,j} k_{t,j} (v_{t,j} - S^T k_{t,j})^T  (j = 0..n-1);   o_t = S^T (scale q_t)

is the gated delta rule on the n-times longer interleaved sequence, with the log gate g_t on sub-step 0
(zero on the others) and q_t on sub-step n-1 (zero queries on the others, whose outputs are dropped):
reference.via_substeps builds those inputs and calls gated_delta_rule's Triton op, whose autograd
gives every gradient (the zero queries and gates are built by differentiable torch ops). The initial
and final states are those of the sub-step sequence, i.e. of the tokens; chunk_size counts sub-steps.
"""

from __future__ import annotations

from ..gated_delta_rule.triton import gated_delta_triton
from .reference import via_substeps

TRITON_BACKENDS = {"gated_delta_product": via_substeps(gated_delta_triton)}
