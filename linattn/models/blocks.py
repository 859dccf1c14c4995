"""Pre-norm residual blocks: x + mixer(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)) (or no MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linattn.layers.base import MixerLayer
from linattn.layers.cache import LayerCache
from linattn.ops.common.varlen import check_cu_seqlens

from .config import ModelConfig


class SwiGLU(nn.Module):
    """W_down (SiLU(W_gate x) ⊙ W_up x)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def reverse_within(x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Reverse each sequence of ``x`` [B, T, ...] along time within its length (padding stays put).
    Applying it twice gives ``x`` back."""
    if lengths is None:
        return x.flip(1)
    T = x.shape[1]
    t = torch.arange(T, device=x.device)[None]
    idx = torch.where(t < lengths[:, None], lengths[:, None] - 1 - t, t)  # [B, T]
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x))


AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps", "hpu")


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype when autocast is on for its device (else x). A norm's output feeds several
    projections; autocast would cast it once per Linear and each Linear would keep its own copy for the backward
    pass (six copies in a Gated DeltaNet layer), so the block casts it once and they all share it."""
    device = x.device.type
    # a fixed list rather than torch.amp.is_autocast_available, which Dynamo in torch 2.11 cannot trace
    if device in AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class Bidirectional(nn.Module):
    """Runs one mixer left to right and another right to left and sums: y = f(x) + R(b(R(x))), where
    R reverses each sequence within its length."""

    def __init__(self, forward_mixer: nn.Module, backward_mixer: nn.Module) -> None:
        super().__init__()
        self.fwd, self.bwd = forward_mixer, backward_mixer

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        y_f, _ = self.fwd(x, use_cache=False)
        y_b, _ = self.bwd(reverse_within(x, lengths), use_cache=False)
        return y_f + reverse_within(y_b, lengths)


class Block(nn.Module):
    """One pre-norm residual block of ``config`` (bidirectional: the mixer runs both ways)."""

    def __init__(self, config: ModelConfig, bidirectional: bool = False) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.norm1 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        mixer = config.build_mixer()
        self.mixer = Bidirectional(mixer, config.build_mixer()) if bidirectional else mixer
        self.norm2 = nn.RMSNorm(config.d_model, eps=config.norm_eps) if config.mlp else None
        self.mlp = SwiGLU(config.d_model, config.ffn_hidden) if config.mlp else None

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, *, use_cache: bool = True,
                lengths: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, LayerCache | None]:
        """x [B, T, d_model] -> (x + mixer + MLP, the mixer's new cache); ``cu_seqlens``: x [1, T, d_model] packs
        sequences at these offsets (causal blocks only; no cache in or out)."""
        h = to_autocast_dtype(self.norm1(x))
        if cu_seqlens is not None:
            if self.bidirectional:
                raise ValueError("cu_seqlens (packed sequences) is taken by causal blocks only, not bidirectional ones")
            h, cache = packed_mixer(self.mixer, h, cu_seqlens), None
        elif self.bidirectional:
            h, cache = self.mixer(h, lengths), None
        else:
            h, cache = self.mixer(h, cache, use_cache=use_cache)
        x = x + h
        if self.mlp is not None:
            x = x + self.mlp(to_autocast_dtype(self.norm2(x)))
        return x, cache


def packed_mixer(mixer: nn.Module, h: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The mixer over packed sequences h [1, T, d_model]: an op-backed layer takes ``cu_seqlens`` itself; any other
    mixer (the plain-PyTorch baselines) runs each sequence as a separate call."""
    if isinstance(mixer, MixerLayer):
        return mixer(h, use_cache=False, cu_seqlens=cu_seqlens)[0]
    offsets = check_cu_seqlens(cu_seqlens, h.shape[1], h.device)
    return torch.cat([mixer(h[:, s:e], use_cache=False)[0] for s, e in zip(offsets[:-1], offsets[1:], strict=True)],
                     dim=1)
