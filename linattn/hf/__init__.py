"""Hugging Face integration: linattn models as transformers models, and FLA checkpoints imported into linattn.

Importing this package registers ``model_type = "linattn"`` with AutoConfig, AutoModelForCausalLM and
AutoModelForSequenceClassification, so ``AutoModelForCausalLM.from_pretrained(dir)`` loads what
``LinAttnForCausalLM.save_pretrained(dir)`` wrote (safetensors). It needs the ``hf`` extra
(``pip install "linattn[hf]"``); without it the import raises ImportError saying so.

- :class:`LinAttnConfig`, :class:`LinAttnForCausalLM`, :class:`LinAttnForSequenceClassification`,
  :class:`LinAttnCache` (transformers' ``generate`` on our recurrent states).
- :func:`from_fla` / :func:`save_fla`: FLA checkpoints (DeltaNet, Gated DeltaNet, GLA, Mamba2) to a linattn
  CausalLM, and a CausalLM back into FLA's layout (fla_layout.py, fla_config.py).
"""

from __future__ import annotations

from .deps import require

transformers = require("transformers")
require("safetensors")

from .cache import LinAttnCache  # noqa: E402
from .config import LinAttnConfig  # noqa: E402
from .fla import from_fla, save_fla  # noqa: E402
from .modeling import LinAttnForCausalLM, LinAttnForSequenceClassification  # noqa: E402


def _register() -> None:
    transformers.AutoConfig.register(LinAttnConfig.model_type, LinAttnConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(LinAttnConfig, LinAttnForCausalLM, exist_ok=True)
    transformers.AutoModelForSequenceClassification.register(LinAttnConfig, LinAttnForSequenceClassification,
                                                             exist_ok=True)


_register()

__all__ = ["LinAttnCache", "LinAttnConfig", "LinAttnForCausalLM", "LinAttnForSequenceClassification", "from_fla",
           "save_fla"]
