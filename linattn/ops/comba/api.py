"""Public entry points of comba: validation, backend dispatch, registry entry.

Comba's state update is the gated delta rule's with a separate read key p (gated_delta_rule's
backends are written for that generalisation and take ``p=``).
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
    check_scalar_gate,
    check_shape,
    check_step_qkv,
    resolve_scale,
)
from ..common.registry import OpSpec, register_op
from ..common.values import check_bool, check_log_decay
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


def _with_read_key(impl: Callable) -> Callable:
    """A gated_delta_rule backend as a comba backend: (q, k, v, p, g, beta, **kw) -> impl(..., p=p)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, **kw):
        return impl(q, k, v, g, beta, p=p, **kw)

    run.__name__ = run.__qualname__ = impl.__name__.replace("gated_delta", "comba")
    run.__doc__ = f"comba through {impl.__name__} with read key p."
    run.native_cu_seqlens = getattr(impl, "native_cu_seqlens", False)
    return run


SPEC = register_op(
    OpSpec(
        name="comba",
        family="delta",
        triton_chunk_sizes=DELTA_TRITON_CHUNK_SIZES,
        equation="S_t = exp(g_t) S_{t-1} + b_t k_t (v_t - exp(g_t) S_{t-1}^T p_t)^T;  o_t = S_t^T q_t",
        op_args=("p", "g", "beta"),
        state_shape="[B, H, K, V]",
        implementations={name: _with_read_key(GDN_SPEC.implementations[name]) for name in PURE_TORCH_BACKENDS},
        notes="arXiv 2506.02475. p = k gives gated_delta_rule. beta in [0, 1] ([0, 2] with allow_neg_eigval).",
    )
)


@packable("q", "k", "v", "p", "g", "beta", native=SPEC.packs_natively)
def comba(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
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
    """Comba (arXiv 2506.02475): a gated delta rule whose prediction is read with its own key p.

    S_t = exp(g_t) S_{t-1} + b_t k_t (v_t - exp(g_t) S_{t-1}^T p_t)^T
        = exp(g_t) (I - b_t k_t p_t^T) S_{t-1} + b_t k_t v_t^T,      o_t = S_t^T (scale q_t).

    Args: q, k, p [B, T, H, K] (in the paper's layer p = d ⊙ k, a scaled key); v [B, T, H, V];
    g [B, T, H] log decay (<= 0); beta [B, T, H] in [0, 1] ([0, 2] with ``allow_neg_eigval=True``);
    initial_state [B, H, K, V].
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 (float64 for float64) or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, p=p, g=g, beta=beta, initial_state=initial_state)
    check_bool("output_final_state", output_final_state)
    check_shape("p", p, (d.B, d.T, d.H, d.K), "[B, T, H, K]")
    check_scalar_gate("g", g, d)
    check_log_decay("g", g)
    check_beta(beta, d, allow_neg_eigval)
    check_initial_state(initial_state, d)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device, chunk_size)
    return impl(
        q, k, v, p, g, beta,
        scale=resolve_scale(scale, d.K),
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )


def comba_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    allow_neg_eigval: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of :func:`comba`: one token's q, k, p [B, H, K], v [B, H, V],
    g, beta [B, H].

    S = exp(g_t) S; S = S + b_t k_t (v_t - S^T p_t)^T;  o_t = S^T (scale q_t); returns (o_t, S).
    """
    d = check_step_qkv(q, k, v)
    check_devices("q", q, p=p, g=g, beta=beta, state=state)
    check_shape("p", p, (d.B, d.H, d.K), "[B, H, K]")
    check_shape("g", g, (d.B, d.H), "[B, H]")
    check_log_decay("g", g)
    check_step_beta(beta, d, allow_neg_eigval)
    check_step_state(state, d)
    return gated_delta_step_reference(q, k, v, g, beta, state, scale=resolve_scale(scale, d.K), p_t=p)


def comba_example_inputs(B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu", seed: int = 0,
                         g_value: float | None = None) -> dict[str, torch.Tensor]:
    """The delta family's inputs plus a read key p = d ⊙ k with d in (0, 1) per channel (as in the paper)."""
    x = delta_example_inputs(B, T, H, K, V, dtype=torch.float64, seed=seed, g_value=g_value)
    gen = torch.Generator().manual_seed(seed + 1)
    x["p"] = torch.sigmoid(torch.randn(H, K, generator=gen, dtype=torch.float64)) * x["k"]
    return {name: x[name].to(device=device, dtype=dtype) for name in ("q", "k", "v", "p", "g", "beta")}


SPEC.fn = comba
SPEC.example_inputs = comba_example_inputs
SPEC.step = comba_step
