"""Token-level loss/accuracy and the JSONL (+ optional TensorBoard) metrics log."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from linattn.data.base import IGNORE_INDEX


def logits_of(output: object) -> torch.Tensor:
    """The logits of a model's output: the tensor itself or the first item of a tuple/list
    (``CausalLM`` returns ``(logits, cache)``)."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the model must return logits or (logits, ...), got {type(output).__name__}")
    return output


def token_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of cross-entropy, number of labelled tokens, number correct) over positions whose target is
    not IGNORE_INDEX. ``logits [..., C]`` with ``targets [...]``: token tasks and classifiers alike."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}: "
                         f"expected logits of shape targets.shape + (num_classes,)")
    flat, tgt = logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
    ce = F.cross_entropy(flat, tgt, ignore_index=IGNORE_INDEX, reduction="sum")
    mask = labelled(tgt)
    correct = ((flat.argmax(-1) == tgt) & mask).sum()
    return ce, mask.sum(), correct


def labelled(targets: torch.Tensor) -> torch.Tensor:
    """The positions :func:`token_stats` scores: those whose target is not IGNORE_INDEX (bool, targets' shape)."""
    return targets != IGNORE_INDEX


def sequence_correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Number of sequences whose every labelled token is predicted right."""
    if targets.dim() == 1:
        return ((logits.argmax(-1) == targets) | (targets == IGNORE_INDEX)).sum()
    ok = (logits.argmax(-1) == targets) | (targets == IGNORE_INDEX)
    return ok.all(dim=-1).sum()


class MetricsLog:
    """Appends one JSON object per record to ``path``; mirrors scalars to TensorBoard when asked."""

    def __init__(self, path: Path | None, tensorboard_dir: Path | None = None) -> None:
        self.path = path
        self.writer = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("tensorboard=True needs the tensorboard package: pip install tensorboard") from exc
            self.writer = SummaryWriter(str(tensorboard_dir))

    def truncate_after(self, step: int) -> None:
        """Drop records newer than ``step`` (a resumed run rewrites them)."""
        if self.path is None or not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("step", "split") and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
