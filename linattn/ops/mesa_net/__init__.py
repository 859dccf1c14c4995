"""mesa_net: the optimal (ridge-regression) read-out of a decayed key/value context, arXiv 2506.05233."""

from .api import mesa_net, mesa_net_step

__all__ = ["mesa_net", "mesa_net_step"]
