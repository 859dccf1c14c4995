"""PaTH's UT transform on the Triton backend: the kernels of ``ut_kernels.py`` as a differentiable op.

    (Q^, intra, E, K^) = UT(q, k, w, beta, g)   per chunk of C positions (equations in ``ut_kernels.py``)

One forward kernel and one backward kernel, a program per chunk and batch*head each, and the batched product
E = W^T Tw replace the ~60 PyTorch kernels of :func:`~linattn.ops.path_attn.chunk.ut_transform`; the backward
recomputes the chunk's factors from the inputs, so a training call keeps only q, k, beta, Tw and w by chunks. Registered
with torch.library (fake kernels), called directly in eager mode, as the other Triton ops
(``common/triton_ops.py``).
"""

from __future__ import annotations

import torch

from ..common.registered_ops import define_op
from ..common.triton_ops import eager_backward, op_function
from ..common.triton_utils import block, cdiv, launch_options, launch_overrides
from .ut_kernels import ut_bwd_kernel, ut_fwd_kernel

# "BJ": the columns of K handled at a time for 16-bit inputs, "BJ_float32" for float32 ones (whose tf32x3 operands
# take twice the shared memory: the backward at 64 would need more than an H100 or H200 has); "precision32": the
# products' precision for float32 inputs. LINATTN_TRITON_LAUNCH='{"path_attn_ut": {...}}' overrides them.
LAUNCH = {"fwd_warps": 4, "fwd_stages": 1, "bwd_warps": 4, "bwd_stages": 1, "precision32": "tf32x3", "BJ": 64,
          "BJ_float32": 32}
launch_overrides("path_attn_ut", LAUNCH)


def ut_forward(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, scale: float,
               C: int, full: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Q^, intra, E, K^, Tw, Wc) from q, k, w [B, T, H, K] and beta, g [B, T, H] (contiguous; q, k, w of one dtype,
    bf16 / fp16 / float32): Q^, K^, Tw and Wc (w by chunks) [B, H, N C, K] and E = W^T Tw [B, H, N, K, K] in q's
    dtype (float32 with ``full``), intra [B, H, N, C, C] float32; N = ceil(T / C), the last chunk zero-padded
    (w = b = 0: its factors are I). Tw and Wc are what the backward pass reads of the forward."""
    B, T, H, K = q.shape
    N = cdiv(T, C)
    dt = torch.float32 if full else q.dtype
    qh, kh, tw, wc = (q.new_empty(B, H, N * C, K, dtype=dt) for _ in range(4))
    intra = q.new_empty(B, H, N, C, C, dtype=torch.float32)
    ut_fwd_kernel[(N, B * H)](
        q=q, k=k, w=w, beta=beta, g=g, qh=qh, kh=kh, intra=intra, tw=tw, wc=wc, scale=scale, T=T, N=N, H=H, K=K,
        C=C, BJ=_columns(K, q.dtype), PREC=_precision(q.dtype), **launch_options(LAUNCH, "fwd", q.dtype, 1))
    E = wc.unflatten(2, (N, C)).transpose(-1, -2) @ tw.unflatten(2, (N, C))
    return qh, intra, E, kh, tw, wc


def ut_backward(q: torch.Tensor, k: torch.Tensor, wc: torch.Tensor, beta: torch.Tensor, tw: torch.Tensor,
                dqh: torch.Tensor, dintra: torch.Tensor, dE: torch.Tensor, dkh: torch.Tensor, scale: float, C: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, w [B, T, H, K] (in q's dtype), beta [B, T, H] (in its dtype) and g (float32) from those
    of the forward's outputs; wc, tw: the forward's."""
    B, T, H, K = q.shape
    N = cdiv(T, C)
    dq, dk, dw = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    dbeta, dg = torch.empty_like(beta), torch.empty_like(beta, dtype=torch.float32)  # dg: in g's dtype later
    # E = W^T Tw: dTw = W dE, dW = Tw dE^T, as batched products in the forward's precision (E reached the flash pass
    # in it: its gradient carries no more)
    dE = dE.to(wc.dtype)
    dtw = wc.unflatten(2, (N, C)) @ dE
    dwe = tw.unflatten(2, (N, C)) @ dE.transpose(-1, -2)
    ut_bwd_kernel[(N, B * H)](
        q=q, k=k, wc=wc, beta=beta, dqh=dqh.contiguous(), dkh=dkh.contiguous(), dintra=dintra.contiguous(), dtw=dtw,
        dwe=dwe, dq=dq, dk=dk, dw=dw, dbeta=dbeta, dg=dg, scale=scale, T=T, N=N, H=H, K=K, C=C,
        BJ=_columns(K, q.dtype), PREC=_precision(q.dtype), **launch_options(LAUNCH, "bwd", q.dtype, 1))
    return dq, dk, dw, dbeta, dg


