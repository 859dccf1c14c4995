"""delta_rule: DeltaNet, linear attention with the delta (error-correcting) update."""

from .api import delta_rule, delta_rule_step

__all__ = ["delta_rule", "delta_rule_step"]
