"""backend="triton" for path_attn: the per-chunk UT transform, then the flash pass.

    logit_ts = scale (q_t^T H_t .. H_{s+1} k_s + G_t - G_s),   o_t = sum_{s<=t} softmax_s(logit_t.) v_s

Per chunk of C positions (as ``chunk.py``): [T_w | T_k] = (I + L)^-1 diag(b) [W | tril(W K^T, -1)], the queries
moved to the chunk start Q^ = Q - tril(Q W^T) T_w, the intra-chunk logits, the chunk's product P = I - W^T T_w and
its keys moved to the chunk end K^ = K - T_k^T W: O(T C K) work and memory, in the Triton kernels of
``ut_kernels.py`` (``ut_triton.py``; float64 inputs: ``chunk.ut_transform`` in PyTorch, differentiated by autograd,
in a training call under a checkpoint). The cross-chunk attention, O(T^2 (K + K^2 / C)), runs in the kernels of
``triton_kernels.py`` (forward: the flash pass with the query chain in registers; backward chunk by chunk: a
bounded number of programs with a scratch for one query block's chain each) and, from ``split_from`` chunks on,
in splits of chunks that a query crosses whole (``splits.py``, ``split_keys_kernels.py``; the backward in
``split_backward_kernels.py``). Memory linear in T in training. Both are ops registered
with torch.library, with fake kernels (torch.compile(fullgraph=True) traces them), differentiated by autograd
Functions that call them directly in eager mode.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..common.checks import compute_dtype
from ..common.chunking import chunk_local_cumsum, pad_time
from ..common.kv_cache import KVCache
from ..common.registered_ops import define_op
from ..common.triton_ops import eager_backward, op_function
from ..common.triton_utils import (
    block,
    cdiv,
    dot_precision,
    interpreting,
    launch_choice,
    launch_options,
    launch_overrides,
    upcast_dots,
)
from ..forgetting_attn.triton import KERNEL_DTYPES, MAX_HEAD_DIM
from ..forgetting_attn.triton_kernels import fox_delta_kernel
from .chunk import UTTransform, _final_state, ut_transform
from .reference import _past
from .split_backward_kernels import (
    path_split_down_kernel,
    path_split_frames_kernel,
    path_split_keys_kernel,
    path_split_up_kernel,
)
from .splits import keys_to_split_end, split_keys_backward, split_size
from .triton_kernels import path_bwd_kernel, path_fwd_kernel
from .ut_triton import ut_transform_triton

# "C": the chunk of the UT transform, and the key block of the flash pass; "fwd_chunks": chunks of queries per
# forward program (1 or 2); "split": chunks per split, a power of two or "sqrt" (splits.py: an earlier split is
# crossed with one product, its key blocks read as in flash attention; "sqrt": the largest power of two at most
# sqrt(2 chunks)), used from "split_from" chunks on (shorter passes step chunk by chunk, as split 1 does); the split
# backward's launch groups are "bwd_split" (its chain kernels) and "bwd_flash" (its key- and frame-parallel
# kernels), "split_keys" the kernels that move keys to their split's end; "BN": cached keys per step; "programs":
# chunk-by-chunk backward programs (0: one per SM on CUDA). LINATTN_TRITON_LAUNCH='{"path_attn": {...}}' overrides
# them. Timed on an H200 (bf16, B 4, H 16, K = V = 128, forward and backward, ms; docs/benchmarks.md), each row of
# the first call after its first changing one setting of it:
#
#   T                                               4096     8192    16384
#   splits of 8, forward at 2 stages (then)        13.74    38.81      -
#   forward at 1 stage                             13.54    38.45      -
#   splits of 16                                   13.73    36.47      -
#   key- and frame-parallel kernels at 1 stage     14.06    40.20      -
#   chain kernels at 4 warps                       14.44    40.22      -
#   FLA's parallel_path_attn                       14.00    38.33      -
#   the defaults below (a second call)             13.99    36.33   109.36
#   splits of 32                                   15.55    38.56   109.54
#   FLA's parallel_path_attn                       14.37    38.70   121.11
#
# One chunk of queries per forward program took 3.55 / 10.88 / 37.08 ms of forward at T 4096 / 8192 / 16384 against
# 2.82 / 7.88 / 24.77 with two. A model at T 2048 (32 chunks, `linattn bench model`, 8 x 2048) ran 0.48x softmax
# attention's tokens/s with splits of 8 against 0.56x without while the keys moved to their split's end in PyTorch;
# with the move's kernels, 0.70x with splits of 8 against 0.60x without (a process each), hence splits from 32 chunks.
LAUNCH = {"C": 64, "split": "sqrt", "split_from": 32, "BN": 64, "programs": 0, "fwd_chunks": 2, "fwd_warps": 8,
          "fwd_stages": 1, "bwd_warps": 8, "bwd_stages": 1, "bwd_split_warps": 8, "bwd_split_stages": 2,
          "bwd_flash_warps": 4, "bwd_flash_stages": 2, "split_keys_warps": 8, "split_keys_stages": 1}
launch_overrides("path_attn", LAUNCH)


def _programs(device: torch.device, work: int) -> int:
    if LAUNCH["programs"]:
        return min(LAUNCH["programs"], work)
    if interpreting() or device.type != "cuda":
        return min(3, work)
    # one per SM: at 255 registers and 8 warps no second program fits on an SM, and more would only add scratch
    return min(torch.cuda.get_device_properties(device).multi_processor_count, work)


def path_flash_forward(qh: torch.Tensor, intra: torch.Tensor, E: torch.Tensor, kh: torch.Tensor, v: torch.Tensor,
                       s0: torch.Tensor, v0: torch.Tensor, G: torch.Tensor, scale: float, split: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, N C, V], base-2 log-sum-exp [B, H, N C]) from qh, kh [B, H, N C, K], intra [B, H, N, C, C] float32,
    E = I - P [B, H, N, K, K] (P the chunks' products), v [B, H, N C, V], the cache s0 [B, H, T0, K],
    v0 [B, H, T0, V], G [B, H, T0 + N C] float64; with ``split`` > 1 the keys are first moved to their split's end
    (splits.py)."""
    B, H, NC, K = qh.shape
    N, C, V, T0 = intra.shape[2], intra.shape[3], v.shape[-1], s0.shape[2]
    ks, Es = (kh, E) if split == 1 else keys_to_split_end(kh, E, split, _split_keys_options(kh))[:2]
    o = qh.new_empty(B, H, NC, V)
    lse = qh.new_empty(B, H, NC, dtype=torch.float32)
    chunks = launch_choice(LAUNCH, "path_attn", "fwd_chunks", (1, 2))
    path_fwd_kernel[(cdiv(N, chunks), B * H)](
        qh=qh, intra=intra, E=E, kh=kh, ks=ks, Es=Es, v=v, s0=s0, v0=v0, G=G, o=o, lse=lse, scale=scale, N=N, T0=T0,
        K=K, V=V, C=C, ROWS=chunks * C, SPLIT=split, BN=LAUNCH["BN"], BK=block(K), BV=block(V),
        PREC=dot_precision(qh.dtype), UP=upcast_dots(qh.dtype), **launch_options(LAUNCH, "fwd", qh.dtype, 1))
    return o, lse


