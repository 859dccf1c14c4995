"""Token-mixer layers (nn.Modules): projections, ShortConv, gates, norms around an op.

Every layer: ``forward(x [B, T, d_model], cache=None) -> (y, cache)``; see :class:`MixerLayer`.
"""

from .base import MixerLayer
from .cache import LayerCache
from .mamba2 import Mamba2Layer
from .shortconv import CONV_MODES, ShortConv

__all__ = ["CONV_MODES", "LayerCache", "Mamba2Layer", "MixerLayer", "ShortConv"]
