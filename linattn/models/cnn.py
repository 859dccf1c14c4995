"""A small plain-PyTorch CNN over pixel-token images: a control model for the image tasks of LRA.

It reads the same token ids [B, T = side * side] (row by row) as the sequence classifiers and returns
logits [B, 1, C], the shape the Trainer's token loss takes with targets [B, 1]; so a CNN trained through
the study's batches and Trainer shows whether a task is learnable by that pipeline at all, apart from the
question whether a sequence model learns it.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]


class PixelCNN(nn.Module):
    """Stages of two 3x3 convolutions (BatchNorm, ReLU) at widths ``width * (1, 2, 4)``, each followed by a
    2x2 max pool, then one more convolution, a global max pool and a linear head. Pixel ids ``v + offset``
    (grey level v in [0, 256)) are read as v / 255: every grey level keeps its own value."""

    def __init__(self, side: int, num_classes: int, width: int = 16, offset: int = 3) -> None:
        super().__init__()
        for name, value, low in (("side", side, 8), ("num_classes", num_classes, 2), ("width", width, 1),
                                 ("offset", offset, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.side, self.offset = side, offset
        w = width
        self.body = nn.Sequential(*_conv(1, w), *_conv(w, w), nn.MaxPool2d(2),
                                  *_conv(w, 2 * w), *_conv(2 * w, 2 * w), nn.MaxPool2d(2),
                                  *_conv(2 * w, 4 * w), *_conv(4 * w, 4 * w), nn.MaxPool2d(2),
                                  *_conv(4 * w, 4 * w), nn.AdaptiveMaxPool2d(1), nn.Flatten())
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, side * side] -> logits [B, 1, num_classes]."""
        T = self.side * self.side
        if input_ids.dim() != 2 or input_ids.shape[1] != T:
            raise ValueError(f"input_ids must be [B, {T}] (a {self.side}x{self.side} image row by row), got shape "
                             f"{list(input_ids.shape)}")
        x = (input_ids - self.offset).float().div(255.0).view(-1, 1, self.side, self.side)
        return self.head(self.body(x))[:, None, :]
