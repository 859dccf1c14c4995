"""A fused Triton kernel pair for Comba's read key (CUDA, or the CPU under TRITON_INTERPRET=1).

Per token t and head h, with k [..., H, K] and the learned d [H, K]:

    p_t = s ⊙ k_t,   s = sigmoid(d_h)                       (float32 arithmetic, p in k's dtype)

Backward, with dp the gradient of p:

    dk_t = s ⊙ dp_t,   dd = s (1 - s) ⊙ sum_t dp_t ⊙ k_t

In PyTorch this is a sigmoid and a cast of d and a product over the keys forward, and two products, a sum over the
tokens and the sigmoid's and cast's gradients backward: eight kernels and three autograd nodes where this takes one
launch each way and a sum, host time on a GPU. A program runs one head over a block of tokens (its d row loaded
once); the sums over tokens are per-program partial rows added by PyTorch. Custom ops under torch.compile, an
autograd Function eagerly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.common.registered_ops import define_op
from ..ops.common.triton_compat import patch_interpreter
from ..ops.common.triton_launch import fast_launch
from ..ops.common.triton_ops import eager_backward, op_function
from ..ops.common.triton_utils import cdiv, row_tile

patch_interpreter()


@triton.jit
def _head_tile(d, N, H: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """This program's tile, BN tokens of head h (grid (cdiv(N, BN), H)): (offsets into a [N, H, K] tensor, their
    mask, s = sigmoid(d[h]) float32 [BK], the program's row i_n H + h of the partial sums)."""
    i_n, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    tokens = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    s = tl.sigmoid(tl.load(d + h * K + o_k, mask=m_k, other=0.0).to(tl.float32))
    return (tokens[:, None] * H + h) * K + o_k[None, :], (tokens < N)[:, None] & m_k[None, :], s, i_n * H + h


@fast_launch
@triton.jit(do_not_specialize=["N"])
def _read_keys_fwd_kernel(k, d, p, N, H: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Grid (cdiv(N, BN), H): p[n, h] = sigmoid(d[h]) k[n, h] for BN tokens n of head h."""
    offs, m, s, _ = _head_tile(d, N, H, K, BN, BK)
    kv = tl.load(k + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(p + offs, (kv * s[None, :]).to(p.dtype.element_ty), mask=m)


@fast_launch
@triton.jit(do_not_specialize=["N"])
def _read_keys_bwd_kernel(k, d, dp, dk, part, N, H: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr):
    """Grid (cdiv(N, BN), H): dk = sigmoid(d[h]) dp for BN tokens of head h; part[i_n, h] = s (1 - s) sum dp k over
    them."""
    offs, m, s, part_row = _head_tile(d, N, H, K, BN, BK)
    g = tl.load(dp + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(dk + offs, (g * s[None, :]).to(dk.dtype.element_ty), mask=m)
    kv = tl.load(k + offs, mask=m, other=0.0).to(tl.float32)
    o_k = tl.arange(0, BK)
    tl.store(part + part_row * K + o_k, tl.sum(g * kv, axis=0) * s * (1.0 - s), mask=o_k < K)


def _check(k: torch.Tensor, d: torch.Tensor) -> None:
    if k.dim() < 2 or tuple(k.shape[-2:]) != tuple(d.shape):
        raise ValueError(f"k must be [..., H, K] with d [H, K] = {list(d.shape)} its last two dims, got "
                         f"{list(k.shape)}")


def _fwd(k: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """p = sigmoid(d) ⊙ k in k's dtype."""
    _check(k, d)
    H, K = d.shape
    N = k.numel() // (H * K)
    p = torch.empty_like(k)
    BN, BK = row_tile(K)
    _read_keys_fwd_kernel[(cdiv(N, BN), H)](k=k, d=d, p=p, N=N, H=H, K=K, BN=BN, BK=BK)
    return p


def _bwd(k: torch.Tensor, d: torch.Tensor, dp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dd) given dp shaped like k."""
    _check(k, d)
    if dp.shape != k.shape:
        raise ValueError(f"dp must be shaped like k {list(k.shape)}, got {list(dp.shape)}")
    H, K = d.shape
    N = k.numel() // (H * K)
    BN, BK = row_tile(K)
    programs = cdiv(N, BN)
    dk = torch.empty_like(k)
    part = torch.empty(programs, H, K, device=k.device, dtype=torch.float32)
    _read_keys_bwd_kernel[(programs, H)](k=k, d=d, dp=dp, dk=dk, part=part, N=N, H=H, K=K, BN=BN, BK=BK)
    return dk, part.sum(0).to(d.dtype)


def _fwd_fake(k, d):
    return torch.empty_like(k)


def _bwd_fake(k, d, dp):
    return torch.empty_like(k), torch.empty_like(d)


_fwd_op = define_op("comba_read_keys_fwd", _fwd, _fwd_fake)
_bwd_op = define_op("comba_read_keys_bwd", _bwd, _bwd_fake)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dp):
    k, d = ctx.saved_tensors
    if dp is None:
        return None, None
    run = _bwd if eager_backward(ctx) else _bwd_op
    return run(k, d, dp.contiguous())


_differentiable = op_function("CombaReadKeysTriton", _fwd, _fwd_op, _setup, _backward)


def read_keys_triton(k: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """p = sigmoid(d) ⊙ k (module docstring): k [..., H, K], d [H, K]; p in k's dtype, one launch each way."""
    return _differentiable(k.contiguous(), d.contiguous())
