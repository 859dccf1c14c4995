"""The torch.compile modes the trainer and the model benchmark offer, by name (no torch import: the CLI reads them)."""

from __future__ import annotations

# "reduce-overhead" replays the compiled graphs as CUDA graphs (no host work per kernel)
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def torch_compile_mode(mode: str) -> str | None:
    """torch.compile's ``mode`` argument for a mode of :data:`TORCH_COMPILE_MODES` ("default": None)."""
    return None if mode == "default" else mode
