"""Fine-tuning from pretrained weights: copy a pretrained model's weights into another model (a classifier
from a self-pretrained CausalLM), dropping the pretraining head."""

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


def transfer_encoder(lm: nn.Module, classifier: nn.Module) -> list[str]:
    """Copy a pretrained CausalLM's weights (all but its ``lm_head``) into ``classifier`` (a
    SequenceClassifier, or a module wrapping one as ``.classifier``); the classifier's names copied.
    RuntimeError when nothing matches (a classifier of another architecture would silently start from scratch).

    A bidirectional classifier (``Block(config, bidirectional=True)``: each block's mixer is a
    :class:`~linattn.models.blocks.Bidirectional` of a left-to-right ``mixer.fwd`` and a right-to-left
    ``mixer.bwd``) gets the pretrained mixer of each block in BOTH directions: ``blocks.i.mixer.X`` is copied
    to ``blocks.i.mixer.fwd.X`` and to ``blocks.i.mixer.bwd.X``. The backward mixer thus starts as the
    pretrained left-to-right mixer applied to the reversed sequence; embeddings, norms and MLPs copy as usual."""
    target = getattr(classifier, "classifier", classifier)
    report = load_pretrained(target, bidirectional_state(lm.state_dict(), target.state_dict()),
                             drop_prefixes=("lm_head",))
    if not report.loaded:
        raise RuntimeError("no pretrained tensor matched the classifier's names")
    return list(report.loaded)


def bidirectional_state(pretrained: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    """``pretrained`` with each mixer tensor ``....mixer.X`` that ``target`` lacks but holds as
    ``....mixer.fwd.X`` and ``....mixer.bwd.X`` (a bidirectional block) renamed to both; other names as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, value in pretrained.items():
        if name not in target and ".mixer." in name:
            head, rest = name.split(".mixer.", 1)
            both = [f"{head}.mixer.{d}.{rest}" for d in ("fwd", "bwd")]
            if all(b in target for b in both):
                out.update(dict.fromkeys(both, value))
                continue
        out[name] = value
    return out
