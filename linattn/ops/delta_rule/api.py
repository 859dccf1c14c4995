"""Public entry points of delta_rule (DeltaNet): validation, backend dispatch, registry entry.

The delta rule is the gated delta rule without decay; its backends are gated_delta_rule's with
g = None (which skips the decay rather than exponentiating zeros in the recurrence).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.checks import (
    DELTA_TRITON_CHUNK_SIZES,
    check_chunk_size,
    check_devices,
    check_initial_state,
    check_qkv,
    check_step_qkv,
    resolve_scale,
)
from ..common.registry import OpSpec, register_op
from ..common.triton_step import check_inplace, select_step
from ..common.values import check_bool
from ..common.varlen import packable
from ..gated_delta_rule.api import (
    PURE_TORCH_BACKENDS,
    check_beta,
    check_step_beta,
    check_step_state,
    delta_example_inputs,
)
from ..gated_delta_rule.api import SPEC as GDN_SPEC
from ..gated_delta_rule.reference import gated_delta_step_reference


def _without_gate(impl: Callable) -> Callable:
    """A gated_delta_rule backend as a delta_rule backend: (q, k, v, beta, **kw) -> impl(q, k, v, None, beta, **kw)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, **kw):
        return impl(q, k, v, None, beta, **kw)

    run.__name__ = run.__qualname__ = impl.__name__.replace("gated_delta", "delta_rule")
    run.__doc__ = f"delta_rule through {impl.__name__} with no decay (g = None)."
    run.native_cu_seqlens = getattr(impl, "native_cu_seqlens", False)
    return run


SPEC = register_op(
    OpSpec(
        name="delta_rule",
        family="delta",
        triton_chunk_sizes=DELTA_TRITON_CHUNK_SIZES,
        equation="S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T;  o_t = S_t^T q_t",
        op_args=("beta",),
        state_shape="[B, H, K, V]",
        implementations={name: _without_gate(GDN_SPEC.implementations[name]) for name in PURE_TORCH_BACKENDS},
        notes="beta in [0, 1]; allow_neg_eigval=True accepts beta in [0, 2]. Use L2-normalised keys.",
    )
)


@packable("q", "k", "v", "beta", native=SPEC.packs_natively)
def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    allow_neg_eigval: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet: linear attention whose state is corrected towards v_t at key k_t with step size b_t.

    S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T (scale q_t)
    (one gradient step on ½‖S^T k_t - v_t‖² with learning rate b_t).

    Args: q, k [B, T, H, K] (use L2-normalised keys); v [B, T, H, V]; beta [B, T, H] in [0, 1], or in
    [0, 2] with ``allow_neg_eigval=True``; initial_state [B, H, K, V].
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 (float64 for float64) or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, beta=beta, initial_state=initial_state)
    check_bool("output_final_state", output_final_state)
    check_beta(beta, d, allow_neg_eigval)
    check_initial_state(initial_state, d)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device, chunk_size)
    return impl(
        q, k, v, beta,
        scale=resolve_scale(scale, d.K),
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    allow_neg_eigval: bool = False,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of :func:`delta_rule`: one token's q, k [B, H, K], v [B, H, V],
    beta [B, H].

    S = (I - b_t k_t k_t^T) S + b_t k_t v_t^T,  o_t = S^T (scale q_t); returns (o_t, S).
    ``inplace=True`` writes the new state into ``state`` (a tensor) and returns it (static decoding).
    """
    d = check_step_qkv(q, k, v)
    check_devices("q", q, beta=beta, state=state)
    check_step_beta(beta, d, allow_neg_eigval)
    check_step_state(state, d)
    check_inplace(inplace, state)
    step = select_step("gated_delta_rule", gated_delta_step_reference, q, k, v, beta, state, inplace=inplace)
    return step(q, k, v, None, beta, state, scale=resolve_scale(scale, d.K))  # fused kernel on CUDA


def delta_rule_example_inputs(B: int, T: int, H: int, K: int, V: int, **kw) -> dict[str, torch.Tensor]:
    """q, L2-normalised k, v and beta in (0, 1) (``g_value`` is ignored: the delta rule has no gate)."""
    x = delta_example_inputs(B, T, H, K, V, **kw)
    del x["g"]
    return x


SPEC.fn = delta_rule
SPEC.example_inputs = delta_rule_example_inputs
SPEC.step = delta_rule_step