def path_flash_backward(qh: torch.Tensor, intra: torch.Tensor, E: torch.Tensor, kh: torch.Tensor, v: torch.Tensor,
                        s0: torch.Tensor, v0: torch.Tensor, G: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                        do: torch.Tensor, scale: float, split: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, torch.Tensor]:
    """Gradients of qh, intra, E, kh, v, s0, v0 (float32) and G (float64); with ``split`` > 1 the keys are moved to
    their split's end again, and the move's gradient is added to kh's and E's."""
    B, H, NC, K = qh.shape
    N, C, V, T0 = intra.shape[2], intra.shape[3], v.shape[-1], s0.shape[2]
    NS = cdiv(N, split)
    do = do.to(qh.dtype).contiguous()
    delta = qh.new_empty(B * H, 1, NC, dtype=torch.float32)  # [B H, 1, N C]: the [B, T, H, V] kernel with H = 1
    fox_delta_kernel[(cdiv(NC, 64), B * H)](o=o, do=do, delta=delta, Tq=NC, H=1, V=V, BM=64, BV=block(V))
    f32 = dict(device=qh.device, dtype=torch.float32)
    dqh, dintra = torch.empty(B, H, NC, K, **f32), torch.empty(B, H, N, C, C, **f32)
    dkh, dE = (torch.zeros_like(x, dtype=torch.float32) for x in (kh, E))
    dv, ds0, dv0 = torch.zeros(B, H, NC, V, **f32), torch.zeros(B, H, T0, K, **f32), torch.zeros(B, H, T0, V, **f32)
    dG = torch.zeros(B, H, T0 + NC, **f32)
    shapes = dict(K=K, C=C, BK=block(K), PREC=dot_precision(qh.dtype), UP=upcast_dots(qh.dtype))
    if split == 1:
        nprog = _programs(qh.device, N * B * H)
        # the programs' scratch, as the products read it: dS and the query at every key block
        sscr, xq = qh.new_empty(nprog, N, C, C), qh.new_empty(nprog, N, C, block(K))
        path_bwd_kernel[(nprog,)](
            qh=qh, intra=intra, E=E, kh=kh, v=v, s0=s0, v0=v0, G=G, do=do, lse=lse, delta=delta, dqh=dqh,
            dintra=dintra, dE=dE, dkh=dkh, dv=dv, ds0=ds0, dv0=dv0, dG=dG, qscr=xq, sscr=sscr, scale=scale, N=N,
            T0=T0, BH=B * H, NPROG=nprog, BN=LAUNCH["BN"], V=V, BV=block(V), **shapes,
            **launch_options(LAUNCH, "bwd", qh.dtype, 1))
        return dqh, dintra, dE, dkh, dv, ds0, dv0, dG.double()
    move_options = _split_keys_options(kh)
    ks, Es, Rs = keys_to_split_end(kh, E, split, move_options, keep=True)
    dks, dEs = (torch.zeros_like(x, dtype=torch.float32) for x in (ks, Es))
    # one split of query blocks at a time (split_backward_kernels.py); the scratch of each (batch*head, query block
    # of the split), as the products read it: the chain's queries and dS in the own split, the query at every
    # earlier split's end, and the cache's part of dQ
    slots = B * H * split
    qscr, sscr = qh.new_empty(slots, split, C, block(K)), qh.new_empty(slots, split, C, C)
    xq, wscr = qh.new_empty(slots, NS, C, block(K)), torch.empty(slots, C, block(K), **f32)
    dxq = torch.empty(slots, NS, C, block(K), **f32)  # the gradient of each such query from its split's keys
    options = launch_options(LAUNCH, "bwd_split", qh.dtype, 1)
    # the key- and frame-parallel kernels' arguments but the split A
    work = dict(v=v, G=G, do=do, lse=lse, delta=delta, dG=dG, xq=xq, scale=scale, N=N, T0=T0, SPLIT=split, V=V,
                BV=block(V), **shapes, **launch_options(LAUNCH, "bwd_flash", qh.dtype, 1))
    for A in range(NS):
        path_split_down_kernel[(split, B * H)](
            qh=qh, intra=intra, E=E, kh=kh, Es=Es, v=v, s0=s0, v0=v0, G=G, do=do, lse=lse, delta=delta,
            dintra=dintra, dkh=dkh, dv=dv, ds0=ds0, dv0=dv0, dG=dG, qscr=qscr, sscr=sscr, xq=xq, wscr=wscr,
            scale=scale, N=N, T0=T0, A=A, SPLIT=split, BN=LAUNCH["BN"], V=V, BV=block(V), **shapes, **options)
        if A:
            path_split_keys_kernel[(A * split, B * H)](ks=ks, dks=dks, dv=dv, A=A, **work)
            path_split_frames_kernel[(split * A, B * H)](ks=ks, dxq=dxq, A=A, **work)
        path_split_up_kernel[(split, B * H)](
            kh=kh, E=E, Es=Es, dqh=dqh, dE=dE, dEs=dEs, qscr=qscr, sscr=sscr, xq=xq, dxq=dxq, wscr=wscr, scale=scale,
            N=N, A=A, SPLIT=split, **shapes, **options)
    split_keys_backward(kh, E, dks, dEs, Rs, dkh, dE, split, move_options)
    return dqh, dintra, dE, dkh, dv, ds0, dv0, dG.double()


