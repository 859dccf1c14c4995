"""retention: RetNet's multi-scale retention, simple_gla with a fixed decay per head."""

from .api import retention, retention_log_decay, retention_step

__all__ = ["retention", "retention_log_decay", "retention_step"]
