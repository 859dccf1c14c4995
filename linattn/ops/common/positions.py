"""Position encodings shared by the softmax-attention family: RoPE (with position interpolation and
NTK-aware scaling), ALiBi slopes and biases, and the causal / sliding-window visibility mask.

Positions are absolute token indices (a call that continues a KV cache of length T0 starts at T0).

RoPE (Su et al. 2021), "rotate half" layout (GPT-NeoX / LLaMA): channel pairs (x_i, x_{i+D/2}) of a
query or key at position m are rotated by the angle m' * f_i with
    f_i = theta'^(-2i / D),  i = 0 .. D/2 - 1,
    m'  = m / interpolation_factor                       (position interpolation, Chen et al. 2023),
    theta' = theta * ntk_factor^(D / (D - 2))            (NTK-aware scaling, bloc97 2023).
Both factors default to 1 (plain RoPE). q_m . k_n after RoPE depends on m - n only.

ALiBi (Press et al. 2022): head h adds -slope_h * (i - j) to the logit of query i and key j
(-slope_h * |i - j| when attention is not causal); slopes are the geometric sequence 2^(-8 (h+1) / H)
for H a power of two, and the standard interleaving of the two nearest powers of two otherwise.
"""

from __future__ import annotations

import math

import torch

from .registered_ops import define_op

ROPE_KEYS = ("theta", "interpolation_factor", "ntk_factor")
ROPE_DEFAULTS = {"theta": 10000.0, "interpolation_factor": 1.0, "ntk_factor": 1.0}


def rope_config(rope: object) -> dict[str, float] | None:
    """Validate a ``rope=`` argument: None (no RoPE) or a dict with any of ``theta`` (> 0),
    ``interpolation_factor`` (>= 1 stretches the context) and ``ntk_factor`` (> 0); returns the
    dict completed with the defaults (theta 10000, both factors 1)."""
    if rope is None:
        return None
    if not isinstance(rope, dict):
        raise TypeError(f"rope must be None or a dict with keys {', '.join(ROPE_KEYS)}; got {type(rope).__name__}")
    unknown = sorted(set(rope) - set(ROPE_KEYS))
    if unknown:
        raise ValueError(f"rope has unknown keys {unknown}; allowed keys: {', '.join(ROPE_KEYS)}")
    cfg = dict(ROPE_DEFAULTS)
    for key, value in rope.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"rope[{key!r}] must be a number, got {type(value).__name__}")
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"rope[{key!r}] must be a finite number > 0, got {value!r}")
        cfg[key] = float(value)
    return cfg


def rope_inv_freq(dim: int, *, theta: float = 10000.0, ntk_factor: float = 1.0,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """Frequencies f_i = theta'^(-2i/dim), i < dim/2, with theta' = theta * ntk_factor^(dim/(dim-2)); float64."""
    if dim < 2 or dim % 2:
        raise ValueError(f"RoPE needs an even head dim >= 2, got {dim}")
    base = theta * ntk_factor ** (dim / (dim - 2)) if dim > 2 else theta * ntk_factor
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim
    return base ** -exponents


def rope_tables(angle_steps: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [*angle_steps.shape, D/2] in ``dtype`` of the angles angle_steps[..., None] * inv_freq (float64
    positions, already divided by the interpolation factor; float64 frequencies), formed in float64."""
    angle = angle_steps[..., None] * inv_freq
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def _rope_tables_fake(angle_steps, inv_freq, dtype):
    shape = (*angle_steps.shape, inv_freq.shape[0])
    return angle_steps.new_empty(shape, dtype=dtype), angle_steps.new_empty(shape, dtype=dtype)


# Under torch.compile the tables are one opaque op: inductor would otherwise fuse the float64 cos and sin into the
# rotation and evaluate them once per element of x, for every head and batch row (a 12-layer Transformer's
# compiled training step spent 13 ms of 79 there on an H100), instead of once per position and frequency.
_rope_tables_op = define_op("rope_tables", rope_tables, _rope_tables_fake)


def apply_rope(x: torch.Tensor, start: int | torch.Tensor = 0, *, theta: float = 10000.0,
               interpolation_factor: float = 1.0, ntk_factor: float = 1.0) -> torch.Tensor:
    """Rotate ``x`` [B, T, ..., D] (D even; ``...`` the heads) for its tokens' positions ("rotate half" layout).

    ``start``: the position of the first token (an int: positions start .. start + T - 1); per row a [B] integer
    tensor (rows at different positions: static decoding); or every token's position, a [B, T] integer tensor
    (packed sequences, whose positions restart at each sequence). The tensor forms are read on the device (no
    host synchronisation). Angles are formed in float64 (exact for long positions) and applied in ``x``'s dtype.
    """
    T, D = x.shape[1], x.shape[-1]
    inv_freq = rope_inv_freq(D, theta=theta, ntk_factor=ntk_factor, device=x.device)
    if isinstance(start, torch.Tensor):
        pos = start.to(device=x.device, dtype=torch.float64)
        if pos.dim() == 1:
            pos = pos[:, None] + torch.arange(T, dtype=torch.float64, device=x.device)[None]
        steps = pos / interpolation_factor  # [B, T]
    else:
        steps = (torch.arange(start, start + T, dtype=torch.float64, device=x.device) / interpolation_factor)[None]
    tables = _rope_tables_op if torch.compiler.is_compiling() else rope_tables
    cos, sin = tables(steps, inv_freq, x.dtype)  # [B or 1, T, D/2]
    shape = (*cos.shape[:2], *([1] * (x.dim() - 3)), D // 2)  # broadcast over the heads
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes [num_heads] (float64): 2^(-8/n), 2^(-16/n), ... for n = num_heads a power of two;
    otherwise the slopes of the largest power of two n < num_heads followed by every other slope of 2n."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(n) + geometric(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float64)


def relative_distance(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i - j for every query position i (rows) and key position j (columns): [Tq, Tk]."""
    return q_pos[:, None] - k_pos[None, :]


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """ALiBi logits bias [H, Tq, Tk] = -slope_h |i - j| (equal to -slope_h (i - j) on the causal part)."""
    dist = relative_distance(q_pos, k_pos).abs().to(slopes.dtype)
    return -slopes[:, None, None] * dist


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool = True,
                    window_size: int | None = None) -> torch.Tensor:
    """Bool [Tq, Tk]: True where query i may attend key j.

    causal: j <= i; window_size w: causal i - w < j <= i (the last w keys, itself included), non-causal
    |i - j| < w.
    """
    dist = relative_distance(q_pos, k_pos)
    visible = dist >= 0 if causal else torch.ones_like(dist, dtype=torch.bool)
    if window_size is not None:
        visible = visible & (dist.abs() < window_size)
    return visible
