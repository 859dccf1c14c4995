"""PaTH's attention across chunks, one query block at a time, with a hand-written backward (memory O(T)).

Blocks: the cache (T0 keys S0 already in the frame of the first chunk's start, log decays D0) and chunks
0 .. N-1 of C positions, each with (from chunk.py) its queries moved to the chunk start Q^_a, its keys
moved to the chunk end K^_j, its Householder product P_j (passed as P_j^T), its local cumulative gates
Gl_j, gate total c_j, and its intra-chunk logits. For query block a and an earlier key block j,

    logit_{a,j} = scale Q_{a,j} K^_j^T + Gl_a[t] + (c_j + ... + c_{a-1}) - Gl_j[s],
    Q_{a,a-1} = Q^_a,   Q_{a,j-1} = Q_{a,j} P_j              (the queries moved back to the end of chunk j)

and the cache is "block -1" (keys S0, -Gl = D0, no product of its own). Forward, per query block a: the
chain Q_{a,a-1} .. Q_{a,-1} (a matmuls of C x K x K), all its logits at once ([C, T0 + (a + 1) C]), a
plain softmax; only the row log-sum-exp is kept. Backward, per query block: the same logits again,
dS = P (dP - rowsum(dO o)), then the chain's adjoint in reverse,

    G_{-1} = scale dS_{a,-1} S0,   G_j = scale dS_{a,j} K^_j + G_{j-1} P_j^T,   dP_j^T += G_{j-1}^T Q_{a,j},
    dQ^_a = G_{a-1},   dK^_j += scale dS_{a,j}^T Q_{a,j}.

Memory: the saved inputs, outputs and log-sum-exp (O(T (K + C + V) + N K^2)) plus one query block's
chain and logits (O(T (K + C))); nothing of size T x T or T^2 K / C. Compute O(T^2 (K + K^2 / C)).
"""

from __future__ import annotations

import torch


