"""gated_delta_product: several delta-rule (Householder) steps per token (DeltaProduct)."""

from .api import gated_delta_product, gated_delta_product_step

__all__ = ["gated_delta_product", "gated_delta_product_step"]
