"""The short convolution: a causal depthwise conv1d over time with a decoding cache.

    y_t = act( sum_{i=0}^{W-1} w_i ⊙ x_{t-W+1+i} )      (x_s = 0 for s < 0, or the cached inputs)

Modes: "learned" (trainable kernel, default), and two fixed controls for the study:
"shift" outputs exactly x_{t-1} (a pure shift, no activation) and "identity" outputs act(x_t)
(the activation without any mixing over time). The cache holds the last W-1 inputs, so a
T-token call followed by single-token calls equals one call over the whole sequence.

Backends (the setting ``shortconv_backend``: ``linattn.settings(shortconv_backend=...)``,
``LINATTN_SHORTCONV_BACKEND``; or per instance, ``ShortConv.backend``, for a whole model with
:func:`set_shortconv_backend`): "auto" (default; :func:`auto_backend`: the multiply-adds on the CPU,
on CUDA conv1d for small inputs that need gradients and the Triton kernels otherwise), "muladd" (W
shifted multiply-adds), "conv1d" (``F.conv1d`` with groups = D on the channels-first view) and "triton"
(shortconv_triton.py: fused forward and backward kernels; for one token continuing a cache without
autograd, shortconv_step.py's single-launch step; CUDA, or the CPU under TRITON_INTERPRET=1). All compute
the same sum. Measured on the
H100 (bf16, B=4, W=4; docs/benchmarks.md): the Triton kernels are 2.0-9.2x faster than the multiply-adds
forward, and forward+backward 3.9-4.3x at T=16384 (D=2048-4096); at T=2048, D=1024 conv1d was faster
forward+backward (0.80 vs 1.25 ms).

Packed sequences: ``forward(x, cache, cu_seqlens)`` with x [1, T, D] holding N sequences at the offsets
``cu_seqlens`` (linattn/ops/common/varlen.py) convolves each sequence alone: its first W-1 outputs read
zeros (or its own row of ``cache`` [N, W-1, D]), never the previous document; the returned cache is
[N, W-1, D]. The multiply-adds run all sequences at once (each tap gathers from the token's own sequence
or its cache row); conv1d and the Triton kernels run each sequence as a separate call.

Decoding: ``forward(x, cache)`` returns a new cache and leaves ``cache`` as it was; :meth:`ShortConv.static_step`
shifts a preallocated cache in place (the static decoding path, linattn/models/decode.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linattn import switches
from linattn.ops.common.packed_call import device_offsets, kept
from linattn.ops.common.triton_compat import triton_importable
from linattn.ops.common.varlen import check_cu_seqlens, check_packed_batch, sequence_positions

CONV_MODES = ("learned", "shift", "identity")
ACTIVATIONS = ("silu", None)
CONV_BACKENDS = switches.SHORTCONV_BACKENDS


# On the H100 (bf16, W=4; docs/benchmarks.md) F.conv1d beat the Triton kernels forward+backward only for
# the smallest measured input (B*T*D = 8.4M: 0.80 vs 1.25 ms); from 16.8M on, Triton was 1.2-4.3x faster,
# and forward-only always (2.0-9.2x).
CONV1D_MAX_TRAINING_NUMEL = 4 * 2048 * 1024


def auto_backend(x: torch.Tensor, *, on_cuda: bool | None = None) -> str:
    """The backend "auto" picks for input x: multiply-adds on the CPU; on CUDA the Triton kernels for single
    tokens (one launch per decoding step) and large inputs, conv1d for small inputs that need gradients
    (without Triton: multiply-adds for single tokens, conv1d otherwise). ``on_cuda`` (default: x.is_cuda) lets
    tests make CUDA's choices for CPU tensors, the Triton kernels then running in the interpreter."""
    if not (x.is_cuda if on_cuda is None else on_cuda):
        return "muladd"
    if x.shape[1] == 1:
        return "triton" if triton_importable() else "muladd"
    if torch.is_grad_enabled() and x.requires_grad and x.numel() <= CONV1D_MAX_TRAINING_NUMEL:
        return "conv1d"
    return "triton" if triton_importable() else "conv1d"


def fixed_kernel(dim: int, kernel_size: int, mode: str) -> torch.Tensor:
    """The [dim, 1, kernel_size] kernel of the fixed modes: "shift" (x_{t-1}) or "identity" (x_t)."""
    w = torch.zeros(dim, 1, kernel_size)
    w[:, 0, -2 if mode == "shift" else -1] = 1.0  # tap W-1 is x_t, tap W-2 is x_{t-1}
    return w


