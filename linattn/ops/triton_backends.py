"""Registers the ``backend="triton"`` implementations when Triton is importable.

Triton is optional: without it (or on a machine where it fails to import) the ops keep their other
backends and "auto" falls back to chunk. The kernels run on CUDA tensors, and on the CPU under
``TRITON_INTERPRET=1`` (how CI tests them).
"""

from __future__ import annotations

import importlib

from .common.registry import get_op
from .common.triton_compat import triton_available

# op name -> (module with the kernels, implementation function)
TRITON_IMPLEMENTATIONS = {
    "simple_gla": ("linattn.ops.simple_gla.triton", "simple_gla_triton"),
}


def register_triton_backends() -> list[str]:
    """Add every Triton implementation to its op's registry entry; return the op names registered."""
    if not triton_available():
        return []
    done = []
    for op, (module, name) in TRITON_IMPLEMENTATIONS.items():
        get_op(op).implementations["triton"] = getattr(importlib.import_module(module), name)
        done.append(op)
    return done
