"""Public entry points of gated_delta_product: validation, backend dispatch, registry entry."""

from __future__ import annotations

import torch

from ..common.checks import (
    DELTA_TRITON_CHUNK_SIZES,
    Dims,
    check_chunk_size,
    check_devices,
    check_float_tensor,
    check_initial_state,
    check_shape,
    resolve_scale,
)
from ..common.registry import OpSpec, register_op
from ..common.values import check_bool, check_log_decay
from ..common.varlen import packable
from ..gated_delta_rule.api import SPEC as GDN_SPEC
from ..gated_delta_rule.api import check_beta, check_step_beta, check_step_state, delta_example_inputs
from .reference import gated_delta_product_recurrent, gated_delta_product_step_reference, via_substeps

SPEC = register_op(
    OpSpec(
        name="gated_delta_product",
        family="delta",
        triton_chunk_sizes=DELTA_TRITON_CHUNK_SIZES,
        equation="S_t = exp(g_t) prod_{j<n} (I - b_{t,j} k_{t,j} k_{t,j}^T) S_{t-1} + writes;  o_t = S_t^T q_t",
        op_args=("g", "beta"),
        state_shape="[B, H, K, V]",
        implementations={"recurrent": gated_delta_product_recurrent,
                         "parallel": via_substeps(GDN_SPEC.implementations["parallel"]),
                         "chunk": via_substeps(GDN_SPEC.implementations["chunk"])},
        notes="arXiv 2502.10297. k, v, beta hold n = num_householder sub-steps per token, interleaved "
              "(k[:, t*n + j]); parallel and chunk run gated_delta_rule on the sub-steps (chunk_size counts "
              "sub-steps). beta in [0, 1] ([0, 2] with allow_neg_eigval).",
    )
)


def _check_product_inputs(q: object, k: object, v: object, num_householder: object) -> tuple[Dims, int]:
    """q [B, T, H, K], k [B, T*n, H, K], v [B, T*n, H, V]; returns (sizes per token, n)."""
    check_float_tensor("q", q, 4, "[B, T, H, K]")
    check_float_tensor("k", k, 4, "[B, T*num_householder, H, K]")
    check_float_tensor("v", v, 4, "[B, T*num_householder, H, V]")
    B, T, H, K = q.shape
    if T < 1 or K < 1:
        raise ValueError(f"q must be non-empty, got shape {list(q.shape)}")
    if num_householder is None:
        if k.shape[1] % T != 0:
            raise ValueError(f"k must have shape [B, T*num_householder, H, K] with T = {T} (from q), got "
                             f"{list(k.shape)} ({k.shape[1]} is not a multiple of {T})")
        num_householder = k.shape[1] // T
    if not isinstance(num_householder, int) or isinstance(num_householder, bool) or num_householder < 1:
        raise ValueError(f"num_householder must be a positive int, got {num_householder!r}")
    n = num_householder
    check_shape("k", k, (B, T * n, H, K), "[B, T*num_householder, H, K]")
    check_shape("v", v, (B, T * n, H, v.shape[-1]), "[B, T*num_householder, H, V]")
    if v.shape[-1] < 1:
        raise ValueError(f"v must be non-empty, got shape {list(v.shape)}")
    check_devices("q", q, k=k, v=v)
    return Dims(B, T, H, K, int(v.shape[-1])), n


def _require_beta(fn: str, beta: object) -> None:
    """beta has a default only so that the optional gate g can precede it (FLA's order): it is required."""
    if beta is None:
        raise TypeError(f"{fn}() missing required argument 'beta'")