def _split_keys_options(kh: torch.Tensor) -> dict:
    return launch_options(LAUNCH, "split_keys", kh.dtype, 1)


def _fwd_fake(qh, intra, E, kh, v, s0, v0, G, scale, split):
    B, H, NC, _ = qh.shape
    return qh.new_empty(B, H, NC, v.shape[-1]), qh.new_empty(B, H, NC, dtype=torch.float32)


_fwd_op = define_op("path_attn_triton_fwd", path_flash_forward, _fwd_fake)


def _bwd_fake(qh, intra, E, kh, v, s0, v0, G, o, lse, do, scale, split):
    return *(torch.empty_like(x, dtype=torch.float32) for x in (qh, intra, E, kh, v, s0, v0)), torch.empty_like(G)


_bwd_op = define_op("path_attn_triton_bwd", path_flash_backward, _bwd_fake)


def _setup_context(ctx, inputs, output):
    *tensors, scale, split = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.scale, ctx.split = scale, split


def _backward_rule(ctx, do, dlse):
    *tensors, o, lse = ctx.saved_tensors
    run = path_flash_backward if eager_backward(ctx) else _bwd_op
    do = torch.zeros_like(o) if do is None else do
    grads = run(*tensors, o, lse, do, ctx.scale, ctx.split)
    return (*(gr.to(x.dtype) for gr, x in zip(grads, tensors)), None, None)


