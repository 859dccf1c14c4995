"""deltaformer: a delta rule on the values in the softmax kernel's feature space, then softmax attention."""

from .api import deltaformer, deltaformer_step

__all__ = ["deltaformer", "deltaformer_step"]
