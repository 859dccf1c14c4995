"""linear_attn: linear attention with feature maps and an optional normaliser (no decay)."""

from .api import linear_attn, linear_attn_step
from .feature_maps import FEATURE_MAPS, draw_feature_map_weight

__all__ = ["FEATURE_MAPS", "draw_feature_map_weight", "linear_attn", "linear_attn_step"]
