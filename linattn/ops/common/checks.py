"""Input validation shared by every op.

Every public op validates its inputs with these helpers *before* any compute, and raises
``ValueError`` (wrong shape, unknown option) or ``TypeError`` (wrong type or dtype) naming the
argument, what it got and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .packed_call import state_rows

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CHUNK_SIZES = (16, 32, 64, 128)
# the chunk backends build [C, C] tiles per batch and head (memory C^2, and padding short inputs up to C):
# past this a "chunk" is the whole sequence at quadratic cost, and a typo such as 2**20 would reach the allocator
MAX_CHUNK_SIZE = 4096
# the delta family's Triton kernels: 128-token chunks spill registers and compile for minutes on a GPU
DELTA_TRITON_CHUNK_SIZES = (16, 32, 64)


@dataclass(frozen=True)
class Dims:
    """Sizes of one call: batch B, length T, heads H, key dim K, value dim V."""

    B: int
    T: int
    H: int
    K: int
    V: int


def _fmt(shape: Iterable) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_float_tensor(name: str, x: object, ndim: int, layout: str) -> torch.Tensor:
    """``x`` must be a floating tensor of rank ``ndim`` (``layout`` names the dims, e.g. "[B, T, H, K]")."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got dtype {x.dtype}"
        )
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got shape {_fmt(x.shape)}")
    return x


def check_shape(name: str, x: object, expected: tuple[int, ...], layout: str) -> torch.Tensor:
    """``x`` must be a floating tensor of exactly ``expected`` shape (``layout`` spells it in letters)."""
    x = check_float_tensor(name, x, len(expected), layout)
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
            f"{name} must have shape {layout} = {_fmt(expected)}, got shape {_fmt(x.shape)}"
        )
    return x


def check_qkv(q: object, k: object, v: object, *, qk_same_dim: bool = True) -> Dims:
    """Validate q, k ``[B, T, H, K]`` and v ``[B, T, H, V]``; return the sizes."""
    check_float_tensor("q", q, 4, "[B, T, H, K]")
    check_float_tensor("k", k, 4, "[B, T, H, K]")
    check_float_tensor("v", v, 4, "[B, T, H, V]")
    B, T, H, K = q.shape
    if qk_same_dim and tuple(k.shape) != (B, T, H, K):
        raise ValueError(
            f"k must have the shape of q [B, T, H, K] = {_fmt(q.shape)}, got shape {_fmt(k.shape)}"
        )
    if tuple(k.shape[:3]) != (B, T, H):
        raise ValueError(f"k must have shape [B, T, H, K] with B, T, H = {B}, {T}, {H}, got {_fmt(k.shape)}")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] with B, T, H = {B}, {T}, {H}, got {_fmt(v.shape)}")
    if T < 1 or K < 1 or v.shape[3] < 1:
        raise ValueError(f"q, k, v must be non-empty, got q {_fmt(q.shape)} and v {_fmt(v.shape)}")
    check_devices("q", q, k=k, v=v)
    return Dims(B, T, H, K, int(v.shape[3]))


def check_scalar_gate(name: str, g: object, d: Dims, T: int | None = None) -> torch.Tensor:
    """A per-head gate of shape ``[B, T, H]`` (``T`` overrides the length, e.g. interleaved inputs)."""
    return check_shape(name, g, (d.B, d.T if T is None else T, d.H), "[B, T, H]")


def check_vector_gate(name: str, g: object, d: Dims, T: int | None = None) -> torch.Tensor:
    """A per-channel gate of shape ``[B, T, H, K]``."""
    return check_shape(name, g, (d.B, d.T if T is None else T, d.H, d.K), "[B, T, H, K]")


def check_initial_state(initial_state: object, d: Dims, V: int | None = None) -> torch.Tensor | None:
    """``None`` or a state ``[B, H, K, V]`` (``[N, H, K, V]`` in a natively packed call: one row per sequence)."""
    if initial_state is None:
        return None
    return check_shape("initial_state", initial_state, (state_rows(d.B), d.H, d.K, d.V if V is None else V),
                       "[B, H, K, V]")


def check_choice(name: str, value: object, choices: Iterable[object]) -> object:
    """``value`` must be one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value


def check_chunk_size(chunk_size: object) -> int:
    """chunk_size is an int in [1, MAX_CHUNK_SIZE]; the chunk backends are tested at 16, 32, 64 and 128."""
    if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
            or not 1 <= chunk_size <= MAX_CHUNK_SIZE):
        raise ValueError(f"chunk_size must be an int in [1, {MAX_CHUNK_SIZE}] (16, 32, 64 or 128 are tested), "
                         f"got {chunk_size!r}")
    return chunk_size


def resolve_scale(scale: float | None, K: int) -> float:
    """The query scale: K^-1/2 when None, else a finite number > 0 (NaN or inf would turn every output into NaN,
    and a scale <= 0 flips or erases the attention logits)."""
    if scale is None:
        return K ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be None (K^-1/2) or a finite number > 0, got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be None (K^-1/2) or a finite number > 0, got {scale!r}")
    return float(scale)


def _named_tensors(name: str, x: object) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors inside an argument with their names: a tensor, a tuple/list of them (a pair state), or a
    dataclass state (KVCache, MiniBatchState) whose fields hold tensors, tuples or dicts of tensors."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return  # before is_dataclass, which Dynamo in torch 2.11 cannot trace on them (a graph break)
    if isinstance(x, torch.Tensor):
        yield name, x
    elif isinstance(x, (tuple, list)):
        for i, item in enumerate(x):
            yield from _named_tensors(f"{name}[{i}]", item)
    elif isinstance(x, dict):
        for key, item in x.items():
            yield from _named_tensors(f"{name}[{key!r}]", item)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _named_tensors(f"{name}.{f.name}", getattr(x, f.name))


def check_devices(ref_name: str, ref: torch.Tensor, **args: object) -> None:
    """Every tensor in ``args`` (None and non-tensors skipped: their own checks name them) must be on ``ref``'s
    device. Compares ``.device`` only (no tensor read, no host sync); runs before any check that reads values,
    where a tensor on another device would fail with torch's own error (or "item() on meta tensors")."""
    for arg, value in args.items():
        for name, x in _named_tensors(arg, value):
            if x.device != ref.device:
                raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {x.device}")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the reference math runs in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_step_qkv(q: object, k: object, v: object) -> Dims:
    """Validate one decoding step's q, k ``[B, H, K]`` and v ``[B, H, V]`` (one token); T is 1 in the result."""
    check_float_tensor("q", q, 3, "[B, H, K]")
    check_float_tensor("k", k, 3, "[B, H, K]")
    check_float_tensor("v", v, 3, "[B, H, V]")
    B, H, K = q.shape
    if tuple(k.shape) != (B, H, K):
        raise ValueError(f"k must have the shape of q [B, H, K] = {_fmt(q.shape)}, got {_fmt(k.shape)}")
    if tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"v must have shape [B, H, V] with B, H = {B}, {H}, got {_fmt(v.shape)}")
    check_devices("q", q, k=k, v=v)
    return Dims(B, 1, H, K, int(v.shape[2]))
