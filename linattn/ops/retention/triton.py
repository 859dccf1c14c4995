"""backend="triton" for retention: simple_gla's Triton kernels with the constant gate log(1 - 2^(-5-h)) per head."""

from __future__ import annotations

from ..simple_gla.triton import simple_gla_triton
from .api import on_simple_gla

TRITON_BACKENDS = {"retention": on_simple_gla(simple_gla_triton)}
