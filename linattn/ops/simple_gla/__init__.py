"""simple_gla: scalar data-dependent decay (Mamba2 / SSD core)."""

from .api import simple_gla, simple_gla_step

__all__ = ["simple_gla", "simple_gla_step"]
