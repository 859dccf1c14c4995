"""from_fla: an FLA checkpoint directory (config.json and weights, as FLA's models save them) to a linattn
CausalLM; save_fla: a linattn CausalLM into that layout (which FLA's from_pretrained reads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from linattn.errors import CheckpointError, MissingFileError
from linattn.models import CausalLM

from .deps import require
from .fla_config import fla_config_from_model, model_config_from_fla, with_defaults
from .fla_layout import fla_state_from_linattn, linattn_state_from_fla


def read_fla_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, state dict) of a checkpoint directory: model.safetensors, its sharded form
    (model.safetensors.index.json) or pytorch_model.bin."""
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"path must be a checkpoint directory with config.json, got {str(path)!r}")
    if not (path / "config.json").is_file():
        raise MissingFileError(f"{path}: no config.json (an FLA checkpoint directory holds config.json and weights)")
    config = json.loads((path / "config.json").read_text())
    load_file = require("safetensors.torch").load_file
    if (path / "model.safetensors").is_file():
        state = load_file(path / "model.safetensors")
    elif (path / "model.safetensors.index.json").is_file():
        shards = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
        state = {k: v for shard in shards for k, v in load_file(path / shard).items()}
    elif (path / "pytorch_model.bin").is_file():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise MissingFileError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")
    return config, state


def from_fla(path: str | Path, *, dtype: torch.dtype | None = None) -> CausalLM:
    """The linattn CausalLM of an FLA checkpoint directory saved by FLA's DeltaNetForCausalLM,
    GatedDeltaNetForCausalLM, GLAForCausalLM or Mamba2ForCausalLM (``save_pretrained``), in eval mode. Parameters
    are copied exactly (Mamba2's fused projections split per stream); ``dtype`` (default float32) is the model's.
    Options without an exact linattn equivalent raise ValueError naming the config field."""
    config, state = read_fla_checkpoint(path)
    model_config = model_config_from_fla(config)
    model = CausalLM(model_config)
    expected = model.state_dict()
    if model_config.tie_embeddings:
        expected.pop("lm_head.weight")  # the same tensor as embed.weight
    try:
        converted = linattn_state_from_fla(state, with_defaults(config), model_config, expected)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc.args[0]}") from None
    model.load_state_dict(converted, strict=not model_config.tie_embeddings)
    return model.to(dtype or torch.float32).eval()


def save_fla(model: CausalLM, path: str | Path, *, n_groups: int | None = None,
             dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` as FLA would save it (config.json, model.safetensors) into directory ``path``: the inverse
    of :func:`from_fla`, for models FLA's layers can express (ValueError naming what cannot be). ``n_groups``:
    Mamba2's groups when the model has no group norm. ``dtype``: of the saved tensors (default: the model's)."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"model must be a linattn CausalLM, got {type(model).__name__}")
    fla_config = fla_config_from_model(model.config, n_groups=n_groups)
    state = fla_state_from_linattn(model.state_dict(), fla_config, model.config)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")  # as transformers saves a tied head: only the embedding
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fla_config, indent=2))
    require("safetensors.torch").save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path
