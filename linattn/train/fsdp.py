"""FSDP2 (``torch.distributed.fsdp.fully_shard``): sharding a model, and its full (unsharded) state.

Each block of the model's block lists (every ``nn.ModuleList`` found top-down, e.g. ``CausalLM.blocks``) is
sharded on its own, then the root (embeddings, final norm, head, and whatever else is left), so a forward
gathers one block's parameters at a time. Parameters become DTensors sharded over the processes; the
optimizer must be built after :func:`shard_model`.

Checkpoints hold the full state in the layout of a plain ``model.state_dict()`` and
``optimizer.state_dict()`` (state keyed by the parameter's index), gathered to rank 0, so a checkpoint
written under FSDP resumes under DDP, alone, or under FSDP over another number of processes, and the
other way round.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# gathered to rank 0 and moved to the CPU; every other rank gets an empty dict
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
# every rank holds the whole checkpoint (it read the file) and keeps its own shard of it
_SCATTER = StateDictOptions(full_state_dict=True)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded before the root: the items of every ``nn.ModuleList`` in ``model``, outermost
    lists only (a block's own inner lists stay inside the block's unit)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                units.extend(child)
            else:
                visit(child)

    visit(model)
    return units


def mixed_precision(param_dtype: str, reduce_dtype: str, autocast_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy from the config's names; param dtype "auto" follows the run's autocast dtype."""
    if param_dtype == "auto":
        param = autocast_dtype if autocast_dtype is not None else torch.float32
    else:
        param = _DTYPES[param_dtype]
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=_DTYPES[reduce_dtype])


def shard_model(model: nn.Module, policy: MixedPrecisionPolicy) -> nn.Module:
    """Shard ``model`` in place over the default process group (each block, then the root); returns it."""
    for unit in shard_units(model):
        fully_shard(unit, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of ``optimizer``'s parameters, in the order a plain ``state_dict()`` numbers them
    (named_parameters drops tied duplicates, as torch.distributed.checkpoint does)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_model_state(model: nn.Module) -> dict:
    """The unsharded ``state_dict`` of a sharded ``model`` on rank 0 (CPU tensors); {} elsewhere. Collective."""
    return get_model_state_dict(model, options=_GATHER)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The unsharded optimizer state on rank 0 in ``optimizer.state_dict()``'s layout; {} elsewhere. Collective."""
    state = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if not state:
        return {}
    index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optimizer_state: dict) -> None:
    """Load full (unsharded) states, as :func:`full_model_state` and :func:`full_optimizer_state` give, into
    a sharded ``model`` and its ``optimizer``; each rank keeps its shard. Collective."""
    names = _param_names(model, optimizer)
    saved = sum(len(g["params"]) for g in optimizer_state["param_groups"])
    if len(names) != saved:
        raise ValueError(f"the checkpoint's optimizer has {saved} parameters, this one {len(names)}")
    by_name = {"state": {names[i]: value for i, value in optimizer_state["state"].items()},
               "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                for group in optimizer_state["param_groups"]]}
    set_model_state_dict(model, model_state, options=_SCATTER)
    set_optimizer_state_dict(model, optimizer, by_name, options=_SCATTER)
