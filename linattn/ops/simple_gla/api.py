"""Public entry points of simple_gla: validation, backend dispatch, registry entry."""

from __future__ import annotations

import torch

from ..common.checks import (
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
from ..common.values import check_bool, check_log_decay
from ..common.varlen import packable
from .chunk import simple_gla_chunk
from .reference import simple_gla_parallel, simple_gla_recurrent, simple_gla_step_reference

SPEC = register_op(
    OpSpec(
        name="simple_gla",
        family="decay",
        equation="S_t = exp(g_t) S_{t-1} + k_t v_t^T;  o_t = S_t^T q_t",
        op_args=("g",),
        state_shape="[B, H, K, V]",
        implementations={
            "recurrent": simple_gla_recurrent,
            "parallel": simple_gla_parallel,
            "chunk": simple_gla_chunk,
        },
    )
)


@packable("q", "k", "v", "g", native=SPEC.packs_natively)
def simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention with a data-dependent scalar decay per head (Mamba2 / SSD core).

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t).

    Args: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] log decay (<= 0); initial_state
    [B, H, K, V]; backend "recurrent", "parallel", "chunk" or "auto" (triton on CUDA, else chunk); chunk_size, the
    chunk length of the chunk backend (an int in [1, 4096]; 16, 32, 64, 128 are tested).
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, g=g, initial_state=initial_state)
    check_bool("output_final_state", output_final_state)
    check_scalar_gate("g", g, d)
    check_log_decay("g", g)
    check_initial_state(initial_state, d)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device)
    return impl(
        q, k, v, g,
        scale=resolve_scale(scale, d.K),
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )


def simple_gla_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of :func:`simple_gla`: one token's q, k [B, H, K], v [B, H, V],
    g [B, H].
    ``inplace=True`` writes the new state into ``state`` (a tensor) and returns it (static decoding).
    """
    d = check_step_qkv(q, k, v)
    check_devices("q", q, g=g, state=state)
    check_shape("g", g, (d.B, d.H), "[B, H]")
    check_log_decay("g", g)
    if state is not None:
        check_shape("state", state, (d.B, d.H, d.K, d.V), "[B, H, K, V]")
    check_inplace(inplace, state)
    step = select_step("simple_gla", simple_gla_step_reference, q, k, v, g, state,
                       inplace=inplace)  # fused kernel on CUDA
    return step(q, k, v, g, state, scale=resolve_scale(scale, d.K))


def simple_gla_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random q, k, v and log decays g in [-0.5, 0) (or all ``g_value``) for tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    g = -0.5 * torch.rand(B, T, H, generator=gen) if g_value is None else torch.full((B, T, H), float(g_value))
    return {name: x.to(device=device, dtype=dtype) for name, x in dict(q=q, k=k, v=v, g=g).items()}


SPEC.fn = simple_gla
SPEC.example_inputs = simple_gla_example_inputs
SPEC.step = simple_gla_step
