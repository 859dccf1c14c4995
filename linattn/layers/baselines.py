"""Plain-PyTorch baselines for Long Range Arena: a diagonal linear RNN (LRU) and Mamba (selective scan).

Neither has queries, keys or heads: ``short_conv`` may only name "v" (the input stream the recurrence
reads), ``tie_kv`` must be False, and ``n_heads`` is accepted for the common interface only.

Static decoding (static_cache.py): the same forward on one token, with the ShortConv cache shifted in place
and the new recurrent state copied into its buffer.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .cache import LayerCache
from .checks import check_conv_cache, check_layer_input, check_positive_int, check_short_conv, check_static_step_input
from .scan import diagonal_scan, linear_scan
from .shortconv import CONV_MODES, ShortConv
from .static_cache import StaticLayerCache, copy_rows_, state_dtype


def _check_baseline_args(name: str, d_model: int, n_heads: int, short_conv: str, conv_mode: str, tie_kv: bool) -> str:
    check_positive_int("d_model", d_model)
    check_positive_int("n_heads", n_heads)
    if conv_mode not in CONV_MODES:
        raise ValueError(f"conv_mode must be one of {', '.join(map(repr, CONV_MODES))}; got {conv_mode!r}")
    if tie_kv:
        raise ValueError(f"tie_kv=True is not available for {name}: it has no separate keys and values")
    return check_short_conv(short_conv, "v")


class _Baseline(nn.Module):
    """Input ShortConv (letter "v") and the cache bookkeeping shared by the baselines."""

    conv_letters = "v"

    def __init__(self, width: int, short_conv: str, conv_mode: str, conv_kernel: int, conv_activation: str | None):
        super().__init__()
        self.short_conv = short_conv
        self.conv = ShortConv(width, conv_kernel, conv_activation, mode=conv_mode) if short_conv else None

    def conv_input(self, u: torch.Tensor, cache: LayerCache | StaticLayerCache | None) -> tuple[torch.Tensor, dict]:
        if self.conv is None:
            return u, {}
        if isinstance(cache, StaticLayerCache):  # shifted in place
            return self.conv.static_step(u, cache.conv["v"]), {"v": cache.conv["v"]}
        u, c = self.conv(u, None if cache is None else cache.conv.get("v"))
        return u, {"v": c}

    def check_input(self, x: torch.Tensor, cache: LayerCache | StaticLayerCache | None) -> None:
        if isinstance(cache, StaticLayerCache):
            check_static_step_input(x, self.d_model, cache)
        else:
            check_layer_input(x, self.d_model, cache)
            if cache is not None:
                check_conv_cache(cache, () if self.conv is None else ("v",))

    def new_cache(self, new_conv: dict, state: torch.Tensor, cache: LayerCache | StaticLayerCache | None, T: int,
                  use_cache: bool) -> LayerCache | StaticLayerCache | None:
        """The returned cache: a static one gets the new state copied into its buffer (the conv was shifted)."""
        if isinstance(cache, StaticLayerCache):
            cache.state.copy_(state)
            return cache
        offset = 0 if cache is None else cache.offset
        return LayerCache(new_conv, state, offset + T) if use_cache else None

    def static_state(self, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device
                     ) -> torch.Tensor:
        raise NotImplementedError

    def allocate_static_cache(self, batch_size: int, max_length: int, *, dtype: torch.dtype, device: torch.device,
                              pos: torch.Tensor) -> StaticLayerCache:
        """Zeroed buffers (see MixerLayer.allocate_static_cache): the ShortConv cache and the recurrent state."""
        conv = {} if self.conv is None else {
            "v": torch.zeros(batch_size, self.conv.kernel_size - 1, self.conv.dim, dtype=dtype, device=device)}
        return StaticLayerCache(conv, self.static_state(batch_size, max_length, state_dtype(dtype), device), pos)

    def load_static_cache(self, static: StaticLayerCache, cache: LayerCache, rows: torch.Tensor) -> None:
        """Copy a cached path's cache of len(rows) sequences into rows ``rows`` of the buffers."""
        check_conv_cache(cache, static.conv)
        for name, buf in static.conv.items():
            buf.index_copy_(0, rows, cache.conv[name].to(buf.dtype))
        copy_rows_(static.state, cache.state, rows)


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off on ``device_type`` (a device without autocast, e.g. meta, has nothing to turn off)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class LRULayer(_Baseline):
    """Linear Recurrent Unit (Orvieto et al., arXiv 2303.06349), a diagonal complex linear RNN.

    lambda = exp(-exp(nu) + i exp(theta)) [N] (|lambda| uniform in [r_min, r_max] = [0.9, 0.999], phase
    in [0, 2 pi max_phase] at init), gamma = sqrt(1 - |lambda|^2),
        h_t = lambda ⊙ h_{t-1} + gamma ⊙ (B u_t),    y_t = Re(C h_t) + D ⊙ u_t,
    u = ShortConv(x) when short_conv="v" (default: "", none), state size N = ``state_dim`` (d_model).
    The recurrence runs in complex64 (complex128 for float64 input), also under autocast, chunkwise over
    ``chunk_size`` tokens (scan.diagonal_scan: lambda is the same at every step).
    """

    def __init__(self, d_model: int, n_heads: int = 1, *, state_dim: int | None = None, r_min: float = 0.9,
                 r_max: float = 0.999, max_phase: float = 0.1, short_conv: str = "", conv_mode: str = "learned",
                 conv_kernel: int = 4, conv_activation: str | None = "silu", tie_kv: bool = False,
                 chunk_size: int = 32) -> None:
        short_conv = _check_baseline_args("lru", d_model, n_heads, short_conv, conv_mode, tie_kv)
        super().__init__(d_model, short_conv, conv_mode, conv_kernel, conv_activation)
        N = check_positive_int("state_dim", state_dim or d_model)
        self.d_model, self.state_dim = d_model, N
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        u = torch.rand(N)
        self.nu_log = nn.Parameter(torch.log(-0.5 * torch.log(u * (r_max ** 2 - r_min ** 2) + r_min ** 2)))
        self.theta_log = nn.Parameter(torch.log(max_phase * 2 * math.pi * torch.rand(N)))
        self.B_re = nn.Parameter(torch.randn(N, d_model) / math.sqrt(2 * d_model))
        self.B_im = nn.Parameter(torch.randn(N, d_model) / math.sqrt(2 * d_model))
        self.C_re = nn.Parameter(torch.randn(d_model, N) / math.sqrt(N))
        self.C_im = nn.Parameter(torch.randn(d_model, N) / math.sqrt(N))
        self.D = nn.Parameter(torch.randn(d_model))

    def static_state(self, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device
                     ) -> torch.Tensor:
        """h [B, N], complex."""
        complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        return torch.zeros(batch_size, self.state_dim, dtype=complex_dtype, device=device)

    def forward(self, x: torch.Tensor, cache: LayerCache | StaticLayerCache | None = None, *, use_cache: bool = True
                ) -> tuple[torch.Tensor, LayerCache | StaticLayerCache | None]:
        self.check_input(x, cache)
        u, new_conv = self.conv_input(x, cache)
        rdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        # Autocast would run the projections in bf16/fp16, and a complex tensor cannot be built from those halves:
        # the recurrence runs in float32 (complex64) whatever the autocast dtype, the output in x's dtype.
        with _no_autocast(x.device.type):
            log_lam = torch.complex(-torch.exp(self.nu_log.to(rdt)), torch.exp(self.theta_log.to(rdt)))
            gamma = torch.sqrt(1 - torch.exp(2 * log_lam.real))  # sqrt(1 - |lambda|^2)
            ur = u.to(rdt)
            Bu = torch.complex(ur @ self.B_re.to(rdt).T, ur @ self.B_im.to(rdt).T) * gamma
            h0 = None if cache is None else cache.state
            h = diagonal_scan(log_lam, Bu, h0, self.chunk_size)  # [B, T, N]
            y = h.real @ self.C_re.to(rdt).T - h.imag @ self.C_im.to(rdt).T + self.D.to(rdt) * ur
        return y.to(x.dtype), self.new_cache(new_conv, h[:, -1], cache, x.shape[1], use_cache)


