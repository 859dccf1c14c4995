"""mesa_net: the optimal (ridge-regression) read-out of a decayed key/value context, arXiv 2506.05233."""

from .api import mesa_net, mesa_net_step
from .solve import NotPositiveDefiniteError

__all__ = ["NotPositiveDefiniteError", "mesa_net", "mesa_net_step"]