@packable("q", "k", "v", "g", "beta", native=SPEC.packs_natively)
def gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    num_householder: int | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    allow_neg_eigval: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaProduct (arXiv 2502.10297): n delta-rule (Householder) steps per token.

    Per token t: S <- exp(g_t) S;  S <- (I - b_{t,j} k_{t,j} k_{t,j}^T) S + b_{t,j} k_{t,j} v_{t,j}^T for
    j = 0..n-1;  o_t = S^T (scale q_t).

    Args: q [B, T, H, K]; k [B, T*n, H, K] (L2-normalised; k[:, t*n + j] is key j of token t);
    v [B, T*n, H, V]; g [B, T, H] log decay per token, or None for no decay (DeltaProduct);
    beta [B, T*n, H] in [0, 1], or in [0, 2] with ``allow_neg_eigval=True`` (the paper's state-tracking
    setting; required: it defaults to None only so that the optional g can come before it, as in FLA's order);
    num_householder n (None: k.shape[1] // T); initial_state [B, H, K, V]. ``chunk_size`` counts sub-steps.
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 or None).
    """
    _require_beta("gated_delta_product", beta)
    d, n = _check_product_inputs(q, k, v, num_householder)
    check_devices("q", q, g=g, beta=beta, initial_state=initial_state)
    check_bool("output_final_state", output_final_state)
    if g is not None:
        check_shape("g", g, (d.B, d.T, d.H), "[B, T, H]")
    check_log_decay("g", g)
    check_beta(beta, d, allow_neg_eigval, T=d.T * n)
    check_initial_state(initial_state, d)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device, chunk_size)
    return impl(
        q, k, v, g, beta,
        num_householder=n,
        scale=resolve_scale(scale, d.K),
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )


def gated_delta_product_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    state: torch.Tensor | None = None,
    num_householder: int | None = None,
    scale: float | None = None,
    allow_neg_eigval: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of :func:`gated_delta_product`: one token's q [B, H, K]; k [B, n, H, K] and v [B, n, H, V]
    (the token's n sub-steps, i.e. the op's k[:, t*n:(t+1)*n]); g [B, H] or None (no decay); beta [B, n, H]
    (required); num_householder n (None: k.shape[1]).

    S = exp(g_t) S; then for each j: S = (I - b_j k_j k_j^T) S + b_j k_j v_j^T;  o_t = S^T (scale q_t).
    """
    check_float_tensor("q", q, 3, "[B, H, K]")
    check_float_tensor("k", k, 4, "[B, n, H, K]")
    check_float_tensor("v", v, 4, "[B, n, H, V]")
    _require_beta("gated_delta_product_step", beta)
    B, H, K = q.shape
    n = k.shape[1]
    if num_householder is not None and num_householder != n:
        raise ValueError(f"k must hold num_householder = {num_householder} sub-steps [B, n, H, K], "
                         f"got shape {list(k.shape)}")
    check_shape("k", k, (B, n, H, K), "[B, n, H, K]")
    check_shape("v", v, (B, n, H, v.shape[-1]), "[B, n, H, V]")
    d = Dims(B, 1, H, K, int(v.shape[-1]))
    check_devices("q", q, k=k, v=v, g=g, beta=beta, state=state)
    if g is not None:
        check_shape("g", g, (B, H), "[B, H]")
    check_log_decay("g", g)
    check_step_beta(beta, d, allow_neg_eigval, shape=(B, n, H), layout="[B, n, H]")
    check_step_state(state, d)
    return gated_delta_product_step_reference(q, k, v, g, beta, state, scale=resolve_scale(scale, K))


def gated_delta_product_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, num_householder: int = 2, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """q, g per token; L2-normalised k, v and beta for ``num_householder`` sub-steps per token
    (the op infers num_householder from k's length)."""
    n = num_householder
    x = delta_example_inputs(B, T * n, H, K, V, dtype=dtype, device=device, seed=seed, g_value=g_value)
    return dict(q=x["q"][:, :T].contiguous(), k=x["k"], v=x["v"], g=x["g"][:, :T].contiguous(), beta=x["beta"])


SPEC.fn = gated_delta_product
SPEC.example_inputs = gated_delta_product_example_inputs
SPEC.step = gated_delta_product_step
