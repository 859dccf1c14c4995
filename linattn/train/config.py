"""TrainConfig: every knob of the Trainer, validated strictly when built, round-trippable through a dict (YAML).

Every field is type- and range-checked in ``__post_init__`` (before any compute); a bad one raises
:class:`linattn.errors.ConfigError` naming the field, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from linattn.compile_modes import TORCH_COMPILE_MODES
from linattn.errors import ConfigError
from linattn.validation import check_bool, check_choice, check_device, check_float, check_int, check_pair

PRECISIONS = ("auto", "bf16", "fp32")
EVAL_METRICS = ("loss", "accuracy", "seq_accuracy")
PARALLEL_STRATEGIES = ("ddp", "fsdp")
FSDP_PARAM_DTYPES = ("auto", "bf16", "fp32")
FSDP_REDUCE_DTYPES = ("fp32", "bf16")
COMPILE_MODES = ("off", *TORCH_COMPILE_MODES)
# fields that may differ when a run resumes: where and how visibly it trains, not what it computes
# (checkpoints hold full, unsharded state, so a run may move between DDP and FSDP; micro-batches give the same
# gradient, so a run that ran out of memory resumes with more of them)
RESUME_FREE_FIELDS = ("device", "progress", "tensorboard", "parallel", "prefetch", "compile", "micro_batches")
_POSITIVE_INTS = ("max_steps", "batch_size", "micro_batches", "eval_every", "eval_batch_size", "log_every")
_NON_NEGATIVE_INTS = ("warmup_steps", "checkpoint_every", "seed")


@dataclass
class TrainConfig:
    """Optimisation: AdamW(lr, betas, weight_decay on >=2-D weights), linear warmup over
    ``warmup_steps`` then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``, gradient clipping at
    ``grad_clip`` (0: off). ``batch_size`` is global (split over data-parallel ranks). ``micro_batches``
    (gradient accumulation): each step's batch (this rank's share of ``batch_size``) is split along dim 0 into
    that many nearly equal parts, each run forward and backward in turn with its gradients summed, then one
    clip and one optimizer step: the gradient of the same global mean loss as one batch (the same numbers up
    to floating-point summation order) at the peak activation memory of one part. A batch with fewer rows
    than ``micro_batches`` is an error, as is a packed batch (one row of documents) split into more than one
    part. Evaluation every
    ``eval_every`` steps and at the end; the run stops early once the eval ``target_metric`` reaches
    ``target_value`` (>= for accuracies, <= for names containing "loss"; ``target_metric`` is one of
    :data:`EVAL_METRICS`). ``device``: "auto" (cuda when available), "cpu", "cuda" or "cuda:N".
    ``precision`` "auto" is bf16 autocast on CUDA and float32 on CPU.

    With several processes (torchrun), ``parallel`` picks how the model is spread: "ddp" (a full replica
    per process, gradients all-reduced) or "fsdp" (FSDP2 ``fully_shard``: parameters, gradients and
    optimizer state sharded over processes, each block then the root). FSDP's mixed precision:
    ``fsdp_param_dtype`` is the dtype blocks compute with after the all-gather ("auto": bf16 when the
    run's precision resolves to bf16, else float32; the sharded master weights and AdamW stay float32),
    ``fsdp_reduce_dtype`` the dtype gradients are reduce-scattered in. Alone, both strategies train the
    plain model. ``prefetch``: build the next batch on a background thread during each step (for data
    sources that cost host time on GPU runs; the numbers are the same either way). ``compile``: the training
    forward and backward through ``torch.compile`` in that mode ("off": eager; "reduce-overhead": the step's graphs
    replayed as CUDA graphs, no host time per kernel, for hosts slow next to their GPU; evaluation stays eager)."""

    max_steps: int = 1000
    batch_size: int = 32
    micro_batches: int = 1
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
    parallel: str = "ddp"
    fsdp_param_dtype: str = "auto"
    fsdp_reduce_dtype: str = "fp32"
    prefetch: bool = False
    compile: str = "off"

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            check_int(name, getattr(self, name), 1)
        for name in _NON_NEGATIVE_INTS:
            check_int(name, getattr(self, name), 0)
        self.lr = check_float("lr", self.lr, 0, low_open=True)
        self.weight_decay = check_float("weight_decay", self.weight_decay, 0)
        self.min_lr_ratio = check_float("min_lr_ratio", self.min_lr_ratio, 0, 1)
        self.grad_clip = check_float("grad_clip", self.grad_clip, 0)
        self.betas = check_pair("betas", self.betas, 0, 1)
        check_choice("target_metric", self.target_metric, EVAL_METRICS)
        if self.target_value is not None:
            # accuracies lie in [0, 1], losses in [0, inf): a target outside can never be reached
            high = None if "loss" in self.target_metric else 1
            self.target_value = check_float("target_value", self.target_value, 0, high)
        check_device("device", self.device)
        check_choice("precision", self.precision, PRECISIONS)
        check_bool("progress", self.progress)
        check_bool("tensorboard", self.tensorboard)
        check_choice("parallel", self.parallel, PARALLEL_STRATEGIES)
        check_choice("fsdp_param_dtype", self.fsdp_param_dtype, FSDP_PARAM_DTYPES)
        check_choice("fsdp_reduce_dtype", self.fsdp_reduce_dtype, FSDP_REDUCE_DTYPES)
        check_bool("prefetch", self.prefetch)
        check_choice("compile", self.compile, COMPILE_MODES)

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
        if not isinstance(d, dict):
            raise ConfigError(f"expected a mapping of TrainConfig fields, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ConfigError(f"unknown train config key(s) {unknown}; expected a subset of {sorted(fields)}")
        return cls(**d)

