"""Small pieces shared by the Triton kernels (import only where Triton is installed)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import batch_slices
from .triton_compat import patch_interpreter

patch_interpreter()


# Triton reads TRITON_INTERPRET when a kernel is defined (at import), so it cannot change afterwards
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """True when kernels run on the CPU through Triton's interpreter."""
    return _INTERPRETING


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs keep full precision (tf32 would miss 1e-5 agreement); bf16/fp16 use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dots(dtype: torch.dtype) -> bool:
    """The interpreter multiplies bfloat16 blocks wrongly (it has no bf16 matmul): upcast them there.
    On a GPU this is False and the kernels use bf16 tensor-core products with float32 accumulation,
    which gives the same numbers: bf16 values are exact in float32."""
    return interpreting() and dtype == torch.bfloat16


def launch_choice(launch: dict, family: str, key: str, choices: tuple) -> object:
    """``launch[key]``, which must be one of ``choices`` (a ValueError naming the family's setting otherwise)."""
    value = launch[key]
    if value not in choices:
        raise ValueError(f"{family} launch setting {key} must be one of {', '.join(map(repr, choices))}, "
                         f"got {value!r}")
    return value


def launch_overrides(family: str, launch: dict) -> dict:
    """``launch`` (a kernel module's ``LAUNCH`` dict) made to follow the setting ``triton_launch``
    (``{"<family>": {"<key>": value}}``; ``linattn.settings(triton_launch=...)`` or the environment variable
    ``LINATTN_TRITON_LAUNCH``), for tuning and for working around compiler faults without editing the code;
    unknown keys are an error naming the valid ones."""
    from linattn.switches import register_launch

    return register_launch(family, launch)


def launch_options(launch: dict, kernel: str, dtype: torch.dtype, float32_stages: int | None = None) -> dict:
    """``num_warps`` and ``num_stages`` of ``kernel`` from a family's ``launch`` dict (keys "<kernel>_warps",
    "<kernel>_stages"); float32 inputs get ``float32_stages`` (None: Triton's default) instead, since their
    tiles take twice the shared memory per stage."""
    stages = float32_stages if dtype == torch.float32 else launch[f"{kernel}_stages"]
    return {"num_warps": launch[f"{kernel}_warps"], **({} if stages is None else {"num_stages": stages})}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids. Host code uses these two rather than ``triton.cdiv`` and
    ``triton.next_power_of_2``: in newer Triton those are constexpr functions that cost microseconds per call,
    and a launch computes several."""
    return -(-a // b)


def grid_slices(count: int) -> list[tuple[int, int]]:
    """(first, count) of the launches that cover ``count`` programs along a capped grid axis (one launch unless
    ``count`` exceeds batch_slices.GRID_LIMIT: a packed call of tens of thousands of sequences); the kernel adds
    ``first`` to its program index along that axis."""
    limit = batch_slices.GRID_LIMIT
    if count <= limit:
        return [(0, count)]
    return [(first, min(limit, count - first)) for first in range(0, count, limit)]


@triton.jit
def block_and_index(BLOCKS: tl.constexpr):
    """(block, index) of a program on a grid whose first axis holds BLOCKS blocks times a count (block fastest: the
    order of a (BLOCKS, count) grid): the per-chunk kernels' chunks (grid (BLOCKS * chunks, rows)) and the decoding
    step's rows times heads, since CUDA caps the second and third axes at 65,535 programs and a call of over 4
    million tokens (packed or one row), or a step of over 65,535 rows times heads, has more than that."""
    pid = tl.program_id(0)
    return pid % BLOCKS, pid // BLOCKS


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block(n: int) -> int:
    """Power-of-two block covering n (at least 16, the smallest tl.dot size)."""
    return max(16, next_power_of_2(n))


def row_tile(width: int) -> tuple[int, int]:
    """(rows, columns) of a row-wise elementwise kernel's tile over rows ``width`` wide: the columns a power of two
    covering the row, and 16 to 128 rows, about 8192 elements a program."""
    cols = next_power_of_2(width)
    return max(16, min(128, 8192 // cols)), cols


@triton.jit
def mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation (see :func:`upcast_dots`)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)

