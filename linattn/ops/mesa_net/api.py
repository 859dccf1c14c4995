"""Public entry points of mesa_net: validation, backend dispatch, registry entry."""

from __future__ import annotations

import torch

from ..common.checks import (
    Dims,
    check_choice,
    check_chunk_size,
    check_devices,
    check_qkv,
    check_scalar_gate,
    check_shape,
    check_step_qkv,
    resolve_scale,
)
from ..common.registry import OpSpec, register_op
from ..common.values import check_bool, check_log_decay, check_range, value_checks_enabled
from ..common.varlen import packable
from .chunk import mesa_net_chunk
from .reference import MesaState, mesa_net_parallel, mesa_net_recurrent, mesa_net_step_reference
from .solve import SOLVERS

SPEC = register_op(
    OpSpec(
        name="mesa_net",
        family="optimal_ttt",
        equation=("G_t = exp(g_t) G_{t-1} + b_t k_t k_t^T;  H_t = exp(g_t) H_{t-1} + b_t k_t v_t^T;  "
                  "o_t = H_t^T (G_t + diag(lamb))^-1 q_t"),
        op_args=("g", "beta", "lamb"),
        state_shape="(G [B, H, K, K], H [B, H, K, V])",
        implementations={"recurrent": mesa_net_recurrent, "parallel": mesa_net_parallel, "chunk": mesa_net_chunk},
        notes="solver='exact' (Cholesky) or 'cg' (cg_steps conjugate-gradient steps from x = 0; K steps if None)",
    )
)


def _check_state(name: str, state: object, d: Dims) -> MesaState | None:
    """None or a pair (G [B, H, K, K], H [B, H, K, V])."""
    if state is None:
        return None
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise TypeError(f"{name} must be None or a pair (G [B, H, K, K], H [B, H, K, V]), got {type(state).__name__}")
    G = check_shape(f"{name}[0] (G)", state[0], (d.B, d.H, d.K, d.K), "[B, H, K, K]")
    Hs = check_shape(f"{name}[1] (H)", state[1], (d.B, d.H, d.K, d.V), "[B, H, K, V]")
    return G, Hs


def _check_mesa_args(beta: torch.Tensor, lamb: object, d: Dims, solver: object, cg_steps: object) -> None:
    """beta >= 0, lamb [H, K] > 0 (so G_t + diag(lamb) is positive definite), solver and cg_steps."""
    check_shape("lamb", lamb, (d.H, d.K), "[H, K]")
    if value_checks_enabled(lamb) and not bool((lamb > 0).all()):
        raise ValueError(f"lamb must be > 0 everywhere (G_t + diag(lamb) must be positive definite), "
                         f"got min {float(lamb.min()):.3g}")
    check_range("beta", beta, 0.0, float("inf"), "input strengths must be >= 0")
    check_choice("solver", solver, SOLVERS)
    if cg_steps is not None and (not isinstance(cg_steps, int) or isinstance(cg_steps, bool) or cg_steps < 1):
        raise ValueError(f"cg_steps must be None (K steps) or a positive int, got {cg_steps!r}")


@packable("q", "k", "v", "g", "beta")
def mesa_net(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lamb: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: MesaState | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
    solver: str = "exact",
    cg_steps: int | None = None,
) -> tuple[torch.Tensor, MesaState | None]:
    """MesaNet: at every step the optimal ridge-regression read-out of the (decayed) context.

    G_t = exp(g_t) G_{t-1} + b_t k_t k_t^T,  H_t = exp(g_t) H_{t-1} + b_t k_t v_t^T,
    o_t = H_t^T (G_t + diag(lamb))^-1 (scale q_t).

    Args: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] log decay (<= 0); beta [B, T, H] input
    strength (>= 0); lamb [H, K] ridge regulariser (> 0); initial_state None or the pair
    (G [B, H, K, K], H [B, H, K, V]); solver "exact" (Cholesky) or "cg" (``cg_steps`` conjugate-gradient
    steps started from x = 0 at every token, K steps when None: exact in exact arithmetic); backend "recurrent",
    "parallel", "chunk" (O(T K^2) memory: every G_t), "triton" (memory O(T (K + V)): CG over simple_gla's Triton
    scans, differentiated implicitly; the exact solve in checkpointed blocks; docs/ops/mesa_ttt.md) or "auto"
    (triton on CUDA, else chunk).
    Returns (o [B, T, H, V] in q's dtype, final (G, H) in float32 (float64 for float64 inputs) or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, g=g, beta=beta, lamb=lamb, initial_state=initial_state)
    check_bool("output_final_state", output_final_state)
    check_scalar_gate("g", g, d)
    check_log_decay("g", g)
    check_scalar_gate("beta", beta, d)
    _check_mesa_args(beta, lamb, d, solver, cg_steps)
    initial_state = _check_state("initial_state", initial_state, d)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device)
    return impl(
        q, k, v, g, beta, lamb,
        scale=resolve_scale(scale, d.K),
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        solver=solver,
        cg_steps=cg_steps,
    )


def mesa_net_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lamb: torch.Tensor,
    *,
    state: MesaState | None = None,
    scale: float | None = None,
    solver: str = "exact",
    cg_steps: int | None = None,
) -> tuple[torch.Tensor, MesaState]:
    """One decoding step of :func:`mesa_net`: one token's q, k [B, H, K], v [B, H, V], g, beta [B, H];
    lamb [H, K]; state None or (G [B, H, K, K], H [B, H, K, V]). Returns (o_t [B, H, V], (G, H))."""
    d = check_step_qkv(q, k, v)
    check_devices("q", q, g=g, beta=beta, lamb=lamb, state=state)
    check_shape("g", g, (d.B, d.H), "[B, H]")
    check_log_decay("g", g)
    check_shape("beta", beta, (d.B, d.H), "[B, H]")
    _check_mesa_args(beta, lamb, d, solver, cg_steps)
    state = _check_state("state", state, d)
    return mesa_net_step_reference(q, k, v, g, beta, lamb, state, scale=resolve_scale(scale, d.K),
                                   solver=solver, cg_steps=cg_steps)


def mesa_net_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """L2-normalised q, k (as in the paper's layer), random v, log decays g in [-0.5, 0) (or all
    ``g_value``), beta = sigmoid(noise) in (0, 1) and lamb = 1 for tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    q, k = (x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) for x in (q, k))
    g = -0.5 * torch.rand(B, T, H, generator=gen) if g_value is None else torch.full((B, T, H), float(g_value))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    lamb = torch.ones(H, K)
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, lamb=lamb)
    return {name: x.to(device=device, dtype=dtype) for name, x in inputs.items()}


SPEC.fn = mesa_net
SPEC.example_inputs = mesa_net_example_inputs
SPEC.step = mesa_net_step
