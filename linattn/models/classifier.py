"""SequenceClassifier: an encoder of pre-norm blocks, pooling, a classification head (or dual encoder)."""

from __future__ import annotations

import torch
from torch import nn

from linattn.ops.common.values import value_checks_enabled

from .blocks import Block
from .config import ModelConfig
from .lm import check_input_ids

POOLINGS = ("mean", "last")


class SequenceClassifier(nn.Module):
    """``logits = model(input_ids, input_ids2=None, mask=None, mask2=None)``.

    pooling: "mean" over the real tokens or the "last" real token. bidirectional: each block runs its
    mixer left to right and a second mixer right to left (within each sequence's length) and sums.
    dual: documents ``input_ids`` and ``input_ids2`` go through the same encoder; the head reads
    [e1, e2, e1 * e2, e1 - e2] (LRA Retrieval). ``mask`` [B, T] bool marks real tokens (right padding).
    """

    def __init__(self, config: ModelConfig, num_classes: int, pooling: str = "mean", bidirectional: bool = False,
                 dual: bool = False) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(map(repr, POOLINGS))}; got {pooling!r}")
        self.config, self.pooling, self.bidirectional, self.dual = config, pooling, bool(bidirectional), bool(dual)
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(config, bidirectional=self.bidirectional) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(d, eps=config.norm_eps)
        if dual:
            self.head = nn.Sequential(nn.Linear(4 * d, d), nn.GELU(), nn.Linear(d, num_classes))
        else:
            self.head = nn.Linear(d, num_classes)

    def encode(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None, name: str = "input_ids"
               ) -> torch.Tensor:
        """Pooled features [B, d_model] of one batch of documents."""
        check_input_ids(name, input_ids, self.config.vocab_size)
        lengths = lengths_from_mask(mask, input_ids.shape, "mask" if name == "input_ids" else "mask2")
        x = self.embed(input_ids.long())
        for block in self.blocks:
            x, _ = block(x, use_cache=False, lengths=lengths)
        x = self.norm(x)
        B, T, _ = x.shape
        if lengths is None:
            return x.mean(dim=1) if self.pooling == "mean" else x[:, -1]
        if self.pooling == "last":
            return x[torch.arange(B, device=x.device), lengths - 1]
        keep = (torch.arange(T, device=x.device)[None] < lengths[:, None]).to(x.dtype)
        return (x * keep[..., None]).sum(1) / lengths[:, None].to(x.dtype)

    def forward(self, input_ids: torch.Tensor, input_ids2: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None, mask2: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] (and input_ids2 [B, T2] in dual mode) -> logits [B, num_classes]."""
        if self.dual and input_ids2 is None:
            raise ValueError("dual=True needs input_ids2 (the second document of each pair)")
        if not self.dual and input_ids2 is not None:
            raise ValueError("input_ids2 is only used with dual=True; this classifier has dual=False")
        e1 = self.encode(input_ids, mask)
        if not self.dual:
            return self.head(e1)
        e2 = self.encode(input_ids2, mask2, name="input_ids2")
        return self.head(torch.cat([e1, e2, e1 * e2, e1 - e2], dim=-1))


def lengths_from_mask(mask: torch.Tensor | None, shape: torch.Size, name: str) -> torch.Tensor | None:
    """Lengths [B] of right-padded sequences from a [B, T] bool mask (True = real token)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(shape):
        got = f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a bool tensor of shape {list(shape)} (True = real token), got {got}")
    lengths = mask.sum(1)
    prefix = torch.arange(shape[1], device=mask.device)[None] < lengths[:, None]
    if value_checks_enabled(mask) and not bool(((lengths >= 1).all() & (mask == prefix).all()).item()):
        raise ValueError(f"{name} must mark a non-empty prefix of each row (right padding)")
    return lengths
