"""Public entry points of titans (linear memory with momentum and weight decay): validation,
backend dispatch, registry entry."""

from __future__ import annotations

import torch

from ..common.checks import (
    check_chunk_size,
    check_devices,
    check_qkv,
    check_scalar_gate,
    check_shape,
    check_step_qkv,
    resolve_scale,
)
from ..common.registry import OpSpec, register_op
from ..common.values import check_bool, check_range
from ..common.varlen import packable
from .api import NO_PARALLEL
from .checks import check_mini_batch_size, check_step_state, split_initial_state, titans_triton_takes
from .chunk import titans_chunk
from .reference import run_tokens, titans_recurrent, titans_token
from .state import MiniBatchState

SPEC = register_op(
    OpSpec(
        name="titans",
        family="ttt",
        equation=("S_t = eta_t S_{t-1} - theta_t k_t (M_0^T k_t - v_t)^T (M_0: the mini-batch's start);  "
                  "M_t = (1 - alpha_t) M_{t-1} + S_t;  o_t = M_t^T q_t"),
        op_args=("theta", "alpha", "eta"),
        state_shape="(M [B, H, K, V], S [B, H, K, V])",
        implementations={"recurrent": titans_recurrent, "chunk": titans_chunk},
        no_parallel_reason=NO_PARALLEL,
        notes=("mini_batch_size (default 16); eta = alpha = 0 is ttt_linear with eta = theta; triton: "
               "mini_batch_size 16 or 32, K <= 128"),
    )
)


def _check_gates(theta: torch.Tensor, alpha: torch.Tensor, eta: torch.Tensor) -> None:
    """alpha and eta in [0, 1] (decay factors); theta is any learning rate."""
    check_range("alpha", alpha, 0.0, 1.0, "weight decay: M_t = (1 - alpha_t) M_{t-1} + S_t")
    check_range("eta", eta, 0.0, 1.0, "momentum decay: S_t = eta_t S_{t-1} - theta_t grad_t")


@packable("q", "k", "v", "theta", "alpha", "eta")
def titans(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    alpha: torch.Tensor,
    eta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor] | MiniBatchState | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
    mini_batch_size: int = 16,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Titans' neural memory with a linear memory M [K, V] per head: gradient descent with momentum
    and weight decay on l_t(M) = 0.5 ||M^T k_t - v_t||^2, mini-batched (every gradient of a mini-batch
    taken at the mini-batch's starting memory M_0):

        S_t = eta_t S_{t-1} - theta_t k_t (M_0^T k_t - v_t)^T,   M_t = (1 - alpha_t) M_{t-1} + S_t,
        o_t = M_t^T (scale q_t).

    Args: q, k [B, T, H, K]; v [B, T, H, V]; theta [B, T, H] learning rate; alpha [B, T, H] weight
    decay in [0, 1]; eta [B, T, H] momentum decay in [0, 1]; initial_state (M, S), each [B, H, K, V],
    at a mini-batch boundary (e.g. this op's final state), or the :class:`MiniBatchState` :func:`titans_step`
    returns (inside a mini-batch, its first tokens complete that mini-batch exactly as the steps would: they run
    token by token, the rest on ``backend``). The end of the sequence closes the last mini-batch (split at
    multiples of mini_batch_size to chain calls). eta = alpha = 0 gives ttt_linear with eta = theta.
    backend: "recurrent", "chunk" or "triton" (CUDA: mini_batch_size 16 or 32 and K up to 128, any V; "auto"
    takes it there, else chunk).
    Returns (o [B, T, H, V] in q's dtype, final (M, S) float32 (float64 for float64) or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, theta=theta, alpha=alpha, eta=eta, initial_state=initial_state)
    check_bool("output_final_state", output_final_state)
    for name, x in (("theta", theta), ("alpha", alpha), ("eta", eta)):
        check_scalar_gate(name, x, d)
    _check_gates(theta, alpha, eta)
    check_chunk_size(chunk_size)
    check_mini_batch_size(mini_batch_size)
    initial_state, partial = split_initial_state(initial_state, d, 2, mini_batch_size, q)
    if backend == "auto" and not titans_triton_takes(mini_batch_size, d.K):
        backend = "chunk"  # the kernels' limits (mini-batches of 16 or 32, K up to 128)
    impl = SPEC.resolve(backend, q.device)
    scale = resolve_scale(scale, d.K)
    o_head = None
    if partial is not None:  # the tokens that complete the step's mini-batch, as the step runs them
        head = min(d.T, mini_batch_size - partial.count)
        dt = partial.start.dtype
        o_head, partial = run_tokens(lambda st, *x: titans_token(st, *x, mini_batch_size), partial, head,
                                     q[:, :head].to(dt) * scale,
                                     *(x[:, :head].to(dt) for x in (k, v, theta, alpha, eta)))
        o_head = o_head.to(q.dtype)
        if head == d.T:
            return o_head, (tuple(partial.current) if output_final_state else None)
        q, k, v, theta, alpha, eta = (x[:, head:] for x in (q, k, v, theta, alpha, eta))
        initial_state = tuple(partial.current)
    o, final = impl(
        q, k, v, theta, alpha, eta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        mini_batch_size=mini_batch_size,
    )
    return (o if o_head is None else torch.cat([o_head, o], dim=1)), final


def titans_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    alpha: torch.Tensor,
    eta: torch.Tensor,
    *,
    state: tuple[torch.Tensor, torch.Tensor] | MiniBatchState | None = None,
    scale: float | None = None,
    mini_batch_size: int = 16,
) -> tuple[torch.Tensor, MiniBatchState]:
    """One decoding step of :func:`titans`: one token's q, k [B, H, K], v [B, H, V], theta, alpha, eta
    [B, H]; ``state`` None (zeros), the op's (M, S) (a mini-batch boundary) or the
    :class:`MiniBatchState` a previous step returned. Returns (o_t [B, H, V], MiniBatchState)."""
    d = check_step_qkv(q, k, v)
    check_devices("q", q, theta=theta, alpha=alpha, eta=eta, state=state)
    for name, x in (("theta", theta), ("alpha", alpha), ("eta", eta)):
        check_shape(name, x, (d.B, d.H), "[B, H]")
    _check_gates(theta, alpha, eta)
    check_mini_batch_size(mini_batch_size)
    st = check_step_state(state, d, 2, mini_batch_size, q)
    dt = st.start.dtype
    qc, kc, vc, thetac, alphac, etac = (x.to(dt) for x in (q, k, v, theta, alpha, eta))
    o_t, st = titans_token(st, qc * resolve_scale(scale, d.K), kc, vc, thetac, alphac, etac, mini_batch_size)
    return o_t.to(q.dtype), st


def titans_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """L2-normalised q, k, random v, theta in (0, 1), alpha in (0, 0.1), eta in (0, 1) (sigmoids of
    noise; alpha = 1 - exp(g_value) when ``g_value`` is given: the weight decay as a log gate)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    q, k = (x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) for x in (q, k))
    theta, alpha, eta = (torch.sigmoid(torch.randn(B, T, H, generator=gen)) for _ in range(3))
    alpha = 0.1 * alpha if g_value is None else -torch.expm1(torch.full((B, T, H), float(g_value)))
    inputs = dict(q=q, k=k, v=v, theta=theta, alpha=alpha, eta=eta)
    return {name: x.to(device=device, dtype=dtype) for name, x in inputs.items()}


SPEC.fn = titans
SPEC.example_inputs = titans_example_inputs
SPEC.step = titans_step