def _selective_chunk(dt, xc, Bm, Cm, A, h0):
    """Mamba's recurrence over one chunk: dt, xc [B, C, E]; Bm, Cm [B, C, N]; A [E, N]; h0 [B, E, N].
    Returns (y [B, C, E] without the D skip, h at the chunk's end)."""
    a = torch.exp(dt[..., None] * A)  # [B, C, E, N]
    b = (dt * xc)[..., None] * Bm[:, :, None, :]
    h = linear_scan(a, b, h0)
    return torch.einsum("bten,btn->bte", h, Cm), h[:, -1]


class MambaLayer(_Baseline):
    """Mamba's selective SSM block (Gu & Dao, arXiv 2312.00752) in plain PyTorch.

    [x_in, z] = W_in x (width E = expand * d_model each); u = SiLU(conv(x_in)) (short_conv="v",
    the paper's default; "" for none); dt = softplus(W_dt (W_r u) + dt_bias) [E] (rank ceil(d_model/16));
    B_t, C_t = W_B u_t, W_C u_t [N]; A = -exp(A_log) [E, N] (A_log = log(1..N), S4D-real);
        h_t = exp(dt_t A) ⊙ h_{t-1} + (dt_t u_t) B_t^T,   y_t = h_t C_t + D ⊙ u_t,
    output W_out (y ⊙ SiLU(z)). The scan runs in checkpointed chunks of ``chunk_size`` tokens.
    """

    def __init__(self, d_model: int, n_heads: int = 1, *, state_dim: int = 16, expand: int = 2,
                 dt_rank: int | None = None, chunk_size: int = 64, short_conv: str = "v",
                 conv_mode: str = "learned", conv_kernel: int = 4, conv_activation: str | None = "silu",
                 tie_kv: bool = False) -> None:
        short_conv = _check_baseline_args("mamba", d_model, n_heads, short_conv, conv_mode, tie_kv)
        E = check_positive_int("expand", expand) * d_model
        super().__init__(E, short_conv, conv_mode, conv_kernel, conv_activation)
        N = check_positive_int("state_dim", state_dim)
        R = check_positive_int("dt_rank", dt_rank or math.ceil(d_model / 16))
        self.d_model, self.state_dim, self.chunk_size = d_model, N, check_positive_int("chunk_size", chunk_size)
        self.in_proj = nn.Linear(d_model, 2 * E, bias=False)
        self.x_proj = nn.Linear(E, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, E, bias=False)
        dt = torch.exp(torch.rand(E) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(E, 1))
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, d_model, bias=False)
        self.dt_rank, self.conv_width = R, E

    def static_state(self, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device
                     ) -> torch.Tensor:
        """h [B, E, N]."""
        return torch.zeros(batch_size, self.conv_width, self.state_dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cache: LayerCache | StaticLayerCache | None = None, *, use_cache: bool = True
                ) -> tuple[torch.Tensor, LayerCache | StaticLayerCache | None]:
        self.check_input(x, cache)
        Bsz, T, _ = x.shape
        xin, z = self.in_proj(x).chunk(2, dim=-1)
        u, new_conv = self.conv_input(xin, cache)
        if self.conv is None or self.conv.activation is None:
            u = F.silu(u)  # Mamba's SiLU after the conv; kept without a conv and in the "shift" control
        r, Bm, Cm = self.x_proj(u).split([self.dt_rank, self.state_dim, self.state_dim], dim=-1)
        dt = F.softplus(self.dt_proj(r) + self.dt_bias)
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # the scan runs in float32
        dt, uc, Bm, Cm = (t.to(cdt) for t in (dt, u, Bm, Cm))
        A = -torch.exp(self.A_log.to(cdt))
        h = uc.new_zeros(Bsz, u.shape[-1], self.state_dim) if cache is None else cache.state
        ys = []
        for s in range(0, T, self.chunk_size):
            sl = slice(s, s + self.chunk_size)
            args = (dt[:, sl], uc[:, sl], Bm[:, sl], Cm[:, sl], A, h)
            if torch.is_grad_enabled() and T > self.chunk_size:
                y, h = checkpoint(_selective_chunk, *args, use_reentrant=False)
            else:
                y, h = _selective_chunk(*args)
            ys.append(y)
        y = (torch.cat(ys, dim=1).to(u.dtype) + self.D.to(u.dtype) * u) * F.silu(z)
        return self.out_proj(y), self.new_cache(new_conv, h, cache, T, use_cache)
