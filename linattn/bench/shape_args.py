"""The problem-shape options (--B --T --H --K --V) shared by the kernel tools' command lines."""

from __future__ import annotations

import argparse


def add_shape_arguments(parser: argparse.ArgumentParser, *, B: int, T: int, H: int, K: int = 128,
                        V: int = 128) -> None:
    """Add --B (batch), --T (sequence length), --H (heads), --K (key dim) and --V (value dim) with these defaults."""
    for name, default, what in (("B", B, "batch size"), ("T", T, "sequence length"), ("H", H, "heads"),
                                ("K", K, "key dim"), ("V", V, "value dim")):
        parser.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default {default})")
