"""Public entry points of ttt_linear: validation, backend dispatch, registry entry."""

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
from ..common.values import check_bool
from ..common.varlen import packable
from .checks import check_mini_batch_size, check_step_state, resolve_inner_norm, split_initial_state, triton_takes
from .chunk import ttt_linear_chunk
from .reference import make_norm, run_tokens, ttt_linear_recurrent, ttt_token
from .state import MiniBatchState

NO_PARALLEL = ("mini-batch gradient descent has no closed T x T matrix form: each mini-batch's gradients "
               "depend on the weights the previous mini-batches produced")

SPEC = register_op(
    OpSpec(
        name="ttt_linear",
        family="ttt",
        equation=("W_t = W_{t-1} - eta_t grad_W 0.5||f(k_t; W_0) - v_t||^2 (W_0: the mini-batch's start);  "
                  "o_t = f(q_t; W_t), f(x; W) = W^T x or x + LN(W^T x)"),
        op_args=("eta",),
        state_shape="[B, H, K, V]",
        implementations={"recurrent": ttt_linear_recurrent, "chunk": ttt_linear_chunk},
        no_parallel_reason=NO_PARALLEL,
        notes="mini_batch_size (default 16); inner_norm=True adds the inner LayerNorm + residual (K == V)",
    )
)


@packable("q", "k", "v", "eta")
def ttt_linear(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | MiniBatchState | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
    mini_batch_size: int = 16,
    inner_norm: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TTT-Linear: an inner linear model W [K, V] per head trained online by mini-batch gradient descent.

    Loss l_t(W) = 0.5 ||f(k_t; W) - v_t||^2. Within a mini-batch of ``mini_batch_size`` tokens every
    gradient is taken at the mini-batch's starting weights W_0 (the paper's dual form):

        W_t = W_{t-1} - eta_t grad l_t(W_0),     o_t = f(scale q_t; W_t),

    plain: f(x; W) = W^T x, so grad l_t = k_t (W_0^T k_t - v_t)^T (mini_batch_size=1: the delta rule
    with beta = eta). ``inner_norm=True``: f(x; W) = x + LN(W^T x) (needs K == V), with LayerNorm
    weight/bias ``norm_weight``, ``norm_bias`` [H, V] (learnable: gradients flow to them; default 1
    and 0) and ``norm_eps``.

    Args: q, k [B, T, H, K]; v [B, T, H, V]; eta [B, T, H] per-token inner learning rate;
    initial_state W [B, H, K, V] (at a mini-batch boundary, e.g. this op's final state) or the
    :class:`MiniBatchState` :func:`ttt_linear_step` returns (inside a mini-batch, its first tokens complete that
    mini-batch exactly as the steps would: they run token by token, the rest on ``backend``). The end of the
    sequence closes the last mini-batch: running [0:t] then [t:T] equals [0:T] when t is a multiple of
    mini_batch_size. The chunk backend chunks on mini-batch boundaries (with inner_norm, one mini-batch per
    chunk; chunk_size unused).
    Returns (o [B, T, H, V] in q's dtype, final W [B, H, K, V] float32 (float64 for float64) or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, eta=eta, initial_state=initial_state, norm_weight=norm_weight, norm_bias=norm_bias)
    check_bool("output_final_state", output_final_state)
    check_scalar_gate("eta", eta, d)
    check_chunk_size(chunk_size)
    check_mini_batch_size(mini_batch_size)
    initial_state, partial = split_initial_state(initial_state, d, 1, mini_batch_size, q)
    norm_weight, norm_bias = resolve_inner_norm(inner_norm, norm_weight, norm_bias, norm_eps, d, q)
    if backend == "auto" and not triton_takes(mini_batch_size, d.K, d.V):
        backend = "chunk"  # the kernels' limits (mini-batches of 16 or 32, head dims up to 128)
    impl = SPEC.resolve(backend, q.device)
    scale = resolve_scale(scale, d.K)
    o_head = None
    if partial is not None:  # the tokens that complete the step's mini-batch, as the step runs them
        head = min(d.T, mini_batch_size - partial.count)
        dt = partial.start.dtype
        norm = make_norm(norm_weight, norm_bias, norm_eps, dt, 1)
        o_head, partial = run_tokens(lambda st, *x: ttt_token(st, *x, norm, mini_batch_size), partial, head,
                                     q[:, :head].to(dt) * scale, *(x[:, :head].to(dt) for x in (k, v, eta)))
        o_head = o_head.to(q.dtype)
        if head == d.T:
            return o_head, (partial.current[0] if output_final_state else None)
        q, k, v, eta = (x[:, head:] for x in (q, k, v, eta))
        initial_state = partial.current[0]
    o, final = impl(
        q, k, v, eta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        mini_batch_size=mini_batch_size,
        norm_weight=norm_weight,
        norm_bias=norm_bias,
        norm_eps=norm_eps,
    )
    return (o if o_head is None else torch.cat([o_head, o], dim=1)), final


def ttt_linear_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    *,
    state: torch.Tensor | MiniBatchState | None = None,
    scale: float | None = None,
    mini_batch_size: int = 16,
    inner_norm: bool = False,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, MiniBatchState]:
    """One decoding step of :func:`ttt_linear`: one token's q, k [B, H, K], v [B, H, V], eta [B, H].

    ``state``: None (zeros), a W [B, H, K, V] at a mini-batch boundary (e.g. the op's final state) or
    the :class:`MiniBatchState` a previous step returned. Returns (o_t [B, H, V], MiniBatchState);
    its ``current[0]`` is W_t.
    """
    d = check_step_qkv(q, k, v)
    check_devices("q", q, eta=eta, state=state, norm_weight=norm_weight, norm_bias=norm_bias)
    check_shape("eta", eta, (d.B, d.H), "[B, H]")
    check_mini_batch_size(mini_batch_size)
    st = check_step_state(state, d, 1, mini_batch_size, q)
    norm_weight, norm_bias = resolve_inner_norm(inner_norm, norm_weight, norm_bias, norm_eps, d, q)
    dt = st.start.dtype
    norm = make_norm(norm_weight, norm_bias, norm_eps, dt, 1)
    qc, kc, vc, etac = (x.to(dt) for x in (q, k, v, eta))
    o_t, st = ttt_token(st, qc * resolve_scale(scale, d.K), kc, vc, etac, norm, mini_batch_size)
    return o_t.to(q.dtype), st


def ttt_linear_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """L2-normalised q, k, random v and learning rates eta in (0, 1) (sigmoid of noise) for tests and
    benchmarks; ttt_linear has no log gate, so ``g_value`` is ignored."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    q, k = (x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) for x in (q, k))
    eta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return {name: x.to(device=device, dtype=dtype) for name, x in dict(q=q, k=k, v=v, eta=eta).items()}


SPEC.fn = ttt_linear
SPEC.example_inputs = ttt_linear_example_inputs
SPEC.step = ttt_linear_step
