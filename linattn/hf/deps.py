"""The optional dependencies of linattn.hf (transformers, safetensors), imported with an install hint."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = 'pip install "linattn[hf]"  (or: pip install "transformers>=4.45" safetensors)'


def require(module: str) -> ModuleType:
    """Import ``module`` (transformers or safetensors); a missing one raises ImportError saying how to install
    linattn's ``hf`` extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"linattn.hf needs the package {module.split('.')[0]!r}, which could not be imported "
                          f"({exc}); install it with: {INSTALL_HINT}") from exc
