"""Data-parallel plumbing: process-group setup (torchrun env or an existing group) and reductions."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from linattn.validation import check_device


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
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    if not dist.is_initialized():
        return DistInfo(0, 1, dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if dev.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    return DistInfo(rank, world, dev)


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum ``values`` over ranks (a no-op alone)."""
    if info.world > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier(info: DistInfo) -> None:
    if info.world > 1:
        dist.barrier()
