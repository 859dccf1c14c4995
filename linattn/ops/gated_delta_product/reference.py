"""Reference recurrence of the gated delta product (DeltaProduct, arXiv 2502.10297), and its matrix
and chunk forms through the gated delta rule on the interleaved sequence.

Per token t, with n = num_householder keys k_{t,j} = k[:, t*n + j] (likewise v, beta):

    S <- exp(g_t) S;   S <- S + b_{t,j} k_{t,j} (v_{t,j} - S^T k_{t,j})^T  for j = 0..n-1;   o_t = S^T (scale q_t)

i.e. S_t = exp(g_t) prod_j (I - b_{t,j} k_{t,j} k_{t,j}^T) S_{t-1} + (writes). This is the gated delta
rule on the n-times longer sequence of sub-steps, with the gate g_t on the first sub-step of token t
(zero log gate on the others) and the query on its last sub-step (outputs of the others discarded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.checks import compute_dtype
from ..common.packed_call import Packing, current_packing, packed_call
from ..gated_delta_rule.reference import delta_update, read


def gated_delta_product_step_reference(
    q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor | None, beta_t: torch.Tensor,
    state: torch.Tensor | None, *, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q_t [B, H, K]; k_t [B, n, H, K]; v_t [B, n, H, V]; g_t [B, H] or None; beta_t [B, n, H]."""
    dt, in_dtype = compute_dtype(q_t), q_t.dtype
    B, H, K = q_t.shape
    S = q_t.new_zeros(B, H, K, v_t.shape[-1], dtype=dt) if state is None else state.to(dt)
    q_t, k_t, v_t, beta_t = (x.to(dt) for x in (q_t, k_t, v_t, beta_t))
    if g_t is not None:
        S = torch.exp(g_t.to(dt))[..., None, None] * S
    for j in range(k_t.shape[1]):  # the n Householder steps of this token
        S = delta_update(S, k_t[:, j], v_t[:, j], k_t[:, j], beta_t[:, j])
    return read(S, q_t, scale).to(in_dtype), S


def gated_delta_product_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    num_householder: int,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence of the module docstring (g None: no decay)."""
    T, n = q.shape[1], num_householder
    S = initial_state
    outputs = []
    for t in range(T):
        sub = slice(t * n, (t + 1) * n)
        o_t, S = gated_delta_product_step_reference(
            q[:, t], k[:, sub], v[:, sub], None if g is None else g[:, t], beta[:, sub], S, scale=scale
        )
        outputs.append(o_t)
    return torch.stack(outputs, dim=1), (S if output_final_state else None)


def to_substeps(q: torch.Tensor, g: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B, T, H, K] -> [B, T*n, H, K], zero except on the last sub-step of each token;
    g [B, T, H] -> [B, T*n, H], zero except on the first sub-step."""
    B, T = q.shape[:2]
    zeros_q = q.new_zeros(B, T, n - 1, *q.shape[2:])
    q_sub = torch.cat([zeros_q, q[:, :, None]], dim=2).reshape(B, T * n, *q.shape[2:])
    if g is None:
        return q_sub, None
    zeros_g = g.new_zeros(B, T, n - 1, *g.shape[2:])
    return q_sub, torch.cat([g[:, :, None], zeros_g], dim=2).reshape(B, T * n, *g.shape[2:])


def via_substeps(gdn_impl: Callable) -> Callable:
    """A gated_delta_rule backend run on the interleaved sub-steps, as a gated_delta_product backend."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor, *,
            num_householder: int, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = num_householder
        q_sub, g_sub = to_substeps(q, g, n)
        packing = current_packing()
        if packing is None:
            o_sub, S = gdn_impl(q_sub, k, v, g_sub, beta, **kw)
        else:  # packed sequences (a backend that runs them natively): sequence i holds n times its tokens' sub-steps
            sub = Packing(cu_seqlens=packing.cu_seqlens * n, offsets=tuple(o * n for o in packing.offsets))
            with packed_call(sub):
                o_sub, S = gdn_impl(q_sub, k, v, g_sub, beta, **kw)
        return o_sub[:, n - 1::n], S

    run.__name__ = run.__qualname__ = gdn_impl.__name__.replace("gated_delta", "gated_delta_product")
    run.__doc__ = f"gated_delta_product through {gdn_impl.__name__} on the interleaved sub-steps."
    run.native_cu_seqlens = getattr(gdn_impl, "native_cu_seqlens", False)
    return run
