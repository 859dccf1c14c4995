"""path_attn: softmax attention with accumulated Householder position encoding (PaTH) and a forget gate."""

from .api import path_attn, path_attn_step

__all__ = ["path_attn", "path_attn_step"]
