"""gla: gated linear attention, a data-dependent decay per key channel."""

from .api import gla, gla_step

__all__ = ["gla", "gla_step"]
