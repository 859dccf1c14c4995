"""Public entry points of gated_delta_rule: validation, backend dispatch, registry entry."""

from __future__ import annotations

import torch

from ..common.checks import (
    DELTA_TRITON_CHUNK_SIZES,
    Dims,
    check_chunk_size,
    check_devices,
    check_initial_state,
    check_qkv,
    check_scalar_gate,
    check_shape,
    check_step_qkv,
    resolve_scale,
)
from ..common.registry import OpSpec, register_op
from ..common.triton_step import check_inplace, select_step
from ..common.values import check_bool, check_log_decay, check_range
from ..common.varlen import packable
from .chunk import gated_delta_chunk
from .reference import gated_delta_parallel, gated_delta_recurrent, gated_delta_step_reference

# the backends written for the general form (optional gate g, optional read key p); delta_rule, comba and
# gated_delta_product build theirs from these
PURE_TORCH_BACKENDS = ("recurrent", "parallel", "chunk")

SPEC = register_op(
    OpSpec(
        name="gated_delta_rule",
        family="delta",
        triton_chunk_sizes=DELTA_TRITON_CHUNK_SIZES,
        equation="S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T;  o_t = S_t^T q_t",
        op_args=("g", "beta"),
        state_shape="[B, H, K, V]",
        implementations={"recurrent": gated_delta_recurrent, "parallel": gated_delta_parallel,
                         "chunk": gated_delta_chunk},
        notes="beta in [0, 1]; allow_neg_eigval=True accepts beta in [0, 2] (eigenvalues of I - b k k^T "
              "in [-1, 1] for unit keys). Use L2-normalised keys.",
    )
)


def check_beta(beta: object, d: Dims, allow_neg_eigval: bool, name: str = "beta", T: int | None = None) -> None:
    """beta [B, T, H] with values in [0, 1], or in [0, 2] when ``allow_neg_eigval`` (one host sync on CUDA)."""
    check_bool("allow_neg_eigval", allow_neg_eigval)
    check_scalar_gate(name, beta, d, T=T)
    high = 2.0 if allow_neg_eigval else 1.0
    check_range(name, beta, 0.0, high, "" if allow_neg_eigval else "pass allow_neg_eigval=True for beta in [0, 2]")


def check_step_beta(beta: object, d: Dims, allow_neg_eigval: bool, shape: tuple[int, ...] | None = None,
                    layout: str = "[B, H]") -> None:
    """beta of one decoding step ([B, H] unless ``shape``), range as in :func:`check_beta`."""
    check_bool("allow_neg_eigval", allow_neg_eigval)
    check_shape("beta", beta, (d.B, d.H) if shape is None else shape, layout)
    check_range("beta", beta, 0.0, 2.0 if allow_neg_eigval else 1.0)


def check_step_state(state: object, d: Dims) -> None:
    """None or a decoding state [B, H, K, V]."""
    if state is not None:
        check_shape("state", state, (d.B, d.H, d.K, d.V), "[B, H, K, V]")


@packable("q", "k", "v", "g", "beta", native=SPEC.packs_natively)
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    allow_neg_eigval: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet: the delta rule with a data-dependent scalar decay per head.

    S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T (scale q_t).

    Args: q, k [B, T, H, K] (use L2-normalised keys); v [B, T, H, V]; g [B, T, H] log decay (<= 0);
    beta [B, T, H] in [0, 1], or in [0, 2] with ``allow_neg_eigval=True`` (FLA's layers get this range
    by multiplying a sigmoid by 2; the op takes beta as given); initial_state [B, H, K, V].
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 (float64 for float64) or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, g=g, beta=beta, initial_state=initial_state)
    check_bool("output_final_state", output_final_state)
    check_scalar_gate("g", g, d)
    check_log_decay("g", g)
    check_beta(beta, d, allow_neg_eigval)
    check_initial_state(initial_state, d)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device, chunk_size)
    return impl(
        q, k, v, g, beta,
        scale=resolve_scale(scale, d.K),
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    allow_neg_eigval: bool = False,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of :func:`gated_delta_rule`: one token's q, k [B, H, K],
    v [B, H, V], g, beta [B, H].

    S = exp(g_t) (I - b_t k_t k_t^T) S + b_t k_t v_t^T,  o_t = S^T (scale q_t); returns (o_t, S).
    ``inplace=True`` writes the new state into ``state`` (a tensor) and returns it (static decoding).
    """
    d = check_step_qkv(q, k, v)
    check_devices("q", q, g=g, beta=beta, state=state)
    check_shape("g", g, (d.B, d.H), "[B, H]")
    check_log_decay("g", g)
    check_step_beta(beta, d, allow_neg_eigval)
    check_step_state(state, d)
    check_inplace(inplace, state)
    step = select_step("gated_delta_rule", gated_delta_step_reference, q, k, v, g, beta, state,
                       inplace=inplace)
    return step(q, k, v, g, beta, state, scale=resolve_scale(scale, d.K))  # fused kernel on CUDA


def delta_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random q, L2-normalised k, v, beta = sigmoid(normal) in (0, 1) and log decays g in [-0.5, 0)
    (or all ``g_value``): the inputs of the delta family (ops drop what they do not take)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, n, generator=gen) for n in (K, K, V))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    g = -0.5 * torch.rand(B, T, H, generator=gen) if g_value is None else torch.full((B, T, H), float(g_value))
    out = dict(q=q, k=k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6), v=v, g=g, beta=beta)
    return {name: x.to(device=device, dtype=dtype) for name, x in out.items()}


SPEC.fn = gated_delta_rule
SPEC.example_inputs = delta_example_inputs
SPEC.step = gated_delta_rule_step
