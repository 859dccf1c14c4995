"""linattn: linear attention, every mixer three ways that agree, with the experiments that test it."""

from linattn.switches import Settings, configure, current, settings

__version__ = "0.1.0"

__all__ = ["Settings", "configure", "current", "settings", "__version__"]