def _columns(K: int, dtype: torch.dtype) -> int:
    """BJ for head dim K: at least 32, since 16-column tiles with 64-token chunks at 8 warps make an illegal memory
    access on an H200 (Triton 3.6; 32 and more do not, nor 16 at 4 warps)."""
    return max(32, min(LAUNCH["BJ_float32" if dtype == torch.float32 else "BJ"], block(K)))


def _precision(dtype: torch.dtype) -> str:
    """The kernels' product precision: float32 inputs keep float32 accuracy; for 16-bit inputs, whose outputs are
    rounded to 16 bits, single tf32 products suffice."""
    return LAUNCH["precision32"] if dtype == torch.float32 else "tf32"


def _fwd_fake(q, k, w, beta, g, scale, C, full):
    B, T, H, K = q.shape
    N = cdiv(T, C)
    dt = torch.float32 if full else q.dtype
    rows = lambda: q.new_empty(B, H, N * C, K, dtype=dt)
    return rows(), q.new_empty(B, H, N, C, C, dtype=torch.float32), q.new_empty(B, H, N, K, K, dtype=dt), rows(), \
        rows(), rows()


def _bwd_fake(q, k, wc, beta, tw, dqh, dintra, dE, dkh, scale, C):
    return torch.empty_like(q), torch.empty_like(q), torch.empty_like(q), torch.empty_like(beta), \
        torch.empty_like(beta, dtype=torch.float32)


_fwd_op = define_op("path_attn_ut_fwd", ut_forward, _fwd_fake)
_bwd_op = define_op("path_attn_ut_bwd", ut_backward, _bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, w, beta, g, scale, C, _ = inputs
    ctx.save_for_backward(q, k, beta, output[4], output[5])
    ctx.scale, ctx.C, ctx.g_dtype = scale, C, g.dtype


def _backward_rule(ctx, dqh, dintra, dE, dkh, dtw, dwc):
    q, k, beta, tw, wc = ctx.saved_tensors
    grads = [dqh, dintra, dE, dkh]
    if all(x is None for x in grads):
        return (None,) * 8
    B, T, H, K = q.shape
    N = cdiv(T, ctx.C)
    shapes = [(B, H, N * ctx.C, K), (B, H, N, ctx.C, ctx.C), (B, H, N, K, K), (B, H, N * ctx.C, K)]
    grads = [q.new_zeros(s, dtype=torch.float32) if x is None else x for x, s in zip(grads, shapes)]
    run = ut_backward if eager_backward(ctx) else _bwd_op
    dq, dk, dw, dbeta, dg = run(q, k, wc, beta, tw, *grads, ctx.scale, ctx.C)
    return dq, dk, dw, dbeta, dg.to(ctx.g_dtype), None, None, None


_ut_differentiable = op_function("PathUTTriton", ut_forward, _fwd_op, _setup_context, _backward_rule,
                                 non_differentiable=(4, 5))


def ut_transform_triton(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                        scale: float, C: int, full: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable (Q^, intra, E, K^) of :func:`ut_forward` (inputs made contiguous here)."""
    # the kernels write q, k and w's gradients in q's dtype (a conversion differentiates)
    q, k, w = (x.to(q.dtype).contiguous() for x in (q, k, w))
    beta, g = beta.contiguous(), g.contiguous()
    return _ut_differentiable(q, k, w, beta, g, float(scale), int(C), bool(full))[:4]