_path_differentiable = op_function("PathAttnTriton", path_flash_forward, _fwd_op, _setup_context, _backward_rule,
                                   non_differentiable=(1,))


def _kernel_transform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                      g: torch.Tensor, scale: float, C: int, final: bool) -> tuple:
    """The flash pass's chunk inputs (Q^, intra, E, K^, V by chunks; E: the chunk's product is P = I - E) from the UT
    transform's kernels, in the input dtype; with ``final`` also the transform in float32 for the final cache, else
    None."""
    qh, intra, E, kh = ut_transform_triton(q, k, w, beta, g, scale, C, full=final)
    N = intra.shape[2]
    vc = pad_time(v, C).transpose(1, 2)
    ut = None
    if final:
        ut = UTTransform(Qhat=qh, intra=intra, Khat=kh.unflatten(2, (N, C)), E=E,
                         Vc=vc.float().unflatten(2, (N, C)), Gl=chunk_local_cumsum(g.float(), C).permute(0, 3, 1, 2))
    qh, E, kh, vc = (x.to(q.dtype).contiguous() for x in (qh, E, kh, vc))
    return qh, intra, E, kh, vc, ut


def _torch_transform(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                     g: torch.Tensor, scale: float, C: int, final: bool) -> tuple:
    """As :func:`_kernel_transform` for float64 inputs: :func:`chunk.ut_transform` in float64, the flash pass's
    inputs in float32."""
    q, k, v, w, beta, g = (x.double() for x in (q, k, v, w, beta, g))
    B, _, H, _ = q.shape
    flat = lambda x: x.reshape(B, H, -1, x.shape[-1]).float().contiguous()

    def transformed(q, k, v, w, beta, g):
        ut = ut_transform(q, k, v, w, beta, g, scale, C)
        return flat(ut.Qhat), ut.intra.float().contiguous(), ut.E.float().contiguous(), flat(ut.Khat), flat(ut.Vc), ut

    if torch.is_grad_enabled() and not final:
        # the UT transform's intermediates (a dozen [C, K] and [C, C] products per chunk) are recomputed in the
        # backward pass instead of kept: O(T C K) work against the flash pass's O(T^2 K)
        return *checkpoint(lambda *x: transformed(*x)[:5], q, k, v, w, beta, g, use_reentrant=False), None
    return transformed(q, k, v, w, beta, g)


def path_attn_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                     g: torch.Tensor | None = None, *, scale: float, initial_state: KVCache | None = None,
                     output_final_state: bool = False, chunk_size: int = 64) -> tuple[torch.Tensor, KVCache | None]:
    """path_attn through the Triton kernels (inputs validated by :func:`path_attn`; ``chunk_size`` is not used: the
    chunk comes from ``LAUNCH``). The UT transform computes in float32 (float64 for float64 inputs), the flash pass
    in the input dtype (bf16 / fp16 / float32; float64 runs in float32); output in q's dtype, the cache in float32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"backend='triton' takes head dims K, V <= {MAX_HEAD_DIM}, got K = {K}, V = {V}")
    in_dtype, sdt = q.dtype, compute_dtype(q)
    dt = in_dtype if in_dtype in KERNEL_DTYPES else torch.float32
    C = LAUNCH["C"]
    k0, v0, d0 = _past(initial_state, k, V, sdt)
    g = torch.zeros_like(beta) if g is None else g
    chunk_inputs = _kernel_transform if in_dtype in KERNEL_DTYPES else _torch_transform
    qh, intra, E, kh, vc, ut = chunk_inputs(q, k, v, w, beta, g, scale, C, output_final_state)
    S0, V0, D0 = (x.transpose(1, 2) for x in (k0, v0, d0))  # cache [B, H, T0, *]
    G_new = torch.cumsum(pad_time(g, C).transpose(1, 2).to(torch.float64), dim=-1)
    G = torch.cat([-D0.to(torch.float64), G_new], dim=-1).contiguous()  # the cache's end at G = 0
    split = split_size(LAUNCH["split"], intra.shape[2], LAUNCH["split_from"])
    o, _ = _path_differentiable(qh, intra, E, kh, vc, S0.to(dt).contiguous(), V0.to(dt).contiguous(), G,
                                float(scale), split)
    o = o[:, :, :T].transpose(1, 2).to(in_dtype)
    state = None
    if output_final_state:
        Pt = torch.eye(K, dtype=sdt, device=q.device) - ut.E.transpose(-1, -2)  # the chunk's P^T
        state = _final_state(S0, V0, D0, ut.Khat, ut.Vc, Pt, ut.Gl[..., -1], ut.Gl, T)
    return o, state


TRITON_BACKENDS = {"path_attn": path_attn_triton}
