"""Registers the ``backend="triton"`` implementations when Triton is importable.

Each op family may have a ``triton.py`` module (``linattn/ops/<family>/triton.py``) that defines
``TRITON_BACKENDS = {op_name: implementation}``; every such module found is imported and its
implementations are added to the ops' registry entries. Triton is optional: without it (or where it
fails to import) the ops keep their other backends and "auto" falls back to chunk. The kernels run on
CUDA tensors, and on the CPU under ``TRITON_INTERPRET=1`` (how CI tests them).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from pathlib import Path

from .common.registry import get_op
from .common.triton_compat import triton_available


def register_triton_backends() -> list[str]:
    """Import every ``<family>/triton.py`` and register its implementations; return the op names."""
    if not triton_available():
        return []
    done = []
    for family in pkgutil.iter_modules([str(Path(__file__).parent)]):
        name = f"linattn.ops.{family.name}.triton"
        if not family.ispkg or importlib.util.find_spec(name) is None:
            continue
        for op, implementation in importlib.import_module(name).TRITON_BACKENDS.items():
            get_op(op).implementations["triton"] = implementation
            done.append(op)
    return sorted(done)
