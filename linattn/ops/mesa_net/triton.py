"""mesa_net's ``backend="triton"``: MesaNet in memory O(T (K + V)) per head.

    G_t = exp(g_t) G_{t-1} + b_t k_t k_t^T,   H_t = exp(g_t) H_{t-1} + b_t k_t v_t^T,
    o_t = H_t^T (G_t + diag(lamb))^-1 (scale q_t)

solver "cg" at head dims up to 128 (bf16, fp16, float32): mesa_net's own kernels (``triton_fused.py``): the states of
both scans in one launch, all CG steps in one launch (``triton_cg.py``: a program holds some tokens of one chunk and
reads every product with G_t from the chunk's entering state and its keys, so the steps cost no launches and no pass
over the sequence each), the read-out; backward by implicit differentiation in six launches, the inputs read as
given (beta, the query scale and the transposes folded into the kernels). Under torch.compile the forward and
backward are registered custom ops with fake kernels.

Otherwise the algorithm of ``composed.py`` runs on scans (the ``Scan`` protocol): ``TritonScan``, simple_gla's Triton
kernels over float32 copies of the inputs (head dims above 128: the per-step form, one launch of simple_gla's output
kernel per CG step for the products and the step's vector updates in one fused kernel, ``TritonScan.reader`` and
``TritonScan.solve``), or for float64 simple_gla's PyTorch chunk form; solver "exact" runs the chunk backend's code in
checkpointed blocks.

CG's vectors, the states and x are float32 whatever the input dtype: CG needs them more accurately than bf16
holds them. The products carry the inputs' precision: IEEE float32 dots for float32 inputs, tf32 tensor-core dots
(10 mantissa bits, three more than bf16's) for bf16/fp16 inputs, except the fused solve's with bf16 inputs, whose
operands are rounded to bf16 as FLA does (the launch setting ``cg_dots="tf32"`` keeps tf32 there too:
triton_cg.py). IEEE float32 dots run on the CUDA cores and their tiles spill registers at K=128: on an H100 a bf16
MesaNet layer's cg16 forward and backward took 1,507 ms with them at B=8, T=2048, H=8, K=128 with the per-step form
(one output-kernel call 41 ms), and 18.9 ms with tf32 dots.
float64 inputs take simple_gla's PyTorch chunk form instead (Triton has no float64 dots), the same algorithm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.checks import CHUNK_SIZES, compute_dtype
from ..common.triton_ops import traced
from ..simple_gla.triton import (
    simple_gla_triton_backward,
    simple_gla_triton_forward,
    simple_gla_triton_read,
    simple_gla_triton_states,
)
from .composed import TorchScan, mesa_net_composed, solve_by_reader
from .reference import MesaState
from .solve import shifted_cg_solve
from .triton_cg import chunk_cg_fits, fused_cg_solve
from .triton_fused import mesa_net_cg_fused


class TritonScan:
    """The scan on simple_gla's Triton kernels (float32 inputs, scale 1). Eagerly the kernels' Python entry points
    are called directly; under torch.compile (or for tensor subclasses) simple_gla's registered custom ops, which
    graphs see as opaque ops with fake kernels."""

    def __init__(self, chunk_size: int, precision: str | None = None) -> None:
        self.chunk_size = chunk_size
        self.precision = precision  # of the dots (None: simple_gla's for float32 inputs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                s0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g = (x.contiguous() for x in (q, k, v, g))
        s0 = None if s0 is None else s0.contiguous()
        if traced(q):
            y, sT, _, _ = torch.ops.linattn.simple_gla_triton_fwd(q, k, v, g, s0, 1.0, self.chunk_size, False)
            return y, sT
        y, sT = simple_gla_triton_forward(q, k, v, g, 1.0, s0, self.chunk_size, precision=self.precision)
        return y, sT

    def reader(self, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               s0: torch.Tensor | None) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The chunk states of k, v, g scanned once; each query then costs one launch of the output kernel."""
        k, v, g = (x.contiguous() for x in (k, v, g))
        s0 = None if s0 is None else s0.contiguous()
        if traced(k):
            return lambda q: self.forward(q, k, v, g, s0)
        states = simple_gla_triton_states(k, v, g, s0, self.chunk_size, precision=self.precision)
        return lambda q: (simple_gla_triton_read(q.contiguous(), k, v, g, 1.0, states), states.final)

    def solve(self, product: Callable[[torch.Tensor], torch.Tensor], lamb: torch.Tensor, b: torch.Tensor,
              steps: int) -> torch.Tensor:
        """CG over any product, one fused kernel per step (triton_cg.py); under torch.compile cg_solve's traceable
        steps. The composed backend solves through :meth:`solve_system` instead."""
        if traced(b):
            return shifted_cg_solve(product, lamb, b, steps)
        return fused_cg_solve(product, lamb, b.contiguous(), steps)

    def solve_system(self, k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, s0: torch.Tensor | None,
                     lamb: torch.Tensor, b: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step by step: one read of the scan and one fused update kernel per CG step (:func:`solve_by_reader`).
        mesa_net's triton backend solves on its own kernels at head dims up to 128 (triton_fused.py), so this
        serves the head dims above 128."""
        return solve_by_reader(self, k, w, g, s0, lamb, b, steps)

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, s0: torch.Tensor | None,
                 dy: torch.Tensor, dST: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        q, k, v, g, dy = (x.contiguous() for x in (q, k, v, g, dy))
        s0, dST = (None if x is None else x.contiguous() for x in (s0, dST))
        if traced(q):
            return torch.ops.linattn.simple_gla_triton_bwd(q, k, v, g, s0, 1.0, self.chunk_size, dy, dST, None, None)
        return simple_gla_triton_backward(q, k, v, g, 1.0, s0, self.chunk_size, dy, dST, precision=self.precision)


def mesa_net_triton(
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
) -> tuple[torch.Tensor, MesaState | None]:
    """backend='triton': G_t = exp(g_t) G_{t-1} + b_t k_t k_t^T, H_t = exp(g_t) H_{t-1} + b_t k_t v_t^T,
    o_t = H_t^T (G_t + diag(lamb))^-1 (scale q_t) in memory O(T (K + V)) per head (module docstring: solver "cg" at
    head dims up to 128 on triton_fused.py's kernels, else composed.py's algorithm); inputs validated by the public
    op; chunk_size 16, 32, 64 or 128."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be 16, 32, 64 or 128 for backend='triton', got {chunk_size}")
    if solver == "cg" and compute_dtype(q) != torch.float64 and chunk_cg_fits(q.shape[-1]):
        return mesa_net_cg_fused(q, k, v, g, beta, lamb, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, chunk_size=chunk_size, cg_steps=cg_steps)
    if compute_dtype(q) == torch.float64:
        scan: TorchScan | TritonScan = TorchScan(chunk_size)
    else:
        scan = TritonScan(chunk_size, precision=None if q.dtype == torch.float32 else "tf32")
    return mesa_net_composed(q, k, v, g, beta, lamb, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, chunk_size=chunk_size, solver=solver,
                             cg_steps=cg_steps, scan=scan)


TRITON_BACKENDS = {"mesa_net": mesa_net_triton}
