"""MesaNet in memory linear in T, composed of scalar-decay linear-attention scans (simple_gla's op).

    G_t = exp(g_t) G_{t-1} + b_t k_t k_t^T,   H_t = exp(g_t) H_{t-1} + b_t k_t v_t^T,
    o_t = H_t^T x_t,   (G_t + diag(lamb)) x_t = scale q_t

A scan (the simple_gla recurrence with scale 1: S_t = exp(g_t) S_{t-1} + k_t w_t^T, y_t = S_t^T p_t) gives every
token's product with its own state at once without building the states. With w = b k and S_0 = G_0^T, S_t = G_t^T,
so y_t = G_t p_t: one scan is one matrix-vector product with every G_t, and

* solver "cg": ``cg_steps`` conjugate-gradient steps, all tokens at once (a step is one scan plus elementwise work,
  its step sizes per-token tensors: no host synchronisation, no data-dependent exit), then o = scan(x; k, b v; H_0).
  A solve is the scan's ``solve_system(k, b k, g, S_0, lamb, b, steps)``: :func:`solve_by_reader` (``solve`` with one
  read of the scan per step) on the PyTorch scan; one kernel launch for all steps on the Triton one
  (triton_cg.py), whose programs read each token's products from its chunk's state and keys. (The triton backend
  runs this algorithm on kernels of its own at head dims up to 128: triton_fused.py.)
  Nothing of size K x K per token exists; kept for the backward pass: x [B, T, H, K] and the inputs.
  Backward by implicit differentiation (not through the CG iterations): with do and the final states' gradients,
      dx_t = H_t do_t                  (the output scan's query gradient; the same backward call gives H's inputs'
                                        gradients: k, b v, g and H_0)
      u_t  = (G_t + diag(lamb))^-T dx_t  (the same CG, on the transposed system: the scan with S_0 = G_0)
      dq_t = scale u_t,   dlamb = -sum_{b,t} u_t * x_t,   dG_t (through the solve) = -u_t x_t^T,
  and -sum_t u_t^T G_t x_t is the scan y_t = G_t x_t read with the cotangent -u_t: its backward call gives the
  gradients of k (on the key side and, through b k, on the value side), b, g and G_0. With fewer than K steps the
  forward is CG's approximation and the gradients are those of the exact solve at it (not of the truncated
  iteration), each from a CG of the same number of steps.
* solver "exact": a Cholesky factorisation per token needs every G_t. The sequence runs in blocks of
  ``EXACT_BLOCK_CHUNKS`` chunks on the chunk backend's code, carrying (G, H) from block to block; under autograd each
  block is checkpointed (its G_t are rebuilt in the backward pass), so memory is O(T (K + V)) plus one block's
  O(block K^2), at the cost of running each block's forward twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch.utils.checkpoint import checkpoint

from ..common.checks import compute_dtype
from ..common.values import value_checks_enabled
from ..simple_gla.chunk import simple_gla_chunk
from .chunk import mesa_net_chunk
from .reference import MesaState, initial_mesa_state
from .solve import _not_positive_definite, shifted_cg_solve

# blocks of the exact solver: 4 chunks (256 tokens at chunk_size 64) hold 256 K x K matrices per batch-head at once
EXACT_BLOCK_CHUNKS = 4


class Scan(Protocol):
    """y_t = S_t^T q_t with S_t = exp(g_t) S_{t-1} + k_t v_t^T (scale 1), and its vector-Jacobian product."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                s0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(y [B, T, H, V], S_T [B, H, K, V])."""
        ...

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, s0: torch.Tensor | None,
                 dy: torch.Tensor, dST: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv, dg, dS_0) for the cotangents dy of y and dST of S_T (None: zero)."""
        ...

    def reader(self, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               s0: torch.Tensor | None) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """q -> forward(q, k, v, g, s0), for many q: CG reads one scan with a new query at every step, so a scan
        that can keep its states across queries does."""
        ...

    def solve(self, product: Callable[[torch.Tensor], torch.Tensor], lamb: torch.Tensor, b: torch.Tensor,
              steps: int) -> torch.Tensor:
        """``steps`` CG steps on (G_t + diag(lamb)) x_t = b_t, ``product(p)`` giving G_t p_t (:func:`cg_solve`)."""
        ...

    def solve_system(self, k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, s0: torch.Tensor | None,
                     lamb: torch.Tensor, b: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, S_T): ``steps`` CG steps on (G_t + diag(lamb)) x_t = b_t with G_t = S_t^T, S the scan of (k, w, g)
        from ``s0`` (:func:`solve_by_reader`: ``solve`` over ``reader``, or one fused computation)."""
        ...


