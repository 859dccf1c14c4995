"""Token-mixer layers (nn.Modules): projections, ShortConv, gates, norms around an op.

Every layer: ``forward(x [B, T, d_model], cache=None) -> (y, cache)``; see :class:`MixerLayer`.
``list_mixers()`` names them; ``build_mixer(name, d_model, n_heads, **kwargs)`` builds one.
"""

from .base import MixerLayer
from .cache import LayerCache
from .mamba2 import Mamba2Layer
from .registry import build_mixer, list_mixers, mixer_class, register_mixer
from .shortconv import CONV_MODES, ShortConv

register_mixer("mamba2", Mamba2Layer)

__all__ = ["CONV_MODES", "LayerCache", "Mamba2Layer", "MixerLayer", "ShortConv", "build_mixer", "list_mixers",
           "mixer_class", "register_mixer"]
