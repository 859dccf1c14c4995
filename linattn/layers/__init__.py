"""Token-mixer layers (nn.Modules): projections, ShortConv, gates, norms around an op.

Every layer: ``forward(x [B, T, d_model], cache=None) -> (y, cache)``; see :class:`MixerLayer`.
``list_mixers()`` names them; ``build_mixer(name, d_model, n_heads, **kwargs)`` builds one.
"""

from .attention import DeltaFormerLayer, ForgettingAttentionLayer, PaTHLayer, SoftmaxAttentionLayer
from .base import MixerLayer
from .baselines import LRULayer, MambaLayer
from .cache import LayerCache
from .decay import GLALayer, LinearAttentionLayer, RetNetLayer
from .delta import CombaLayer, DeltaNetLayer, GatedDeltaNetLayer, MesaNetLayer
from .delta_product import GatedDeltaProductLayer
from .mamba2 import Mamba2Layer
from .registry import build_mixer, list_mixers, mixer_class, register_mixer
from .shortconv import CONV_BACKENDS, CONV_MODES, ShortConv, set_shortconv_backend
from .ttt import TitansLayer, TTTLinearLayer

for _name, _cls in {
    "linear_attn": LinearAttentionLayer, "retention": RetNetLayer, "mamba2": Mamba2Layer, "gla": GLALayer,
    "delta_rule": DeltaNetLayer, "gated_delta_rule": GatedDeltaNetLayer, "comba": CombaLayer, "mesa_net": MesaNetLayer,
    "ttt_linear": TTTLinearLayer, "titans": TitansLayer, "gated_delta_product": GatedDeltaProductLayer,
    "softmax_attn": SoftmaxAttentionLayer, "forgetting_attn": ForgettingAttentionLayer, "deltaformer": DeltaFormerLayer,
    "path_attn": PaTHLayer, "lru": LRULayer, "mamba": MambaLayer,
}.items():
    register_mixer(_name, _cls)

__all__ = [
    "build_mixer", "CombaLayer", "CONV_BACKENDS", "CONV_MODES", "DeltaFormerLayer", "DeltaNetLayer",
    "ForgettingAttentionLayer", "GatedDeltaNetLayer", "GatedDeltaProductLayer", "GLALayer", "LayerCache",
    "LinearAttentionLayer", "list_mixers", "LRULayer", "Mamba2Layer", "MambaLayer", "MesaNetLayer", "mixer_class",
    "MixerLayer", "PaTHLayer", "register_mixer", "RetNetLayer", "set_shortconv_backend", "ShortConv",
    "SoftmaxAttentionLayer", "TitansLayer", "TTTLinearLayer",
]