def solve_by_reader(scan: Scan, k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, s0: torch.Tensor | None,
                    lamb: torch.Tensor, b: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`Scan.solve_system` by ``scan.solve`` with the products of ``scan.reader``; S_T from the first product
    (with no steps, from a read of b)."""
    read = scan.reader(k, w, g, s0)
    final: list[torch.Tensor] = []

    def product(p: torch.Tensor) -> torch.Tensor:
        y, sT = read(p)
        if not final:
            final.append(sT)
        return y

    x = scan.solve(product, lamb, b, steps)
    return x, (final[0] if final else read(b)[1])


class TorchScan:
    """The scan on simple_gla's PyTorch chunk form (any device and dtype, float64 included); its backward by
    autograd of a recomputed forward."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                s0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        y, sT = simple_gla_chunk(q, k, v, g, scale=1.0, initial_state=s0, output_final_state=True,
                                 chunk_size=self.chunk_size)
        return y, sT

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, s0: torch.Tensor | None,
                 dy: torch.Tensor, dST: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        B, _, H, K = q.shape
        if s0 is None:
            s0 = q.new_zeros(B, H, K, v.shape[-1])
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, s0)]
            y, sT = self.forward(*leaves)
            outputs, cotangents = [y], [dy]
            if dST is not None:
                outputs.append(sT)
                cotangents.append(dST)
            return torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True, materialize_grads=True)

    def reader(self, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               s0: torch.Tensor | None) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        return lambda q: self.forward(q, k, v, g, s0)

    def solve(self, product: Callable[[torch.Tensor], torch.Tensor], lamb: torch.Tensor, b: torch.Tensor,
              steps: int) -> torch.Tensor:
        return shifted_cg_solve(product, lamb, b, steps)

    def solve_system(self, k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, s0: torch.Tensor | None,
                     lamb: torch.Tensor, b: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        return solve_by_reader(self, k, w, g, s0, lamb, b, steps)


def _transpose(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.transpose(-1, -2).contiguous()


class _MesaCG(torch.autograd.Function):
    """(q, k, v, g, beta, lamb, G_0, H_0) -> (o, G_T, H_T) by CG over scans; backward by implicit differentiation
    (module docstring). Inputs in the compute dtype, contiguous; G_0, H_0 may be None."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, lamb, G0, H0, scale: float, steps: int, scan: Scan):
        kb, vb = beta[..., None] * k, beta[..., None] * v
        b = q * scale
        # S_0 = G_0^T, so that S_t = G_t^T and the scan reads G_t p
        x, ST = scan.solve_system(k, kb, g, _transpose(G0), lamb, b.contiguous(), steps)
        GT = ST.transpose(-1, -2)
        # CG's step sizes turn a NaN or inf right-hand side into zero steps: make it show in x (b * 0 is 0 if finite)
        x = x + b * 0
        o, HT = scan.forward(x, k, vb, g, H0)
        ctx.save_for_backward(x, k, v, g, beta, lamb, G0, H0)
        ctx.scale, ctx.steps, ctx.scan = scale, steps, scan
        ctx.set_materialize_grads(False)
        return o, GT.contiguous(), HT

    @staticmethod
    def backward(ctx, do, dGT, dHT):
        x, k, v, g, beta, lamb, G0, H0 = ctx.saved_tensors
        scan: Scan = ctx.scan
        kb, vb = beta[..., None] * k, beta[..., None] * v
        if do is None:
            do = torch.zeros(*x.shape[:-1], v.shape[-1], dtype=x.dtype, device=x.device)
        # o_t = H_t^T x_t: the query gradient is dx_t = H_t do_t; H's inputs get theirs from the same call
        dx, dk, dvb, dg, dH0 = scan.backward(x, k, vb, g, H0, do.contiguous(), _contiguous(dHT))
        # u_t = A_t^-T dx_t; A_t^T p = G_t^T p + lamb p is the scan with S_0 = G_0 (S_t = G_t)
        u, _ = scan.solve_system(k, kb, g, G0, lamb, dx.contiguous(), ctx.steps)
        # the solve's gradient to G_t is -u_t x_t^T: back through y_t = G_t x_t read with -u_t (and G_T's gradient)
        _, dk2, dkb, dg2, dG0T = scan.backward(x, k, kb, g, _transpose(G0), -u, _transpose(dGT))
        dk = dk + dk2 + beta[..., None] * dkb
        dbeta = (dvb * v).sum(-1) + (dkb * k).sum(-1)
        dlamb = -(u * x).sum((0, 1))
        dG0 = None if G0 is None else dG0T.transpose(-1, -2)
        return (ctx.scale * u, dk, beta[..., None] * dvb, dg + dg2, dbeta, dlamb, dG0,
                None if H0 is None else dH0, None, None, None)


def _contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.contiguous()


def check_cg_system(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, G0: torch.Tensor | None,
                    dtype: torch.dtype) -> None:
    """Raise what chunk's CG raises for G_t + diag(lamb) with NaN or inf entries, read from the inputs G_t is made of
    (where value checks run: reading the values is a host synchronisation on CUDA); ``dtype``: the compute dtype
    the message names."""
    if value_checks_enabled(k) and not all(bool(torch.isfinite(x).all()) for x in (k, g, beta, G0) if x is not None):
        raise _not_positive_definite("it has NaN or inf entries, so conjugate gradient cannot solve it", dtype)


def _cg(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, lamb: torch.Tensor,
        initial_state: MesaState | None, scale: float, cg_steps: int | None, scan: Scan
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, G_T, H_T) by CG over ``scan`` in the compute dtype."""
    dt = compute_dtype(q)
    K = q.shape[-1]
    q, k, v, g, beta, lamb = (x.to(dt).contiguous() for x in (q, k, v, g, beta, lamb))
    G0, H0 = (None, None) if initial_state is None else (x.to(dt).contiguous() for x in initial_state)
    check_cg_system(k, g, beta, G0, dt)
    return _MesaCG.apply(q, k, v, g, beta, lamb, G0, H0, float(scale), K if cg_steps is None else cg_steps, scan)


def _exact_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  lamb: torch.Tensor, initial_state: MesaState | None, scale: float, chunk_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, G_T, H_T) by the chunk backend's exact solve, block by block (checkpointed under autograd)."""
    B, T, H, K = q.shape
    dt = compute_dtype(q)
    G, Hs = initial_mesa_state(initial_state, B, H, K, v.shape[-1], dt, q.device)
    track = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, lamb, G, Hs))

    def block(q, k, v, g, beta, lamb, G, Hs):
        o, (G, Hs) = mesa_net_chunk(q, k, v, g, beta, lamb, scale=scale, initial_state=(G, Hs),
                                    output_final_state=True, chunk_size=chunk_size, solver="exact")
        return o, G, Hs

    outputs = []
    step = EXACT_BLOCK_CHUNKS * chunk_size
    for s in range(0, T, step):
        args = (*(x[:, s:s + step] for x in (q, k, v, g, beta)), lamb, G, Hs)
        o, G, Hs = checkpoint(block, *args, use_reentrant=False) if track else block(*args)
        outputs.append(o)
    return torch.cat(outputs, 1), G, Hs


def mesa_net_composed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lamb: torch.Tensor,
    *,
    scale: float,
    initial_state: MesaState | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    solver: str = "exact",
    cg_steps: int | None = None,
    scan: Scan | None = None,
) -> tuple[torch.Tensor, MesaState | None]:
    """MesaNet, G_t = exp(g_t) G_{t-1} + b_t k_t k_t^T, H_t = exp(g_t) H_{t-1} + b_t k_t v_t^T,
    o_t = H_t^T (G_t + diag(lamb))^-1 (scale q_t), in memory O(T (K + V)) per head (module docstring); ``scan``
    runs the scalar-decay scans of solver "cg" (default: simple_gla's PyTorch chunk form). Inputs validated by
    ``mesa_net``; returns (o in q's dtype, final (G, H) in the compute dtype or None)."""
    if solver == "exact":
        o, G, Hs = _exact_blocks(q, k, v, g, beta, lamb, initial_state, scale, chunk_size)
    else:
        o, G, Hs = _cg(q, k, v, g, beta, lamb, initial_state, scale, cg_steps,
                       TorchScan(chunk_size) if scan is None else scan)
    return o.to(q.dtype), ((G, Hs) if output_final_state else None)
