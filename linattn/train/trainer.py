"""The Trainer: AdamW + warmup/cosine, clipping, AMP, eval, early stop, atomic checkpoints, exact resume, DDP/FSDP2.

Data: ``train_data.batch(index, rank, world) -> (inputs, targets)`` returns this rank's share of global
batch ``index`` (:class:`linattn.data.TaskStream` does), so the data position is the step counter and a
resumed or data-parallel run sees exactly the batches of an uninterrupted single-process run. Inputs may be
:class:`linattn.data.packed.PackedInputs` (documents packed along one row): the model is then called with their
``cu_seqlens``. Loss:
mean token cross-entropy over the labelled positions of the global batch (targets != -100). With
``TrainConfig.micro_batches`` > 1 each rank's batch runs forward and backward in that many parts of rows whose
gradients are summed (each part's loss divided by the whole step's count), then one optimizer step.

Several processes (torchrun): DDP or FSDP2 (``TrainConfig.parallel``). Checkpoints hold the full model and
optimizer state whatever the strategy, so a run resumes on another number of processes.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from linattn.compile_modes import torch_compile_mode
from linattn.data.packed import PackedInputs
from linattn.errors import ConfigError, UserError
from linattn.ops.common.values import value_checks
from linattn.train.checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from linattn.train.config import TrainConfig
from linattn.train.distributed import DistInfo, all_reduce_sum, barrier, init_distributed, per_rank_batch
from linattn.train.fsdp import full_model_state, full_optimizer_state, load_full_state, mixed_precision, shard_model
from linattn.train.metrics import MetricsLog, labelled, logits_of, sequence_correct, token_stats
from linattn.train.prefetch import Prefetcher
from linattn.train.resume import format_changes, refuse_changes, resume_changes
from linattn.train.schedule import make_scheduler
from linattn.train.step_values import StepValues, step_values

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.jsonl"


class BatchSource(Protocol):
    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]: ...


def fused_optimizer(device: torch.device, sharded: bool) -> bool:
    """Whether the Trainer's AdamW is the fused one: on CUDA, unless FSDP shards the parameters."""
    return device.type == "cuda" and not sharded


class NonFiniteLossError(UserError, RuntimeError):
    """Training produced a NaN/Inf loss or gradient; the last good checkpoint is kept. A user error: the
    remedy is in the config (lr, warmup, clipping)."""


@dataclass
class TrainResult:
    """How a fit ended: status is "completed", "target_reached" or "interrupted" (deadline)."""

    status: str
    step: int
    metrics: dict = field(default_factory=dict)
    best: float | None = None
    wall_s: float = 0.0


def _is_lower_better(metric: str) -> bool:
    return "loss" in metric


