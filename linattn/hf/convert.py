"""``linattn convert-fla SRC OUT``: an FLA checkpoint directory to a linattn transformers checkpoint directory
(config.json with model_type "linattn", model.safetensors), loadable with AutoModelForCausalLM after
``import linattn.hf``."""

from __future__ import annotations

from pathlib import Path

import torch

from .fla import from_fla, read_fla_checkpoint
from .fla_config import TOKEN_FIELDS, with_defaults
from .modeling import LinAttnForCausalLM


def convert_fla(src: str | Path, out: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Convert the FLA checkpoint in ``src`` and save it with save_pretrained into ``out``; the special token ids
    (bos, eos, pad) are carried over. ``dtype``: of the saved weights (default float32)."""
    model = from_fla(src, dtype=dtype)
    fla_config, _ = read_fla_checkpoint(src)
    tokens = {k: v for k, v in with_defaults(fla_config).items() if k in TOKEN_FIELDS}
    LinAttnForCausalLM.from_causal_lm(model, **tokens).save_pretrained(out)
    return Path(out)