def _chain(Qhat_a: torch.Tensor, Pt: torch.Tensor, a: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query block a moved back block by block: (stack [B, H, a, C, K] of Q_{a,j} for j < a, Q_{a,-1})."""
    cur, out = Qhat_a, []
    for j in range(a - 1, -1, -1):
        out.append(cur)
        cur = cur @ Pt[:, :, j].transpose(-1, -2)
    Qs = torch.stack(out[::-1], dim=2) if out else Qhat_a.new_zeros(*Qhat_a.shape[:2], 0, *Qhat_a.shape[2:])
    return Qs, cur


def _logits(tensors: tuple[torch.Tensor, ...], a: int, scale: float) -> tuple[torch.Tensor, ...]:
    """Logits [B, H, C, T0 + (a + 1) C] of query block a against the cache, the earlier chunks and itself,
    with the chain (Qs, Q_{a,-1}) that produced them."""
    Qhat, intra, Pt, Khat, total, Gl, S0, D0 = tensors
    B, H, _, C, _ = Qhat.shape
    Qs, Qc = _chain(Qhat[:, :, a], Pt, a)
    tot = total[:, :, :a]
    off = tot.flip(-1).cumsum(-1).flip(-1)  # c_j + ... + c_{a-1}, [B, H, a]
    off_cache = tot.sum(-1)  # [B, H]
    row = Gl[:, :, a, :, None]  # Gl_a[t]
    cache = scale * Qc @ S0.transpose(-1, -2) + row + off_cache[..., None, None] + D0[:, :, None, :]
    past = scale * Qs @ Khat[:, :, :a].transpose(-1, -2)  # [B, H, a, C(t), C(s)]
    past = past + off[..., None, None] - Gl[:, :, :a, None, :]
    past = past.permute(0, 1, 3, 2, 4).reshape(B, H, C, a * C) + row
    return torch.cat([cache, past, intra[:, :, a]], dim=-1), Qs, Qc


class PathBlockwise(torch.autograd.Function):
    """o [B, H, N, C, V] of every query block; inputs as in the module docstring ([B, H, N, ...] per chunk,
    cache S0 [B, H, T0, K], V0 [B, H, T0, V], D0 [B, H, T0]); differentiable in every tensor."""

    @staticmethod
    def forward(ctx, Qhat: torch.Tensor, intra: torch.Tensor, Pt: torch.Tensor, Khat: torch.Tensor,
                total: torch.Tensor, Gl: torch.Tensor, Vc: torch.Tensor, S0: torch.Tensor, V0: torch.Tensor,
                D0: torch.Tensor, scale: float) -> torch.Tensor:
        B, H, N, C, _ = Qhat.shape
        T0 = S0.shape[2]
        tensors = (Qhat, intra, Pt, Khat, total, Gl, S0, D0)
        V_all = torch.cat([V0, Vc.reshape(B, H, N * C, -1)], dim=2)
        o, lse = Qhat.new_empty(B, H, N, C, Vc.shape[-1]), Qhat.new_empty(B, H, N, C)
        for a in range(N):
            logits = _logits(tensors, a, scale)[0]
            lse[:, :, a] = torch.logsumexp(logits, dim=-1)
            o[:, :, a] = torch.exp(logits - lse[:, :, a, :, None]) @ V_all[:, :, : T0 + (a + 1) * C]
        ctx.save_for_backward(*tensors, Vc, V0, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        Qhat, intra, Pt, Khat, total, Gl, S0, D0, Vc, V0, o, lse = ctx.saved_tensors
        tensors = (Qhat, intra, Pt, Khat, total, Gl, S0, D0)
        scale = ctx.scale
        B, H, N, C, _ = Qhat.shape
        T0 = S0.shape[2]
        do = do.to(o.dtype)
        delta = (do * o).sum(-1)  # rowsum(dO o) [B, H, N, C]
        V_all = torch.cat([V0, Vc.reshape(B, H, N * C, -1)], dim=2)
        dV_all = torch.zeros_like(V_all)
        dQhat, dintra, dPt, dKhat, dtotal, dGl, dS0, dD0 = (torch.zeros_like(x) for x in tensors)
        for a in range(N):
            n = T0 + (a + 1) * C
            logits, Qs, Qc = _logits(tensors, a, scale)
            p = torch.exp(logits - lse[:, :, a, :, None])
            dV_all[:, :, :n] += p.transpose(-1, -2) @ do[:, :, a]
            ds = p * (do[:, :, a] @ V_all[:, :, :n].transpose(-1, -2) - delta[:, :, a, :, None])
            ds0, dsi = ds[..., :T0], ds[..., n - C:]
            dsp = ds[..., T0: n - C].reshape(B, H, C, a, C).permute(0, 1, 3, 2, 4)  # [B, H, a, C(t), C(s)]
            dintra[:, :, a] = dsi
            # biases: Gl_a[t] on every past logit, -Gl_j[s], D0[s], and the offsets sums of totals
            dGl[:, :, a] += ds0.sum(-1) + dsp.sum((2, 4))
            dGl[:, :, :a] -= dsp.sum(-2)
            dD0 += ds0.sum(-2)
            doff = dsp.sum((-1, -2))  # [B, H, a]: offset of block j covers totals j .. a-1
            dtotal[:, :, :a] += doff.cumsum(-1) + ds0.sum((-1, -2))[..., None]
            # keys and the chain of moved queries
            dKhat[:, :, :a] += scale * dsp.transpose(-1, -2) @ Qs
            dS0 += scale * ds0.transpose(-1, -2) @ Qc
            direct = scale * dsp @ Khat[:, :, :a]  # [B, H, a, C, K]
            G, G_prev = scale * ds0 @ S0, []
            for j in range(a):
                G_prev.append(G)
                G = direct[:, :, j] + G @ Pt[:, :, j]
            if a:
                dPt[:, :, :a] += torch.stack(G_prev, dim=2).transpose(-1, -2) @ Qs
            dQhat[:, :, a] += G
        dV0, dVc = dV_all[:, :, :T0], dV_all[:, :, T0:].reshape(Vc.shape)
        return dQhat, dintra, dPt, dKhat, dtotal, dGl, dVc, dS0, dV0, dD0, None
