"""retention (RetNet): simple_gla with a fixed decay per head, gamma_h = 1 - 2^(-5-h).

    S_t = gamma_h S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale * q_t),    h = 0, ..., H-1

Every backend is simple_gla's with the constant log gate g_h = log(gamma_h) (Sun et al., 2023; no
xPos rotation here: rotate q and k before the call for it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.checks import (
    check_chunk_size,
    check_devices,
    check_initial_state,
    check_qkv,
    check_shape,
    check_step_qkv,
    compute_dtype,
    resolve_scale,
)
from ..common.registry import OpSpec, register_op
from ..common.triton_step import check_inplace, select_step
from ..common.values import check_bool
from ..common.varlen import packable
from ..simple_gla.api import SPEC as SIMPLE_GLA_SPEC
from ..simple_gla.reference import simple_gla_step_reference


def retention_log_decay(
    H: int, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """[H] log gamma_h = log(1 - 2^(-5-h)) for heads h = 0..H-1 (computed in float64, then cast)."""
    h = torch.arange(H, dtype=torch.float64, device=device)  # made on the device: no host copy in a decode step
    return torch.log1p(-torch.pow(2.0, -5.0 - h)).to(dtype)


def on_simple_gla(impl: Callable) -> Callable:
    """Turn a simple_gla implementation into a retention one (g = log gamma_h at every token)."""

    def retention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> tuple:
        B, T, H, _ = q.shape
        g = retention_log_decay(H, dtype=compute_dtype(q), device=q.device).expand(B, T, H)
        return impl(q, k, v, g, **kwargs)

    retention_impl.__name__ = retention_impl.__qualname__ = f"retention_{impl.__name__.removeprefix('simple_gla_')}"
    retention_impl.native_cu_seqlens = getattr(impl, "native_cu_seqlens", False)
    return retention_impl


SPEC = register_op(
    OpSpec(
        name="retention",
        family="decay",
        equation="S_t = gamma_h S_{t-1} + k_t v_t^T, gamma_h = 1 - 2^(-5-h);  o_t = S_t^T q_t",
        op_args=(),
        state_shape="[B, H, K, V]",
        implementations={name: on_simple_gla(fn) for name, fn in SIMPLE_GLA_SPEC.implementations.items()},
        notes="simple_gla with the constant log gate log(1 - 2^(-5-h)) per head h",
    )
)


@packable("q", "k", "v", native=SPEC.packs_natively)
def retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Multi-scale retention (RetNet) in its recurrent form, a fixed decay per head.

    S_t = gamma_h S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t),   gamma_h = 1 - 2^(-5-h), h = 0..H-1.

    Args: q, k [B, T, H, K]; v [B, T, H, V]; initial_state [B, H, K, V]; backend "recurrent",
    "parallel", "chunk" or "auto" (triton on CUDA, else chunk); chunk_size (16, 32, 64, 128 are tested).
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, initial_state=initial_state)
    check_bool("output_final_state", output_final_state)
    check_initial_state(initial_state, d)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device)
    return impl(
        q, k, v,
        scale=resolve_scale(scale, d.K),
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )


def retention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of :func:`retention`: one token's q, k [B, H, K], v [B, H, V];
    state [B, H, K, V].

    S = gamma_h S + k_t v_t^T,   o_t = S^T (scale q_t).
    ``inplace=True`` writes the new state into ``state`` (a tensor) and returns it (static decoding).
    """
    d = check_step_qkv(q, k, v)
    check_devices("q", q, state=state)
    if state is not None:
        check_shape("state", state, (d.B, d.H, d.K, d.V), "[B, H, K, V]")
    g = retention_log_decay(d.H, dtype=compute_dtype(q), device=q.device).expand(d.B, d.H)
    check_inplace(inplace, state)
    step = select_step("simple_gla", simple_gla_step_reference, q, k, v, g, state,
                       inplace=inplace)  # fused kernel on CUDA
    return step(q, k, v, g, state, scale=resolve_scale(scale, d.K))


def retention_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random q, k, v (``g_value`` is ignored: retention's decays are fixed)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    return {name: x.to(device=device, dtype=dtype) for name, x in dict(q=q, k=k, v=v).items()}


SPEC.fn = retention
SPEC.example_inputs = retention_example_inputs
SPEC.step = retention_step
