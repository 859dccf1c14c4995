"""deltaformer's two plain attention passes through torch's scaled_dot_product_attention (SDPA) on CUDA.

Of the Triton backend's three attention passes, two are plain softmax attention with no gate bias, which SDPA's
fused CUDA kernels (flash / cuDNN) run faster than the forgetting_attn kernels:

- the output attention  o_t = sum_{s<=t} softmax_{s<=t}(scale q_t.k_s) u_s  (forward and backward), run by
  softmax_attn's :func:`~linattn.ops.softmax_attn.core.causal_attention` (SDPA with its confinement guard:
  non-finite keys or u's reach no earlier query);
- the backward of the kernel logits  r_t = sum_{s<t} softmax_{s<t}(scale k_t.k_s) u_s : the gradient of r with
  respect to the keys, for dr = -b psi. Strict visibility is causal attention shifted by one position: row t of
  r is row t-1 of causal attention of the queries k_1..k_{T-1} over the keys k_0..k_{T-2} and values
  u_0..u_{T-2} (row 0 sees nothing and has no gradient). SDPA recomputes that forward (r itself, up to rounding)
  and differentiates it.

The forward's kernel-row normalisers stay on forgetting_attn's kernel (SDPA does not return them), and so does
everything with a cache (SDPA's causal mask is aligned to the first key, not to the cache's end), float32 inputs
(SDPA would run them in another precision than the rest of the backend) and head dims SDPA's fused kernels may not
take (:func:`sdpa_passes_apply`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..softmax_attn.core import HALF


def sdpa_passes_apply(k: torch.Tensor, v_dim: int, cached: int) -> bool:
    """Whether the passes run through SDPA: CUDA half-precision keys ``k`` (in the dtype the passes run in), no cache
    (``cached`` positions before the new ones), and head dims that SDPA's fused kernels take (equal key and value
    dims, a multiple of 8, at most 256; other shapes could fall back to its math kernel, whose memory grows with
    T^2)."""
    K = k.shape[-1]
    return k.is_cuda and k.dtype in HALF and cached == 0 and K == v_dim and K % 8 == 0 and K <= 256


def strict_attention_key_grad(k: torch.Tensor, u: torch.Tensor, dr: torch.Tensor, scale: float) -> torch.Tensor:
    """dk [B, T, H, K] (k's dtype) of r = strict causal attention of k over itself with values u (module docstring),
    for the gradient ``dr`` of r: k as queries and as keys together; u gets none."""
    dk = torch.zeros_like(k)
    if k.shape[1] < 2:
        return dk
    with torch.enable_grad():
        queries = k[:, 1:].detach().transpose(1, 2).requires_grad_()
        keys = k[:, :-1].detach().transpose(1, 2).requires_grad_()
        r = F.scaled_dot_product_attention(queries, keys, u[:, :-1].detach().transpose(1, 2), is_causal=True,
                                           scale=scale)
        dq, dkeys = torch.autograd.grad(r, (queries, keys), dr[:, 1:].to(r.dtype).transpose(1, 2))
    dk[:, :-1] = dkeys.transpose(1, 2)
    dk[:, 1:] += dq.transpose(1, 2)
    return dk
