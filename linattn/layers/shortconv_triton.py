"""Triton kernels for ShortConv's causal depthwise convolution (``ShortConv.backend = "triton"``).

With xp = [cache; x] the padded input ([B, W-1+T, D]; zeros for a missing cache) and W taps:

    z_s = sum_{i=0}^{W-1} w_i ⊙ xp_{s+i} (+ bias),        y_s = act(z_s)        (s = 0..T-1)

Backward, with dz_s = dy_s ⊙ act'(z_s) (z recomputed from x, never stored; SiLU'(z) = sig(z) (1 + z (1 - sig(z)))):

    dxp_p = sum_i w_i ⊙ dz_{p-i}     (p = 0..W-2+T: rows p < W-1 are the cache's gradient, the rest x's)
    dw_i  = sum_{b,s} dz_s ⊙ xp_{s+i},        dbias = sum_{b,s} dz_s

Forward: a program per (time block, channel block, batch) sums W shifted [BT, BD] tiles (re-reads hit the
cache), adds the bias and applies SiLU in registers: x is read once and y written once from memory.
Backward: two kernels. The first, a program per (run of time blocks, channel block, batch), recomputes z once per
row, stores dz and accumulates per-program float32 partial sums of dw and dbias from the same xp tiles,
which PyTorch adds (deterministic). The second sums W shifted dz tiles into dx and the cache's gradient. (Computing
dxp in one pass would need dz at W shifted row sets, i.e. z recomputed W times from W^2 tile loads: on an H100 that
took 0.25 ms for [8, 2048, 1024] bf16, several times the cost of the memory traffic.)
dz is stored in the input's dtype for bf16/fp16 inputs (float32 otherwise); all other arithmetic is float32.
Streams: one launch of each kernel may cover up to three streams of adjacent channels of x (q, k and v of a joint
projection, shortconv_joint.py), each with its own output and output gradient tensor (no block straddles two);
dx may be written into the columns of a wider tensor.
Packed sequences (B = 1, no cache): ``pos`` [T] gives each row's position inside its own sequence, and a tap that
would reach back past the sequence's start (lag W-1-i > pos_s) reads zero instead, in all three kernels, so no
document reads another and the result equals convolving each alone (the gradients likewise stay inside each
document) with no copy into a gapped layout. Both are torch ops (``linattn::short_conv_fwd`` /
``_bwd``) with autograd for torch.compile, and run eagerly through a plain autograd Function (less host time).
Runs on CUDA tensors, or on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..ops.common.registered_ops import define_op
from ..ops.common.triton_compat import patch_interpreter
from ..ops.common.triton_launch import fast_launch
from ..ops.common.triton_ops import eager_backward, op_function
from ..ops.common.triton_utils import cdiv, next_power_of_2

patch_interpreter()

# Launch settings (depend on nothing but these; T is not specialised, so a new length reuses the kernels): "fwd" the
# forward kernel, "bwd" the backward's dz kernel, "dx" its dx kernel. Timed on an H200 over a layer's joint q, k, v
# ([8, 2048, 3 x 1024] bf16, columns of a wider projection, W=4): the forward 0.083 ms with 16 x 128 tiles at 4 warps
# (0.080 at best over tiles of 8-64 rows, 64-256 channels, 2-8 warps); the dz kernel 0.164 ms with 16 x 64 tiles at
# one warp against 0.213 with the H100's earlier 32 x 64 at 2 warps; the dx kernel 0.062 ms with 16 x 128 at 4 warps
# (0.068 at 32 x 64, 2 warps).
LAUNCH = {"fwd_BT": 16, "fwd_BD": 128, "bwd_BT": 16, "bwd_BD": 64, "dx_BT": 16, "dx_BD": 128, "fwd_warps": 4,
          "bwd_warps": 1, "dx_warps": 4, "bwd_programs": 1024, "bwd_max_blocks": 16}


@triton.jit
def _load_xp(x, cache, i_b, p, o_d, m_d, T, D, sx_b, sx_t, W: tl.constexpr, HAS_CACHE: tl.constexpr):
    """Rows p of the padded input xp = [cache; x] as a float32 [len(p), BD] tile (zeros outside)."""
    s = p - (W - 1)
    m_x = (s >= 0) & (s < T)
    val = tl.load(x + i_b * sx_b + s[:, None] * sx_t + o_d[None, :], mask=m_x[:, None] & m_d[None, :],
                  other=0.0).to(tl.float32)
    if HAS_CACHE:
        m_c = (p >= 0) & (p < W - 1)
        val += tl.load(cache + (i_b * (W - 1) + p)[:, None] * D + o_d[None, :], mask=m_c[:, None] & m_d[None, :],
                       other=0.0).to(tl.float32)
    return val


@triton.jit
def _tap_xp(x, cache, pos_s, i_b, s, i, o_d, m_d, T, D, sx_b, sx_t, W: tl.constexpr, HAS_CACHE: tl.constexpr,
            PACKED: tl.constexpr):
    """What tap i of output rows s reads, xp_{s+i} (float32 [len(s), BD]); PACKED: zero where the tap's lag W-1-i
    reaches back past the start of the row's own sequence (pos_s: the rows' positions inside their sequences)."""
    val = _load_xp(x, cache, i_b, s + i, o_d, m_d, T, D, sx_b, sx_t, W, HAS_CACHE)
    if PACKED:
        val = tl.where((pos_s >= W - 1 - i)[:, None], val, 0.0)
    return val


@triton.jit
def _positions(pos, s, T, PACKED: tl.constexpr):
    """The positions of rows s inside their own sequences (PACKED; else zeros, never read)."""
    if PACKED:
        return tl.load(pos + s, mask=(s >= 0) & (s < T), other=0)
    else:
        return tl.zeros([s.shape[0]], dtype=tl.int32)


@triton.jit
def _preact(x, cache, w, bias, pos_s, i_b, s, o_d, m_d, T, D, sx_b, sx_t, W: tl.constexpr, HAS_CACHE: tl.constexpr,
            HAS_BIAS: tl.constexpr, PACKED: tl.constexpr):
    """z at output rows s: sum_i w_i xp_{s+i} (+ bias), float32 (PACKED: taps within the rows' own sequences)."""
    z = tl.zeros([s.shape[0], o_d.shape[0]], dtype=tl.float32)
    for i in tl.static_range(W):
        w_i = tl.load(w + o_d * W + i, mask=m_d, other=0.0).to(tl.float32)
        z += _tap_xp(x, cache, pos_s, i_b, s, i, o_d, m_d, T, D, sx_b, sx_t, W, HAS_CACHE, PACKED) * w_i[None, :]
    if HAS_BIAS:
        z += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def _stream_at(c0, E0, E1, D, p0, p1, p2):
    """Where channel c0 lies among up to three streams of channels [0, E0), [E0, E1), [E1, D): (the stream's
    tensor, its first channel, its width). One stream: E0 = E1 = D."""
    if c0 < E0:
        p, first, width = p0, 0, E0
    elif c0 < E1:
        p, first, width = p1, E0, E1 - E0
    else:
        p, first, width = p2, E1, D - E1
    return p, first, width


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _conv_fwd_kernel(x, cache, w, bias, pos, y0, y1, y2, T, D, E0, E1, sx_b, sx_t, W: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                     PACKED: tl.constexpr):
    """Grid (cdiv(T, BT), cdiv(D, BD), B): y[b, s] for one block of rows s and channels, written to the output of
    the channels' stream (y0, y1, y2: [B, T, width] each; no block straddles two streams)."""
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    s = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    z = _preact(x, cache, w, bias, _positions(pos, s, T, PACKED), i_b, s, o_d, m_d, T, D, sx_b, sx_t, W, HAS_CACHE,
                HAS_BIAS, PACKED)
    if SILU:
        z = z * tl.sigmoid(z)
    y, first, width = _stream_at(i_d * BD, E0, E1, D, y0, y1, y2)
    tl.store(y + (i_b * T + s)[:, None] * width + (o_d - first)[None, :], z.to(y.dtype.element_ty),
             mask=(s < T)[:, None] & m_d[None, :])


@fast_launch
@triton.jit(do_not_specialize=["T", "NP", "NB"])
def _conv_dz_kernel(x, cache, w, bias, pos, dy0, dy1, dy2, dz, dw_part, db_part, T, D, E0, E1, sx_b, sx_t, NP, NB,
                    W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_CACHE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PACKED: tl.constexpr):
    """Grid (NP = cdiv(T, NB * BT), cdiv(D, BD), B): dz = dy ⊙ act'(z) (z recomputed; dy read from the gradient of
    the channels' stream, dy0, dy1, dy2 as the forward's y0, y1, y2) for NB consecutive blocks of BT output rows s,
    stored in dz's dtype, and this program's float32 partial sums of dw_i = sum_s dz_s xp_{s+i} and dbias,
    accumulated in registers (the xp tiles are the ones z was computed from, re-read from the cache)."""
    i_p, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    dy, first, width = _stream_at(i_d * BD, E0, E1, D, dy0, dy1, dy2)
    o_w = tl.arange(0, BW)
    dw_acc = tl.zeros([BW, BD], dtype=tl.float32)
    db_acc = tl.zeros([BD], dtype=tl.float32)
    for j in range(NB):
        s = (i_p * NB + j) * BT + tl.arange(0, BT)
        m_s = s < T
        g = tl.load(dy + (i_b * T + s)[:, None] * width + (o_d - first)[None, :], mask=m_s[:, None] & m_d[None, :],
                    other=0.0).to(tl.float32)
        pos_s = _positions(pos, s, T, PACKED)
        if SILU:
            z = _preact(x, cache, w, bias, pos_s, i_b, s, o_d, m_d, T, D, sx_b, sx_t, W, HAS_CACHE, HAS_BIAS, PACKED)
            sig = tl.sigmoid(z)
            g = g * sig * (1.0 + z * (1.0 - sig))
        tl.store(dz + (i_b * T + s)[:, None] * D + o_d[None, :], g.to(dz.dtype.element_ty),
                 mask=m_s[:, None] & m_d[None, :])
        for i in tl.static_range(W):
            xp_i = _tap_xp(x, cache, pos_s, i_b, s, i, o_d, m_d, T, D, sx_b, sx_t, W, HAS_CACHE, PACKED)
            dw_acc += tl.where(o_w[:, None] == i, tl.sum(g * xp_i, axis=0)[None, :], 0.0)
        db_acc += tl.sum(g, axis=0)
    part = i_b * NP + i_p
    tl.store(dw_part + (part * W + o_w[:, None]) * D + o_d[None, :], dw_acc, mask=(o_w[:, None] < W) & m_d[None, :])
    if HAS_BIAS:
        tl.store(db_part + part * D + o_d, db_acc, mask=m_d)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _conv_dx_kernel(w, dz, pos, dx, dcache, T, D, sdx_b, sdx_t, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                    HAS_CACHE: tl.constexpr, PACKED: tl.constexpr):
    """Grid (cdiv(T + W - 1, BT), cdiv(D, BD), B): dxp_p = sum_i w_i ⊙ dz_{p-i} (float32) for one block of padded
    rows p, written to dx (rows p >= W - 1; batch and time strides sdx_b, sdx_t: it may be the columns of a wider
    gradient) and to the cache's gradient (rows p < W - 1). PACKED: output row s = p - i contributes only when its
    tap i stays inside its own sequence (pos_s >= W-1-i), as in the forward pass."""
    i_p, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p = i_p * BT + tl.arange(0, BT)
    dxp = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(W):
        s = p - i
        m_s = (s >= 0) & (s < T)
        if PACKED:
            m_s = m_s & (_positions(pos, s, T, PACKED) >= W - 1 - i)
        w_i = tl.load(w + o_d * W + i, mask=m_d, other=0.0).to(tl.float32)
        dxp += tl.load(dz + (i_b * T + s)[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                       other=0.0).to(tl.float32) * w_i[None, :]
    s = p - (W - 1)
    tl.store(dx + i_b * sdx_b + s[:, None] * sdx_t + o_d[None, :], dxp.to(dx.dtype.element_ty),
             mask=((s >= 0) & (s < T))[:, None] & m_d[None, :])
    if HAS_CACHE:
        tl.store(dcache + (i_b * (W - 1) + p)[:, None] * D + o_d[None, :], dxp.to(dcache.dtype.element_ty),
                 mask=(p < W - 1)[:, None] & m_d[None, :])


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] with unit channel stride (batch and time strides are passed to the kernels)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _has_cache(cache: torch.Tensor | None) -> bool:
    return cache is not None and cache.shape[1] > 0


def _blocks(widths: list[int], phase: str) -> tuple[int, int]:
    """(rows, channels) of a tile of the ``phase`` ("fwd", "bwd" or "dx") kernels over streams of these widths: as many
    channels as LAUNCH gives, fewer where that keeps a block inside one stream."""
    BD = min(LAUNCH[f"{phase}_BD"], max(16, next_power_of_2(sum(widths))))
    while len(widths) > 1 and BD > 16 and any(d % BD for d in widths[:-1]):
        BD //= 2
    return LAUNCH[f"{phase}_BT"], BD


def stream_groups(widths: list[int], phase: str) -> list[tuple[int, list[int]]]:
    """The launches that cover streams of these widths (adjacent channels of one input): (first channel, widths)
    of up to three streams each, whose blocks of the ``phase`` kernels never straddle two streams; a stream of a
    width no block size of 16 or more divides gets a launch of its own."""
    groups, first, i = [], 0, 0
    while i < len(widths):
        group = widths[i:i + 3]
        while len(group) > 1 and any(d % 16 for d in group[:-1]):
            group = group[:-1]
        groups.append((first, group))
        first += sum(group)
        i += len(group)
    return groups


def _ends(widths: list[int]) -> tuple[int, int]:
    """The stream ends E0, E1 the kernels take (streams [0, E0), [E0, E1), [E1, D))."""
    ends = [sum(widths[:i + 1]) for i in range(len(widths))] + [sum(widths)] * 2
    return ends[0], ends[1]


def _check_packed(x: torch.Tensor, cache: torch.Tensor | None, pos: torch.Tensor | None) -> None:
    """Packed rows (``pos`` given) come as one batch row [1, T, D] with no cache (every sequence starts from zeros);
    ``pos`` holds an int position per row."""
    if pos is None:
        return
    if x.shape[0] != 1 or _has_cache(cache):
        raise ValueError(f"packed ShortConv kernels take x [1, T, D] and no cache, got x {list(x.shape)} and "
                         f"cache {None if cache is None else list(cache.shape)}")
    if pos.numel() != x.shape[1] or pos.is_floating_point():
        raise ValueError(f"pos must hold one integer position per row of x ({x.shape[1]}), got {list(pos.shape)} "
                         f"{pos.dtype}")


def conv_streams_fwd(x: torch.Tensor, cache: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                     silu: bool, widths: list[int], pos: torch.Tensor | None = None) -> list[torch.Tensor]:
    """y = act(conv(x)) of x [B, T, D] (unit channel stride) as one tensor [B, T, width] per stream of adjacent
    channels (``widths`` sum to D); weight [D, W], bias [D] or None, cache [B, W-1, D] or None. ``pos`` (packed
    sequences: x [1, T, D], no cache): each row's position inside its own sequence, contiguous [T] or [1, T]."""
    B, T, D = x.shape
    W = weight.shape[1]
    has_cache = _has_cache(cache)
    if has_cache and len(widths) > 1:
        raise ValueError(f"a ShortConv cache goes with one stream, got {len(widths)}")
    _check_packed(x, cache, pos)
    outs = [torch.empty(B, T, d, device=x.device, dtype=x.dtype) for d in widths]
    i = 0
    for first, group in stream_groups(widths, "fwd"):
        n = sum(group)
        xs = x if n == D else x[..., first:first + n]
        ys = outs[i:i + len(group)]
        ys += [ys[0]] * (3 - len(ys))
        E0, E1 = _ends(group)
        BT, BD = _blocks(group, "fwd")
        _conv_fwd_kernel[(cdiv(T, BT), cdiv(n, BD), B)](
            x=xs, cache=cache if has_cache else xs,
            w=weight[first:first + n], bias=bias[first:first + n] if bias is not None else weight,
            pos=weight if pos is None else pos, y0=ys[0], y1=ys[1], y2=ys[2], T=T, D=n, E0=E0, E1=E1,
            sx_b=x.stride(0), sx_t=x.stride(1), W=W, BT=BT, BD=BD, HAS_CACHE=has_cache, HAS_BIAS=bias is not None,
            SILU=silu, PACKED=pos is not None, num_warps=LAUNCH["fwd_warps"])
        i += len(group)
    return outs


def _conv_fwd(x: torch.Tensor, cache: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
              silu: bool, pos: torch.Tensor | None = None) -> torch.Tensor:
    return conv_streams_fwd(rows_contiguous(x), cache, weight, bias, silu, [x.shape[-1]], pos)[0]


def _short_conv_fwd_fake(x, cache, weight, bias, silu, pos=None):
    return x.new_empty(x.shape)


_short_conv_fwd = define_op("short_conv_fwd", _conv_fwd, _short_conv_fwd_fake)


def conv_streams_bwd(x: torch.Tensor, cache: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                     silu: bool, dys: list[torch.Tensor], dx: torch.Tensor | None = None,
                     pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`conv_streams_fwd` given the gradients ``dys`` of its outputs (one per stream,
    [B, T, width]): (dx, d_cache ([B, 0, D] without a cache), d_weight [D, W], d_bias ([D] zeros without a bias)).
    ``dx``: a [B, T, D] tensor with unit channel stride (e.g. columns of a wider gradient) to write dx into;
    ``pos``: the forward's packed positions."""
    B, T, D = x.shape
    W = weight.shape[1]
    has_cache = _has_cache(cache)
    _check_packed(x, cache, pos)
    widths = [g.shape[-1] for g in dys]
    dys = [g.contiguous() for g in dys]
    dx = torch.empty(B, T, D, device=x.device, dtype=x.dtype) if dx is None else dx
    dcache = torch.empty(B, W - 1 if has_cache else 0, D, device=x.device,
                         dtype=x.dtype if cache is None else cache.dtype)
    if has_cache and len(widths) > 1:
        raise ValueError(f"a ShortConv cache goes with one stream, got {len(widths)}")
    dw_parts, db_parts, i = [], [], 0
    for first, group in stream_groups(widths, "bwd"):
        n = sum(group)
        sl = slice(first, first + n)
        xs, dxs = (x, dx) if n == D else (x[..., sl], dx[..., sl])
        # dz in the input's dtype for bf16/fp16 (half the bytes written and read back; dw is summed from the
        # float32 values in registers), float32 otherwise
        dz = torch.empty(B, T, n, device=x.device, dtype=torch.float32 if x.dtype == torch.float64 else x.dtype)
        gs = dys[i:i + len(group)]
        gs += [gs[0]] * (3 - len(gs))
        E0, E1 = _ends(group)
        BT, BD = _blocks(group, "bwd")
        # each program of the dz kernel walks NB row blocks, so the float32 partial sums of dw stay small next to x
        # (<= 1/16 of the blocks for long inputs) while about LAUNCH["bwd_programs"] programs keep the GPU busy
        blocks = cdiv(T, BT)
        NB = max(1, min(LAUNCH["bwd_max_blocks"], blocks * cdiv(n, BD) * B // LAUNCH["bwd_programs"]))
        NP = cdiv(blocks, NB)
        dw_part = torch.empty(B, NP, W, n, device=x.device, dtype=torch.float32)
        db_part = torch.empty(B, NP, n if bias is not None else 0, device=x.device, dtype=torch.float32)
        _conv_dz_kernel[(NP, cdiv(n, BD), B)](
            x=xs, cache=cache if has_cache else xs, w=weight[sl], bias=bias[sl] if bias is not None else weight,
            pos=weight if pos is None else pos, dy0=gs[0], dy1=gs[1], dy2=gs[2], dz=dz, dw_part=dw_part,
            db_part=db_part if bias is not None else dw_part,
            T=T, D=n, E0=E0, E1=E1, sx_b=x.stride(0), sx_t=x.stride(1), NP=NP, NB=NB, W=W, BW=next_power_of_2(W),
            BT=BT, BD=BD, HAS_CACHE=has_cache, HAS_BIAS=bias is not None, SILU=silu, PACKED=pos is not None,
            num_warps=LAUNCH["bwd_warps"])
        BTX, BDX = _blocks(group, "dx")
        _conv_dx_kernel[(cdiv(T + W - 1, BTX), cdiv(n, BDX), B)](
            w=weight[sl], dz=dz, pos=weight if pos is None else pos, dx=dxs, dcache=dcache if has_cache else dxs,
            T=T, D=n, sdx_b=dx.stride(0), sdx_t=dx.stride(1), W=W, BT=BTX, BD=BDX, HAS_CACHE=has_cache,
            PACKED=pos is not None, num_warps=LAUNCH["dx_warps"])
        dw_parts.append(dw_part.sum((0, 1)))
        db_parts.append(db_part.sum((0, 1)))
        i += len(group)
    dw = (dw_parts[0] if len(dw_parts) == 1 else torch.cat(dw_parts, 1)).transpose(0, 1).contiguous()
    db = db_parts[0] if len(db_parts) == 1 else torch.cat(db_parts)
    return dx, dcache, dw.to(weight.dtype), db.to(weight.dtype if bias is None else bias.dtype)


def _conv_bwd(x: torch.Tensor, cache: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
              silu: bool, dy: torch.Tensor, pos: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d_cache ([B, 0, D] without a cache), d_weight [D, W], d_bias ([D] zeros without a bias))."""
    return conv_streams_bwd(rows_contiguous(x), cache, weight, bias, silu, [dy], pos=pos)


def _short_conv_bwd_fake(x, cache, weight, bias, silu, dy, pos=None):
    B, T, D = x.shape
    W = weight.shape[1]
    has_cache = cache is not None and cache.shape[1] > 0
    dcache = x.new_empty(B, W - 1 if has_cache else 0, D, dtype=x.dtype if cache is None else cache.dtype)
    db = weight.new_empty(D if bias is not None else 0, dtype=weight.dtype if bias is None else bias.dtype)
    return x.new_empty(x.shape), dcache, weight.new_empty(weight.shape), db


_short_conv_bwd = define_op("short_conv_bwd", _conv_bwd, _short_conv_bwd_fake)


def _setup_context(ctx, inputs, output):
    x, cache, weight, bias, silu, pos = inputs
    ctx.save_for_backward(x, cache, weight, bias, pos)
    ctx.silu = silu


def _backward(ctx, dy):
    x, cache, weight, bias, pos = ctx.saved_tensors
    run_bwd = _conv_bwd if eager_backward(ctx) else _short_conv_bwd
    dx, dcache, dw, db = run_bwd(x, cache, weight, bias, ctx.silu, torch.zeros_like(x) if dy is None else dy, pos)
    return dx, (dcache if cache is not None else None), dw, (db if bias is not None else None), None, None


_differentiable = op_function("ShortConvTriton", _conv_fwd, _short_conv_fwd, _setup_context, _backward)


def causal_conv_triton(x: torch.Tensor, cache: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                       silu: bool, pos: torch.Tensor | None = None) -> torch.Tensor:
    """y = act(sum_i w_i ⊙ xp_{s+i} + bias), xp = [cache; x] (module docstring), differentiable in x, cache,
    weight and bias. x [B, T, D] (unit channel stride preferred), cache [B, W-1, D] or None (zeros),
    weight [D, W], bias [D] or None; silu applies SiLU; ``pos`` (packed sequences, x [1, T, D], no cache): each
    row's position inside its own sequence ([T] or [1, T] integers; each sequence is convolved alone). Inputs are
    checked by ShortConv. Returns y [B, T, D] in x's dtype."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"ShortConv backend 'triton' needs CUDA tensors, got x on {x.device} "
                         "(set TRITON_INTERPRET=1 to run the kernels on the CPU)")
    cache = None if cache is None else cache.contiguous()
    pos = None if pos is None else pos.contiguous()
    return _differentiable(x, cache, weight.contiguous(), bias, bool(silu), pos)
