"""comba: the gated delta rule with a separate read key p (arXiv 2506.02475)."""

from .api import comba, comba_step

__all__ = ["comba", "comba_step"]