class Trainer:
    """Train ``model`` on ``train_data`` under ``config``; evaluate on the fixed ``eval_data``
    ``(inputs, targets)``. With ``out_dir`` it writes ``checkpoint.pt`` and ``metrics.jsonl`` there and
    :meth:`fit` resumes from an existing checkpoint, only under the config it was written with
    (:mod:`linattn.train.resume`): ``run_config`` (the whole run's config, optional) is stored beside
    ``config`` and compared too; ``override_config`` resumes under changed values, reporting each.
    Inside a torchrun job (or an initialised process group) it trains data-parallel; rank 0 writes the files."""

    def __init__(self, model: nn.Module, train_data: BatchSource, config: TrainConfig,
                 eval_data: tuple[torch.Tensor, torch.Tensor] | None = None, out_dir: str | Path | None = None,
                 on_eval: Callable[[int, dict], None] | None = None, *, run_config: dict | None = None,
                 override_config: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        if not callable(getattr(train_data, "batch", None)):
            raise TypeError("train_data must have a batch(index, rank, world) method (e.g. linattn.data.TaskStream)")
        if eval_data is not None and (len(eval_data) != 2 or eval_data[0].shape[0] != eval_data[1].shape[0]):
            raise ValueError("eval_data must be (inputs, targets) with the same number of rows")
        if run_config is not None and not isinstance(run_config, dict):
            raise TypeError(f"run_config must be None or a dict, got {type(run_config).__name__}")
        self.config, self.train_data, self.eval_data, self.on_eval = config, train_data, eval_data, on_eval
        self.run_config, self.override_config = run_config, bool(override_config)
        self.dist: DistInfo = init_distributed(config.device)
        per_rank_batch(config.batch_size, self.dist.world)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        use_bf16 = config.precision == "bf16" or (config.precision == "auto" and self.dist.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        self.model = model.to(self.dist.device)
        self.ddp = self.model  # what the training forward calls: the DDP wrapper, or the (sharded) model itself
        self.sharded = self.dist.world > 1 and config.parallel == "fsdp"
        if self.sharded:  # in place: the parameters become DTensor shards, so the optimizer is built after
            shard_model(self.model, mixed_precision(config.fsdp_param_dtype, config.fsdp_reduce_dtype,
                                                    self.autocast_dtype))
        elif self.dist.world > 1:
            ids = [self.dist.device.index] if self.dist.device.type == "cuda" else None
            self.ddp = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        # a model that can return a decoding cache (CausalLM) is asked for none: training and evaluation read only
        # the logits
        takes_use_cache = "use_cache" in inspect.signature(self.model.forward).parameters
        self._forward_kwargs = {"use_cache": False} if takes_use_cache else {}
        # what a training step calls: the same module, compiled when asked (evaluation calls the model eagerly)
        self.forward = self.ddp if config.compile == "off" else torch.compile(
            self.ddp, mode=torch_compile_mode(config.compile))
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        # the fused AdamW (one kernel per step) can skip a non-finite step's update on the device, so a step's loss is
        # read without waiting for it (_train_step); FSDP's sharded parameters keep the default implementation
        self._fused = fused_optimizer(self.dist.device, self.sharded)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=config.betas, fused=self._fused)
        self.scheduler = self._make_scheduler()
        self.step, self.best, self.last_eval, self.elapsed = 0, None, {}, 0.0
        # on the device: whether a step of this fit was non-finite (its update, and every later one, is skipped)
        self._failed = torch.zeros((), dtype=torch.bool, device=self.dist.device)
        self._check_values = "strict"
        self._step_tokens = 0  # input tokens of the last step's global batch
        self._prefetcher: Prefetcher | None = None  # during fit() with config.prefetch
        self.checkpoint_step: int | None = None

    # -- files -------------------------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / CHECKPOINT_NAME

    def _full_state(self) -> tuple[dict, dict]:
        """The unsharded model and optimizer state dicts (on rank 0 under FSDP, where gathering them is
        collective: every rank calls this)."""
        if self.sharded:
            return full_model_state(self.model), full_optimizer_state(self.model, self.optimizer)
        return self.model.state_dict(), self.optimizer.state_dict()

    def _save(self) -> None:
        if self.checkpoint_path is None:
            self.checkpoint_step = self.step
            return
        model_state, optimizer_state = self._full_state()
        if self.dist.is_main:
            save_checkpoint(self.checkpoint_path, {
                "model": model_state, "optimizer": optimizer_state,
                "scheduler": self.scheduler.state_dict(), "rng": rng_state(), "step": self.step,
                "data_position": self.step, "best": self.best, "last_eval": self.last_eval,
                "elapsed": self.elapsed, "config": self.config.to_dict(), "run_config": self.run_config,
                "world": self.dist.world})
        self.checkpoint_step = self.step
        barrier(self.dist)

    def _make_scheduler(self, start_step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
        cfg = self.config
        return make_scheduler(self.optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, start_step)

    def _restore(self) -> None:
        path = self.checkpoint_path
        ckpt = load_checkpoint(path)
        # compared before anything is loaded: a refused resume leaves the trainer as built
        changes = resume_changes(ckpt, self.config.to_dict(), self.run_config)
        if changes and not self.override_config:
            refuse_changes(path, changes)
        try:
            if self.sharded:
                load_full_state(self.model, self.optimizer, ckpt["model"], ckpt["optimizer"])
            else:
                self.model.load_state_dict(ckpt["model"])
                self.optimizer.load_state_dict(ckpt["optimizer"])
                for group in self.optimizer.param_groups:  # the saved groups name the implementation of the run
                    group["fused"] = self._fused          # that wrote them (e.g. on another device): keep this one's
                    group["foreach"] = None if self._fused else group.get("foreach")
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: {exc}") from exc
        self.step = self.checkpoint_step = int(ckpt["data_position"])
        if changes:
            self._apply_config()
            if self.dist.is_main:
                print(f"resuming {path} at step {self.step} with the config overridden: {format_changes(changes)}",
                      file=sys.stderr, flush=True)
        else:
            self.scheduler.load_state_dict(ckpt["scheduler"])
        set_rng_state(ckpt["rng"])
        self.best, self.last_eval, self.elapsed = ckpt["best"], ckpt["last_eval"], ckpt["elapsed"]

    def _apply_config(self) -> None:
        """Put this config's optimiser settings into the restored optimizer (which carries the checkpoint's)
        and restart the schedule at the restored step."""
        cfg = self.config
        for i, group in enumerate(self.optimizer.param_groups):
            group.update(initial_lr=cfg.lr, betas=cfg.betas)
            if i == 0:  # the decayed group (>= 2-D weights); the other never decays
                group["weight_decay"] = cfg.weight_decay
        self.scheduler = self._make_scheduler(self.step)

    # -- compute -----------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.autocast_dtype)

    def _checks_on_device(self) -> bool:
        """Whether a non-finite step is caught on the device (the fused optimizer skips its update there) and its
        values read later, instead of read before the update with a host synchronisation."""
        return all(group.get("fused") for group in self.optimizer.param_groups)

    def _train_step(self) -> StepValues:
        """Queue one step; returns its loss and gradient norm, which may still be on their way to the host.
        With checks on the device, read them with :meth:`_checked`, which raises for a non-finite step; otherwise
        they were read and checked before the update."""
        if self._prefetcher is not None:
            x, y = self._prefetcher.get(self.step)
        else:
            x, y = self.train_data.batch(self.step, self.dist.rank, self.dist.world)
        x, y = to_device(x, self.dist.device), to_device(y, self.dist.device)
        self._step_tokens = x.numel() * self.dist.world  # every rank's batch has this shape
        parts = split_batch(x, y, self.config.micro_batches)
        # every micro-batch's loss is divided by the labelled targets of the whole step on every rank, so the summed
        # gradients are those of the global mean; the count depends on the targets only (token_stats' rule), so it
        # is known before any backward pass
        total_count = all_reduce_sum(labelled(y).sum(), self.dist).clamp_min(1)
        self.ddp.train()
        self.optimizer.zero_grad(set_to_none=True)
        # DDP all-reduces the gradients once, in the last micro-batch's backward; the others only accumulate them.
        # FSDP reduce-scatters after each one, so the accumulated gradients stay sharded (what micro-batches save)
        skip_sync = self.ddp.no_sync if isinstance(self.ddp, nn.parallel.DistributedDataParallel) else None
        ces = []
        for i, (x_part, y_part) in enumerate(parts):
            last = i == len(parts) - 1
            with contextlib.nullcontext() if last or skip_sync is None else skip_sync():
                ces.append(self._forward_backward(x_part, y_part, total_count))
        self._check_values = "auto"
        ce = all_reduce_sum(torch.stack(ces).sum(), self.dist)
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a replicated DTensor holding the global norm
            grad_norm = grad_norm.full_tensor()
        stats = torch.stack([(ce / total_count).float(), grad_norm.float()])
        on_device = self._checks_on_device()
        values = step_values(self.step + 1, stats, wait=not on_device)
        if on_device:
            # a non-finite step updates nothing, nor does any later one until the host has read it and stopped
            self._failed = self._failed | ~torch.isfinite(stats).all()
            self.optimizer.found_inf = self._failed.float()
        else:  # one host synchronisation: a non-finite step stops before its update
            self.optimizer.found_inf = None
            self._checked(values)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return values

    def _checked(self, values: StepValues) -> tuple[float, float]:
        """``values`` read; a non-finite one raises :class:`NonFiniteLossError`, after putting the step counter and
        schedule back to the last good step (checks on the device: the steps since updated nothing)."""
        loss, grad_norm = values.read()
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return loss, grad_norm
        if self.step >= values.step:
            self.step = values.step - 1
            self.scheduler = self._make_scheduler(self.step)
        if not math.isfinite(loss):
            self._non_finite("loss", loss, values.step)
        self._non_finite("gradient norm", grad_norm, values.step)

    def _forward_backward(self, x: torch.Tensor | PackedInputs, y: torch.Tensor, total_count: torch.Tensor
                          ) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss divided by the step's ``total_count`` of labelled
        targets; returns its summed cross-entropy, detached (so its logits and graph are freed on return)."""
        # range checks of CUDA inputs (host synchronisations) run on the first step of a fit only
        with value_checks(self._check_values), self._autocast():
            if isinstance(x, PackedInputs):  # documents packed along one row: the model restarts at each offset
                out = self.forward(x.input_ids, cu_seqlens=x.cu_seqlens, **self._forward_kwargs)
            else:
                out = self.forward(x, **self._forward_kwargs)
            ce, _, _ = token_stats(logits_of(out), y)
        # DDP averages gradients over ranks, so scale by world: the gradient is that of the global mean.
        loss = ce / total_count * self.dist.world
        if not loss.requires_grad:  # e.g. a forward that returned a constant: nothing to differentiate
            value = float(ce / total_count)
            if not math.isfinite(value):
                self._non_finite("loss", value, self.step + 1)
            raise RuntimeError("the loss does not depend on any trainable parameter (no grad_fn); "
                               "check the model's forward")
        loss.backward()
        return ce.detach()

    def _non_finite(self, what: str, value: float, step: int) -> None:
        where = "no checkpoint was written"
        if self.checkpoint_step is not None and self.checkpoint_path is not None:
            where = f"the last good checkpoint ({self.checkpoint_path}, step {self.checkpoint_step}) is kept"
        raise NonFiniteLossError(f"non-finite {what} ({value}) at step {step}; training stopped and {where}. "
                                 f"Lower the lr, raise warmup or clip harder.")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss, token accuracy and whole-sequence accuracy on ``eval_data`` (rows split over ranks)."""
        x_all, y_all = self.eval_data
        n_all = x_all.shape[0]
        x_all, y_all = x_all[self.dist.rank::self.dist.world], y_all[self.dist.rank::self.dist.world]
        self.ddp.eval()
        sums = torch.zeros(5, dtype=torch.float64, device=self.dist.device)
        bs = self.config.eval_batch_size
        # FSDP's forward is collective: every rank runs as many batches as the rank with the most rows
        # (an extra batch is a stand-in row whose stats are dropped)
        rows = -(-n_all // self.dist.world) if self.sharded else x_all.shape[0]
        for i in range(0, rows, bs):
            x, y = x_all[i:i + bs].to(self.dist.device), y_all[i:i + bs].to(self.dist.device)
            real = x.shape[0]
            if real == 0:
                x = self.eval_data[0][:1].to(self.dist.device)
            with self._autocast():
                logits = logits_of(self.model(x, **self._forward_kwargs))
            if real == 0:
                continue
            ce, count, correct = token_stats(logits, y)
            sums += torch.stack([ce.double(), count.double(), correct.double(),
                                 sequence_correct(logits, y).double(), torch.tensor(float(x.shape[0]))
                                 .double().to(sums.device)])
        sums = all_reduce_sum(sums, self.dist)
        n_tok = max(float(sums[1]), 1.0)
        return {"loss": float(sums[0]) / n_tok, "accuracy": float(sums[2]) / n_tok,
                "seq_accuracy": float(sums[3]) / max(float(sums[4]), 1.0)}

    def _reached_target(self, metrics: dict) -> bool:
        cfg = self.config
        if cfg.target_value is None:
            return False
        if cfg.target_metric not in metrics:
            raise ValueError(f"target_metric {cfg.target_metric!r} is not an eval metric; expected one of "
                             f"{sorted(metrics)}")
        value = metrics[cfg.target_metric]
        return value <= cfg.target_value if _is_lower_better(cfg.target_metric) else value >= cfg.target_value

    def _update_best(self, metrics: dict) -> None:
        value = metrics.get(self.config.target_metric)
        if value is None:
            return
        lower = _is_lower_better(self.config.target_metric)
        if self.best is None or (value < self.best if lower else value > self.best):
            self.best = value

    # -- the loop ----------------------------------------------------------------------------------------
    def fit(self, deadline: float | None = None) -> TrainResult:
        """Train to ``max_steps`` (or the target metric), resuming from ``out_dir/checkpoint.pt`` when it
        exists. ``deadline`` (a ``time.time()`` value): checkpoint and return "interrupted" once passed."""
        cfg = self.config
        if self.out_dir is not None and self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        log = MetricsLog(self.out_dir / METRICS_NAME if self.out_dir is not None and self.dist.is_main else None,
                         self.out_dir / "tensorboard" if cfg.tensorboard and self.dist.is_main else None)
        if self.checkpoint_path is not None and self.checkpoint_path.exists():
            self._restore()
            if self.dist.is_main:
                log.truncate_after(self.step)
        else:
            torch.manual_seed(cfg.seed)
            log.truncate_after(-1)
        status = "completed" if self.step >= cfg.max_steps else "running"
        if status == "running" and self.last_eval and self._reached_target(self.last_eval):
            status = "target_reached"
        bar = tqdm(total=cfg.max_steps, initial=self.step, disable=not (cfg.progress and self.dist.is_main),
                   dynamic_ncols=True, leave=False)
        t0 = time.time() - self.elapsed
        self._check_values = "strict"
        self._failed = torch.zeros((), dtype=torch.bool, device=self.dist.device)  # (an earlier fit may have failed)
        if cfg.prefetch and status == "running":
            self._prefetcher = Prefetcher(self.train_data, self.dist.rank, self.dist.world,
                                          pin=self.dist.device.type == "cuda")
        try:
            status = self._loop(status, log, bar, deadline, t0)
        finally:
            if self._prefetcher is not None:
                self._prefetcher.close()
                self._prefetcher = None
        bar.close()
        log.close()
        return TrainResult(status, self.step, dict(self.last_eval), self.best, round(self.elapsed, 3))

    def _loop(self, status: str, log: MetricsLog, bar: tqdm, deadline: float | None, t0: float) -> str:
        """Train until ``status`` is no longer "running"; returns the final status."""
        cfg = self.config
        counts = {"tokens": 0, "train_s": 0.0}  # since the last train record: its throughput counts training steps only
        pending: list[tuple[StepValues, float]] = []  # the last step's values and learning rate, not yet read

        def read_pending() -> None:
            """Check (raises for a non-finite step) and log the step whose values are pending."""
            while pending:
                values, lr = pending.pop()
                loss, grad_norm = self._checked(values)
                if values.step % cfg.log_every == 0 or values.step == cfg.max_steps:
                    bar.set_postfix(loss=f"{loss:.4f}")
                    log.write({"step": values.step, "split": "train", "loss": loss, "grad_norm": grad_norm, "lr": lr,
                               "time": round(self.elapsed, 3),
                               "tokens_per_s": round(counts["tokens"] / max(counts["train_s"], 1e-9), 1)})
                    counts.update(tokens=0, train_s=0.0)

        while status == "running":
            t_step = time.perf_counter()
            values = self._train_step()
            lr = self.scheduler.get_last_lr()[0]
            # the previous step's values: read once this step is queued, so the GPU is never left without work
            read_pending()
            pending.append((values, lr))
            counts["train_s"] += time.perf_counter() - t_step
            counts["tokens"] += self._step_tokens
            self.elapsed = time.time() - t0
            bar.update(1)
            done = self.step >= cfg.max_steps
            evaluating = self.eval_data is not None and (self.step % cfg.eval_every == 0 or done)
            if evaluating:
                read_pending()  # what is evaluated (or saved, below) is known to be good first
                self.last_eval = {"step": self.step, **self.evaluate()}
                self._update_best(self.last_eval)
                log.write({"split": "eval", **self.last_eval, "time": round(self.elapsed, 3)})
                if self.on_eval is not None and self.dist.is_main:
                    self.on_eval(self.step, self.last_eval)
                if self._reached_target(self.last_eval):
                    status = "target_reached"
            if done and status == "running":
                status = "completed"
            if status != "running" or self.step % cfg.checkpoint_interval == 0:
                read_pending()
                self._save()
            if status == "running" and deadline is not None and time.time() >= deadline:
                read_pending()
                self._save()
                status = "interrupted"
        return status


def to_device(x: torch.Tensor | PackedInputs, device: torch.device) -> torch.Tensor | PackedInputs:
    """``x`` on ``device``; a CPU tensor goes to CUDA through pinned memory without blocking, so the
    copy does not wait for the GPU work queued before it (packed inputs: their ids; the offsets stay on the CPU,
    where the model reads them without a device synchronisation)."""
    if isinstance(x, PackedInputs):
        return PackedInputs(to_device(x.input_ids, device), x.cu_seqlens)
    if device.type == "cuda" and x.device.type == "cpu":
        return (x if x.is_pinned() else x.pin_memory()).to(device, non_blocking=True)
    return x.to(device)


def split_batch(x: torch.Tensor | PackedInputs, y: torch.Tensor, parts: int
                ) -> list[tuple[torch.Tensor | PackedInputs, torch.Tensor]]:
    """``(x, y)`` split along dim 0 into ``parts`` micro-batches of nearly equal rows (the first ones a row
    larger; views, no copies). Raises :class:`ConfigError` (``train.micro_batches``) before any compute when the
    batch has fewer rows than ``parts``, or is packed (one row of documents) and ``parts`` > 1."""
    if parts == 1:
        return [(x, y)]
    if isinstance(x, PackedInputs):
        raise ConfigError(f"packed batches (documents packed along one row with cu_seqlens) are not split into "
                          f"micro-batches, got {parts}; use 1", field="train.micro_batches")
    rows = x.shape[0]
    if rows < parts:
        raise ConfigError(f"this process's batch has {rows} rows, fewer than the {parts} micro-batches it is split "
                          f"into (each needs a row; batch_size is split over the processes first); use at most "
                          f"{rows}", field="train.micro_batches")
    return list(zip(torch.tensor_split(x, parts), torch.tensor_split(y, parts), strict=True))


def read_metrics(out_dir: str | Path) -> list[dict]:
    """The records of ``out_dir/metrics.jsonl``."""
    path = Path(out_dir) / METRICS_NAME
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
