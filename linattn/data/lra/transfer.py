"""Fine-tuning from self-pretrained weights: copy a pretrained model's weights into a classifier,
dropping the pretraining head."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TransferReport:
    """What ``load_pretrained`` did: copied names, names left at their initialisation, names skipped."""

    loaded: tuple[str, ...]
    kept: tuple[str, ...]
    dropped: tuple[str, ...]


def load_pretrained(model: nn.Module, pretrained: Mapping[str, torch.Tensor],
                    drop_prefixes: Sequence[str] = ("lm_head",), strict_shapes: bool = True) -> TransferReport:
    """Copy every tensor of ``pretrained`` (a state dict) into ``model``'s tensor of the same name, except
    names starting with one of ``drop_prefixes`` (the pretraining head) and names ``model`` lacks.
    ``model``'s own tensors missing from ``pretrained`` (the new classifier head) are kept as they are.
    A shape mismatch raises ValueError (``strict_shapes``) or is dropped."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(drop_prefixes, str):
        raise TypeError("drop_prefixes must be a sequence of name prefixes, got a str")
    target = model.state_dict()
    loaded, dropped = [], []
    for name, value in pretrained.items():
        if any(name.startswith(p) for p in drop_prefixes) or name not in target:
            dropped.append(name)
        elif tuple(value.shape) != tuple(target[name].shape):
            if strict_shapes:
                raise ValueError(f"pretrained[{name!r}] has shape {list(value.shape)} but the model expects "
                                 f"{list(target[name].shape)}")
            dropped.append(name)
        else:
            loaded.append(name)
    model.load_state_dict({n: pretrained[n] for n in loaded}, strict=False)
    kept = tuple(n for n in target if n not in set(loaded))
    return TransferReport(tuple(loaded), kept, tuple(dropped))
