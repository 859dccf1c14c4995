"""Rotary position embedding (RoPE, Su et al. 2021) on [B, T, H, D] tensors with a position offset."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, offset: int | torch.Tensor = 0, base: float = 10000.0) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of ``x`` [B, T, H, D] by angles (offset + t) * base^(-2i/D).

    ``offset``: the position of the first token, an int or per row a [B] integer tensor (static decoding,
    where rows sit at different positions); or every token's position, a [B, T] integer tensor (packed
    sequences, whose positions restart at each sequence). An odd last channel is left as is. Computed in float32
    (float64 for float64), returned in x's dtype.
    """
    B, T, H, D = x.shape
    half = D // 2
    if half == 0:
        return x
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=dt) * 2 / (2 * half))
    if isinstance(offset, torch.Tensor) and offset.dim() == 2:  # per-token positions (packed sequences)
        ang = offset.to(dt)[..., None] * inv_freq  # [B, T, half]
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    elif isinstance(offset, torch.Tensor):  # [B, T] positions, on the device: no host read of the offsets
        pos = offset.to(dt)[:, None] + torch.arange(T, device=x.device, dtype=dt)[None]
        ang = pos[..., None] * inv_freq  # [B, T, half]
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    else:
        pos = torch.arange(offset, offset + T, device=x.device, dtype=dt)
        ang = pos[:, None] * inv_freq[None]  # [T, half]
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x1, x2, rest = x[..., :half].to(dt), x[..., half:2 * half].to(dt), x[..., 2 * half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
