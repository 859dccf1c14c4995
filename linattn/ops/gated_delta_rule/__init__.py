"""gated_delta_rule: the delta rule with a data-dependent scalar decay (Gated DeltaNet)."""

from .api import gated_delta_rule, gated_delta_rule_step

__all__ = ["gated_delta_rule", "gated_delta_rule_step"]
