"""The inter-chunk recurrence of chunkwise linear RNNs whose state transition is a matrix:

    S_{n+1} = M_n S_n + R_n,      n = 0..N-1,

(delta-rule family: M_n = gamma I - K_end^T W per chunk). A hand-written autograd Function keeps
each step of the Python loop to one batched matmul, forward and backward:

    forward:   S_{n+1} = R_n + M_n S_n
    backward:  dS_n = dS_n(direct) + M_n^T dS_{n+1};   dR_n = dS_{n+1};   dM_n = dS_{n+1} S_n^T,

where dR and dM are formed for all chunks at once after the loop. Layout: chunks first, so that
every step reads and writes contiguous memory.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class _MatrixScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, M: torch.Tensor, R: torch.Tensor, S0: torch.Tensor) -> torch.Tensor:
        # M [N, Z, K, K], R [N, Z, K, V], S0 [Z, K, V] -> all states [N + 1, Z, K, V]
        S = R.new_empty(M.shape[0] + 1, *R.shape[1:])
        S[0].copy_(S0)
        Ss = S.unbind(0)  # views made once: the loop body is a single kernel launch
        for M_n, R_n, S_n, S_next in zip(M.unbind(0), R.unbind(0), Ss[:-1], Ss[1:]):
            torch.baddbmm(R_n, M_n, S_n, out=S_next)
        ctx.save_for_backward(M, S)
        return S

    @staticmethod
    @once_differentiable
    def backward(ctx, dS: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        M, S = ctx.saved_tensors
        N = M.shape[0]
        dS = dS.contiguous()
        G = torch.empty_like(dS)  # G[n]: total gradient of state n
        G[N].copy_(dS[N])
        Gs, dSs, Mts = G.unbind(0), dS.unbind(0), M.transpose(-1, -2).unbind(0)
        for n in range(N - 1, -1, -1):
            torch.baddbmm(dSs[n], Mts[n], Gs[n + 1], out=Gs[n])
        dM = G[1:] @ S[:N].transpose(-1, -2) if ctx.needs_input_grad[0] else None
        dR = G[1:] if ctx.needs_input_grad[1] else None
        dS0 = G[0] if ctx.needs_input_grad[2] else None
        return dM, dR, dS0


def matrix_state_scan(
    M: torch.Tensor, R: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run S_{n+1} = M_n S_n + R_n over n = 0..N-1 from S_0 = initial_state (None: zeros).

    ``M`` [N, *batch, K, K], ``R`` [N, *batch, K, V], ``initial_state`` [*batch, K, V] (all cast to the
    promoted dtype of M and R). Returns (the states entering every chunk [N, *batch, K, V], the state
    after the last one [*batch, K, V]). Differentiable in M, R and initial_state (first order).
    """
    N, *batch, K, V = R.shape
    # under autocast M and R can come out in different dtypes (matmul products in bf16, the rest float32)
    dtype = torch.promote_types(M.dtype, R.dtype)
    M, R = M.to(dtype), R.to(dtype)
    Z = 1
    for b in batch:
        Z *= b
    S0 = R.new_zeros(Z, K, V) if initial_state is None else initial_state.to(R.dtype).reshape(Z, K, V)
    S = _MatrixScan.apply(M.reshape(N, Z, K, K), R.reshape(N, Z, K, V), S0).view(N + 1, *batch, K, V)
    return S[:N], S[N]
