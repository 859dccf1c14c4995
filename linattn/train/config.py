"""TrainConfig: every knob of the Trainer, validated, round-trippable through a dict (YAML)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class TrainConfig:
    """Optimisation: AdamW(lr, betas, weight_decay on >=2-D weights), linear warmup over
    ``warmup_steps`` then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``, gradient clipping at
    ``grad_clip`` (0: off). ``batch_size`` is global (split over data-parallel ranks). Evaluation every
    ``eval_every`` steps and at the end; the run stops early once the eval ``target_metric`` reaches
    ``target_value`` (>= for accuracies, <= for names containing "loss"). ``precision`` "auto" is bf16
    autocast on CUDA and float32 on CPU."""

    max_steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batch_size: int = 256
    target_metric: str = "accuracy"
    target_value: float | None = None
    checkpoint_every: int = 0
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"
    progress: bool = True
    tensorboard: bool = False

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        for name in ("max_steps", "batch_size", "eval_every", "eval_batch_size", "log_every"):
            _positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "checkpoint_every", "seed"):
            _positive_int(name, getattr(self, name), low=0)
        for name in ("lr", "weight_decay", "min_lr_ratio", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative float, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {self.betas!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not isinstance(self.device, str):
            raise TypeError(f"device must be a str ('auto', 'cpu', 'cuda', 'cuda:1'), got {self.device!r}")

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints (``checkpoint_every``, or ``eval_every`` when 0)."""
        return self.checkpoint_every or self.eval_every

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """Build from a mapping; unknown keys raise ValueError naming them."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown train config key(s) {unknown}; expected a subset of {sorted(fields)}")
        return cls(**d)


def _positive_int(name: str, value: object, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