class ShortConv(nn.Module):
    """Causal depthwise conv1d over ``[B, T, D]`` inputs, kernel ``kernel_size`` (4), SiLU, no bias.

    ``forward(x, cache=None) -> (y, cache)``: ``cache`` is ``None`` (zeros before the start) or the
    ``[B, W-1, D]`` inputs preceding ``x``; the returned cache holds the last W-1 inputs seen.
    ``backend`` ("auto", "muladd", "conv1d", "triton"; module docstring) set on an instance wins over the
    setting ``shortconv_backend``; None (the default) follows the setting.
    """

    backend: str | None = None

    def __init__(self, dim: int, kernel_size: int = 4, activation: str | None = "silu", bias: bool = False,
                 mode: str = "learned") -> None:
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(kernel_size, int) or kernel_size < 1:
            raise ValueError(f"kernel_size must be a positive int, got {kernel_size!r}")
        if mode not in CONV_MODES:
            raise ValueError(f"conv_mode must be one of {', '.join(map(repr, CONV_MODES))}; got {mode!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}; got {activation!r}")
        if mode == "shift" and kernel_size < 2:
            raise ValueError(f"conv_mode='shift' needs kernel_size >= 2, got {kernel_size}")
        self.dim, self.kernel_size, self.mode = dim, kernel_size, mode
        self.activation = None if mode == "shift" else activation
        if mode == "learned":
            self.weight = nn.Parameter(torch.empty(dim, 1, kernel_size))
            nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # nn.Conv1d's default initialisation
            self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        else:
            self.register_buffer("weight", fixed_kernel(dim, kernel_size, mode), persistent=False)
            self.bias = None

    def extra_repr(self) -> str:
        return f"dim={self.dim}, kernel_size={self.kernel_size}, mode={self.mode!r}, activation={self.activation!r}"

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [B, T, D] with D = {self.dim}, got {got}")
        if cu_seqlens is not None:
            return self._packed(x, cache, cu_seqlens)
        B, T, D = x.shape
        W = self.kernel_size
        if cache is not None and tuple(cache.shape) != (B, W - 1, D):
            raise ValueError(f"cache must have shape [B, W-1, D] = [{B}, {W - 1}, {D}], got {list(cache.shape)}")
        backend = self._resolved_backend(x)
        if backend != "muladd":
            return self._forward_backend(x, cache, backend)
        if cache is None:
            cache = x.new_zeros(B, W - 1, D)
        xp = torch.cat([cache.to(x.dtype), x], dim=1)  # [B, W-1+T, D]
        # W shifted multiply-adds: the same sum as a depthwise conv1d, but without conv1d's fixed cost,
        # which on the CPU is tens of milliseconds per call (measured) and dominated step decoding.
        w = self.weight[:, 0].to(x.dtype)  # [D, W]
        y = xp[:, 0:T] * w[:, 0]
        for i in range(1, W):
            y = y + xp[:, i:i + T] * w[:, i]
        return self._bias_activation(y), xp[:, xp.shape[1] - (W - 1):]

    def _bias_activation(self, y: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return F.silu(y) if self.activation == "silu" else y

    def _packed(self, x: torch.Tensor, cache: torch.Tensor | None, cu_seqlens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, T, D] packing N sequences: each convolved alone (cache None or [N, W-1, D]); the new caches
        stacked [N, W-1, D]."""
        check_packed_batch("x", x)
        offsets = check_cu_seqlens(cu_seqlens, x.shape[1], x.device)
        N, W = len(offsets) - 1, self.kernel_size
        if cache is not None and tuple(cache.shape) != (N, W - 1, self.dim):
            raise ValueError(f"cache with cu_seqlens must have shape [N, W-1, D] = [{N}, {W - 1}, {self.dim}] "
                             f"(one row per sequence), got {list(cache.shape)}")
        backend = self._resolved_backend(x)
        if backend == "muladd":
            return self._packed_muladd(x, cache, offsets)
        if backend == "triton" and cache is None:  # the kernels keep every tap inside its row's own sequence
            from .shortconv_triton import causal_conv_triton

            pos = sequence_positions(offsets, x.device, cu_seqlens)
            y = causal_conv_triton(x, None, self.weight[:, 0], self.bias, self.activation == "silu", pos=pos)
            return y, packed_last_inputs(x, offsets, cu_seqlens, self.kernel_size)
        return self._packed_gapped(x, cache, offsets, backend, cu_seqlens)

    def _packed_gapped(self, x: torch.Tensor, cache: torch.Tensor | None, offsets: list[int], backend: str,
                       cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One call of the conv1d or Triton backend over all packed sequences: each sequence is laid out after a
        gap of W-1 positions holding its cache row (zeros without a cache), so no tap reads the previous sequence;
        the outputs are read back at the tokens (index_select: gradients flow to x and the cache)."""
        N, W, T, D = len(offsets) - 1, self.kernel_size, x.shape[1], self.dim
        dev = x.device

        def indices() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            cu = device_offsets(cu_seqlens, offsets, dev)
            starts, lengths = cu[:-1], cu[1:] - cu[:-1]
            seq = torch.repeat_interleave(torch.arange(N, device=dev), lengths, output_size=T)
            pos = torch.arange(T, device=dev) + (seq + 1) * (W - 1)  # token t of sequence n, after n + 1 gaps
            gap = (starts + torch.arange(N, device=dev) * (W - 1))[:, None] + torch.arange(W - 1, device=dev)[None]
            # each sequence's last W-1 positions (reaching into its gap when it is shorter than W-1)
            last = (gap[:, -1:] + 1 + lengths[:, None]) - (W - 1) + torch.arange(W - 1, device=dev)[None]
            return pos, gap.flatten(), last.flatten()

        pos, gap, last = kept(cu_seqlens, ("shortconv_gaps", W, str(dev)), indices)
        xp = x.new_zeros(1, T + N * (W - 1), D).index_copy(1, pos, x)
        if cache is not None:
            xp = xp.index_copy(1, gap, cache.to(x.dtype).reshape(1, N * (W - 1), D))
        y, _ = self._forward_backend(xp, None, backend)
        return y.index_select(1, pos), xp[0].index_select(0, last).view(N, W - 1, D)

    def _packed_muladd(self, x: torch.Tensor, cache: torch.Tensor | None, offsets: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The multiply-adds over all packed sequences at once. Sequence n is read as its own cache row followed by
        its tokens (its "extended" positions e: e < W-1 the cache, e >= W-1 token e - (W-1)); tap i of a token at
        position p in its sequence reads extended position p + i, gathered from [all cache rows; x]."""
        N, W, T, D = len(offsets) - 1, self.kernel_size, x.shape[1], self.dim
        dev = x.device
        starts = torch.tensor(offsets[:-1], device=dev)
        lengths = torch.tensor(offsets[1:], device=dev) - starts
        seq = torch.repeat_interleave(torch.arange(N, device=dev), lengths)  # [T]: each token's sequence
        pos = torch.arange(T, device=dev) - starts[seq]

        def rows(n: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
            return torch.where(e >= W - 1, N * (W - 1) + starts[n] + e - (W - 1), n * (W - 1) + e)

        past = x.new_zeros(N * (W - 1), D) if cache is None else cache.to(x.dtype).reshape(N * (W - 1), D)
        buf = torch.cat([past, x[0]], dim=0)
        w = self.weight[:, 0].to(x.dtype)  # [D, W]
        y = buf[rows(seq, pos)] * w[:, 0]
        for i in range(1, W):
            y = y + buf[rows(seq, pos + i)] * w[:, i]
        last = lengths[:, None] + torch.arange(W - 1, device=dev)[None]  # each sequence's last W-1 extended positions
        return self._bias_activation(y)[None], buf[rows(torch.arange(N, device=dev)[:, None], last)]

    def static_step(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """One token ``x`` [B, 1, D] continuing ``cache`` [B, W-1, D] (a preallocated buffer in x's dtype), which
        is shifted in place to hold the last W-1 inputs; returns y [B, 1, D]. The backend as in :meth:`forward`:
        the Triton step kernel shifts the buffer itself, the other backends' new cache is copied into it."""
        W = self.kernel_size
        if x.dim() != 3 or x.shape[1] != 1 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape [B, 1, D] with D = {self.dim}, got {list(x.shape)}")
        if tuple(cache.shape) != (x.shape[0], W - 1, self.dim) or cache.dtype != x.dtype:
            raise ValueError(f"cache must be a [B, W-1, D] = [{x.shape[0]}, {W - 1}, {self.dim}] buffer of dtype "
                             f"{x.dtype}, got {list(cache.shape)} {cache.dtype} (allocate the static cache with the "
                             "activations' dtype, e.g. dtype=torch.bfloat16 under bf16 autocast)")
        backend = self._resolved_backend(x)
        if backend == "triton" and not self._records_grad(x, cache):
            from .shortconv_step import conv_step_triton

            y, _ = conv_step_triton(x[:, 0], cache, self.weight[:, 0], self.bias, self.activation == "silu",
                                    cache_out=cache)
            return y[:, None]
        y, new_cache = self(x, cache)
        cache.copy_(new_cache)
        return y

    def _resolved_backend(self, x: torch.Tensor) -> str:
        """The backend this call runs: the instance's, else the setting; "auto" decided for ``x``."""
        backend = self.backend or switches.current().shortconv_backend
        return auto_backend(x) if backend == "auto" else backend

    def _records_grad(self, *inputs: torch.Tensor) -> bool:
        """Whether autograd records through this call (the single-token step kernel has no backward)."""
        tensors = (*inputs, self.weight, self.bias)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

    def _forward_backend(self, x: torch.Tensor, cache: torch.Tensor | None, backend: str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The "conv1d" or "triton" backend (same result as the multiply-adds); cache None means zeros."""
        (_, T, D), W, w = x.shape, self.kernel_size, self.weight[:, 0]
        if backend == "triton" and T == 1 and cache is not None and not self._records_grad(x, cache):
            from .shortconv_step import conv_step_triton

            y, new_cache = conv_step_triton(x[:, 0], cache.to(x.dtype), w, self.bias, self.activation == "silu")
            return y[:, None], new_cache
        if backend == "triton":
            from .shortconv_triton import causal_conv_triton

            y = causal_conv_triton(x, cache, w, self.bias, self.activation == "silu")
        elif backend == "conv1d":  # channels-first view; causal padding, or the cache in front
            xp = x.transpose(1, 2) if cache is None else torch.cat([cache.to(x.dtype), x], dim=1).transpose(1, 2)
            b = None if self.bias is None else self.bias.to(x.dtype)
            y = F.conv1d(xp, w.to(x.dtype)[:, None], b, padding=W - 1 if cache is None else 0, groups=D)
            y = y[..., :T].transpose(1, 2)
            y = F.silu(y) if self.activation == "silu" else y
        else:
            raise ValueError(f"ShortConv.backend must be one of {', '.join(map(repr, CONV_BACKENDS))}; "
                             f"got {backend!r}")
        return y, last_inputs(x, cache, W)


def last_inputs(x: torch.Tensor, cache: torch.Tensor | None, kernel_size: int) -> torch.Tensor:
    """The cache a ShortConv of ``kernel_size`` W returns after input x [B, T, D] that followed ``cache``
    ([B, W-1, D], or None: zeros): the last W-1 inputs, a new tensor in x's dtype."""
    B, T, D = x.shape
    W = kernel_size
    if T >= W - 1:
        return x[:, T - (W - 1):].clone()  # a copy: a view would keep all of x alive in the cache
    before = x.new_zeros(B, W - 1, D) if cache is None else cache.to(x.dtype)
    return torch.cat([before[:, T:], x], dim=1)


def packed_last_inputs(x: torch.Tensor, offsets: list[int], cu_seqlens: torch.Tensor, kernel_size: int
                       ) -> torch.Tensor:
    """The caches a ShortConv of ``kernel_size`` W returns after packed input x [1, T, D] (sequences at ``offsets``,
    read from ``cu_seqlens``; no cache in): each sequence's last W-1 inputs [N, W-1, D], zeros before its start."""
    N, W, D = len(offsets) - 1, kernel_size, x.shape[-1]

    def rows() -> tuple[torch.Tensor, torch.Tensor]:
        cu = device_offsets(cu_seqlens, offsets, x.device)
        index = cu[1:, None] - (W - 1) + torch.arange(W - 1, device=x.device)[None]
        return index.clamp_min(0).flatten(), (index >= cu[:-1, None])[..., None]

    index, inside = kept(cu_seqlens, ("shortconv_last", W, str(x.device)), rows)
    last = x[0].index_select(0, index).view(N, W - 1, D)
    return torch.where(inside, last, last.new_zeros(()))


def set_shortconv_backend(model: nn.Module, backend: str) -> int:
    """Set ``backend`` ("auto", "muladd", "conv1d", "triton") on every ShortConv in ``model``; returns how many."""
    if backend not in CONV_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, CONV_BACKENDS))}; got {backend!r}")
    convs = [m for m in model.modules() if isinstance(m, ShortConv)]
    for m in convs:
        m.backend = backend
    return len(convs)
