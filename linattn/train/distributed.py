"""Data-parallel plumbing: process-group setup (torchrun env or an existing group) and reductions.

NVLink multicast (NCCL's NVLS algorithms, PyTorch's symmetric-memory multicast, NVSHMEM's NVLS) stays off
unless the environment says otherwise: :data:`MULTICAST_OFF` is put into the environment (where a
variable is unset) before the process group starts. On shared multi-GPU hosts a program that creates
multicast objects can leave the host's GPUs unusable for everyone until the host is repaired. Data parallelism
does not need it: NCCL falls back to its ring and tree algorithms.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from linattn.errors import ConfigError
from linattn.validation import check_device

# set (when unset) before any process group starts; see the module docstring
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job: rank, world size and the device it trains on."""

    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str) -> torch.device:
    """"auto" is cuda when available, else cpu; else "cpu", "cuda" or "cuda:N" (ConfigError when this
    machine has no such device)."""
    check_device("device", device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the data-parallel job: reuse an initialised process group, or start one from torchrun's
    environment (WORLD_SIZE > 1; nccl on CUDA, gloo on CPU), or run alone."""
    dev = resolve_device(device)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and world_env > 1:
        keep_multicast_off()
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    if not dist.is_initialized():
        return DistInfo(0, 1, dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    return DistInfo(rank, world, dev)


@contextlib.contextmanager
def process_group_scope() -> Iterator[None]:
    """A process group started inside the block (``init_distributed`` under torchrun) is destroyed on leaving it;
    one that existed before is left alone. Reference cycles are collected first, so that the trainers and DDP
    reducers of the block that hold the group are freed before it: freed after it, a reducer's teardown can
    deadlock (gloo)."""
    existed = dist.is_available() and dist.is_initialized()
    try:
        yield
    finally:
        if not existed and dist.is_available() and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


def keep_multicast_off(environ: dict | None = None) -> dict:
    """Set every variable of :data:`MULTICAST_OFF` that ``environ`` (default ``os.environ``) leaves unset;
    a value the user set explicitly is kept. Returns what was set."""
    env = os.environ if environ is None else environ
    added = {k: v for k, v in MULTICAST_OFF.items() if k not in env}
    env.update(added)
    return added


def per_rank_batch(batch_size: int, world: int) -> int:
    """Rows of the global batch each of ``world`` processes trains on; ConfigError unless it divides:
    the global batch (and so the loss curve) stays that of a single process whatever the world size."""
    if batch_size % world:
        raise ConfigError(f"{batch_size} is not divisible by the number of processes {world}; the global batch "
                          f"is split evenly over processes (use a multiple of {world})", field="train.batch_size")
    return batch_size // world


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum ``values`` over ranks (a no-op alone)."""
    if info.world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier(info: DistInfo) -> None:
    if info.world > 1:
        dist.barrier()
