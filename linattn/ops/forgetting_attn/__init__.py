"""forgetting_attn: the Forgetting Transformer's attention (FoX, arXiv 2503.02130) with a KV cache."""

from .api import forgetting_attn, forgetting_attn_step

__all__ = ["forgetting_attn", "forgetting_attn_step"]
