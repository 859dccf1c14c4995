"""Public entry points of deltaformer: validation, backend dispatch, registry entry."""

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
from ..common.kv_cache import KVCache
from ..common.kv_checks import check_kv_cache
from ..common.registry import OpSpec, register_op
from ..common.values import check_bool
from ..common.varlen import packable
from .chunk import deltaformer_chunk
from .reference import deltaformer_parallel, deltaformer_recurrent

EQUATION = ("u_t = v_t - b_t sum_{s<t} softmax_{s<t}(scale k_t.k_s) u_s;  "
            "o_t = sum_{s<=t} softmax_{s<=t}(scale q_t.k_s) u_s")

SPEC = register_op(
    OpSpec(
        name="deltaformer",
        family="softmax",
        equation=EQUATION,
        op_args=("beta",),
        state_shape="KVCache(k [B, T0, H, K], v = u [B, T0, H, V])",
        implementations={"recurrent": deltaformer_recurrent, "parallel": deltaformer_parallel,
                         "chunk": deltaformer_chunk},
        notes="kernel normalised over strictly past keys (kappa_0. = 0, u_0 = v_0); arXiv 2505.19488",
    )
)


@packable("q", "k", "v", "beta")
def deltaformer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, KVCache | None]:
    """DeltaFormer (Zhong et al., arXiv 2505.19488): a delta rule in the softmax kernel's feature space.

        kappa_ts = exp(scale k_t.k_s) / sum_{r<t} exp(scale k_t.k_r)     for s < t
        u_t = v_t - b_t sum_{s<t} kappa_ts u_s
        o_t = sum_{s<=t} softmax_{s<=t}(scale q_t.k_s) u_s

    i.e. U = (I + diag(b) tril(softmax-kernel(K K^T), -1))^-1 V, then causal softmax attention of Q
    over (K, U). Normalisation of the kernel: kappa is the softmax over the *strictly past* keys
    (s < t), so each row of the kernel sums to 1 (u_0 = v_0, no past). This is the paper's choice of
    the softmax kernel as the associative memory's kernel (the same normalised kernel the attention
    reads with, so the delta step subtracts exactly what an attention read with key k_t over the past
    would retrieve), with the keys playing both roles (k_t . k_s), as in the authors' kernels.
    ``scale`` (default K^-1/2) is used for both the kernel and the attention.

    Args: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] (the paper: sigmoid of a projection);
    initial_state: a KVCache (k [B, T0, H, K], v = the u's [B, T0, H, V]) continuing a sequence.
    Returns (o [B, T, H, V] in q's dtype, KVCache of all keys and u's (float32, float64 for float64
    inputs) or None).
    """
    d = check_qkv(q, k, v)
    check_devices("q", q, beta=beta, initial_state=initial_state)
    check_scalar_gate("beta", beta, d)
    check_kv_cache("initial_state", initial_state, d, device=q.device)
    check_bool("output_final_state", output_final_state)
    check_chunk_size(chunk_size)
    impl = SPEC.resolve(backend, q.device)
    return impl(q, k, v, beta, scale=resolve_scale(scale, d.K), initial_state=initial_state,
                output_final_state=output_final_state, chunk_size=chunk_size)


def deltaformer_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: KVCache | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """One decoding step of :func:`deltaformer`: one token's q, k [B, H, K], v [B, H, V],
    beta [B, H]; ``state`` the KVCache so far (a step's or the op's).
    Returns (o_t [B, H, V], the cache with this token appended)."""
    d = check_step_qkv(q, k, v)
    check_devices("q", q, beta=beta, state=state)
    check_shape("beta", beta, (d.B, d.H), "[B, H]")
    check_kv_cache("state", state, d, device=q.device)
    o, cache = deltaformer_recurrent(q[:, None], k[:, None], v[:, None], beta[:, None],
                                     scale=resolve_scale(scale, d.K), initial_state=state, output_final_state=True)
    return o[:, 0], cache


def deltaformer_example_inputs(
    B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", seed: int = 0, g_value: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random q, v, L2-normalised k (the layer's choice) and beta = sigmoid(normal); no gate (g_value unused)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, n, generator=gen) for n in (K, K, V))
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return {name: x.to(device=device, dtype=dtype) for name, x in dict(q=q, k=k, v=v, beta=beta).items()}


SPEC.fn = deltaformer
SPEC.example_inputs = deltaformer_example_inputs
SPEC.step = deltaformer_step
