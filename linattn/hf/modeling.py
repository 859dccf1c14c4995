"""transformers models around linattn's CausalLM and SequenceClassifier.

``LinAttnForCausalLM`` holds a :class:`~linattn.models.CausalLM` as ``self.model`` (parameter names
``model.<linattn name>``), so save_pretrained / from_pretrained write and read our own state dict as safetensors,
and transformers' ``generate`` decodes through :class:`LinAttnCache` on the mixers' O(1) recurrent states (single
tokens go through each op's step function, as in ``CausalLM.forward``). ``LinAttnForSequenceClassification``
holds a :class:`~linattn.models.SequenceClassifier` with transformers' ``num_labels`` classes.

Not supported: padding inside a causal LM batch (an ``attention_mask`` with zeros: left-padded prompts would
run their padding through the recurrent states; linattn's own ``CausalLM.generate`` takes prompts of different
lengths), ``inputs_embeds``, hidden states or attentions as outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from linattn.layers.shortconv import ShortConv, fixed_kernel
from linattn.models import CausalLM, SequenceClassifier

from .cache import LinAttnCache
from .config import LinAttnConfig
from .deps import require

transformers = require("transformers")
PreTrainedModel = transformers.PreTrainedModel
GenerationMixin = transformers.GenerationMixin
outputs = require("transformers.modeling_outputs")

# what transformers may pass that a linattn model has no use for: positions live in the cache, and the loss
# normalisation of a trainer is applied by the caller
IGNORED_KWARGS = ("position_ids", "cache_position", "num_items_in_batch", "next_sequence_length")


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.pop(name, None):
            raise ValueError(f"{name}=True is not supported by linattn models (they return logits and the cache)")
    if kwargs.pop("inputs_embeds", None) is not None:
        raise ValueError("inputs_embeds is not supported by linattn models; pass input_ids")
    unknown = sorted(set(kwargs) - set(IGNORED_KWARGS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")


class LinAttnPreTrainedModel(PreTrainedModel):
    """Shared transformers plumbing. The linattn modules initialise their own parameters when built (Mamba2's
    A_log and dt_bias, ShortConv kernels, ...), so transformers' weight initialisation leaves them alone; it
    only refills the fixed ShortConv kernels, which are not saved."""

    config_class = LinAttnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # the cache is a recurrent state: no assisted decoding, no cropping
    _no_split_modules = ["Block"]
    _supports_cache_class = True

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        # transformers builds the model without data and then asks every module not read from the checkpoint to
        # initialise itself; the fixed ShortConv kernels (shift, identity) are buffers outside the checkpoint
        if isinstance(module, ShortConv) and module.mode != "learned":
            module.weight.copy_(fixed_kernel(module.dim, module.kernel_size, module.mode))

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        self.model.embed = value


class LinAttnForCausalLM(LinAttnPreTrainedModel, GenerationMixin):
    """A linattn CausalLM for transformers: ``model(input_ids, past_key_values=None, labels=None)`` returns
    ``CausalLMOutputWithPast`` (logits [B, T, vocab], the :class:`LinAttnCache`, the next-token loss when
    ``labels`` are given, -100 ignored); ``generate`` works with greedy search, sampling and beam search."""

    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config: LinAttnConfig) -> None:
        super().__init__(config)
        self.model = CausalLM(config.model_config())
        self.post_init()

    @classmethod
    def from_causal_lm(cls, model: CausalLM, **config_kwargs: Any) -> LinAttnForCausalLM:
        """Wrap an existing CausalLM (its parameters are shared, not copied); config_kwargs go to LinAttnConfig
        (e.g. eos_token_id)."""
        if not isinstance(model, CausalLM):
            raise TypeError(f"model must be a linattn CausalLM, got {type(model).__name__}")
        with torch.device("meta"):  # the wrapper's own CausalLM is replaced at once: do not allocate it
            wrapper = cls(LinAttnConfig.from_model_config(model.config, **config_kwargs))
        wrapper.model = model
        return wrapper

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own LinAttnCache at the first forward

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.model.lm_head

    def set_output_embeddings(self, value: torch.nn.Linear) -> None:
        self.model.lm_head = value

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, past_key_values: LinAttnCache | None = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool = True,
                                      logits_to_keep: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """The tokens the cache has not seen yet (all of them at the first step, then the last one)."""
        seen = past_key_values.get_seq_length() if isinstance(past_key_values, LinAttnCache) else 0
        inputs = {"input_ids": input_ids[:, seen:], "past_key_values": past_key_values, "use_cache": use_cache,
                  "attention_mask": attention_mask if seen == 0 else None}
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: LinAttnCache | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0, return_dict: bool | None = None,
                **kwargs: Any) -> Any:
        _check_kwargs(kwargs)
        if input_ids is None:
            raise ValueError("input_ids is required: an integer tensor [B, T]")
        if past_key_values is not None and not isinstance(past_key_values, LinAttnCache):
            raise TypeError(f"past_key_values must be None or a LinAttnCache (what this model returns), got "
                            f"{type(past_key_values).__name__}")
        started = past_key_values is not None and past_key_values.get_seq_length() > 0
        if attention_mask is not None and not started and not bool((attention_mask != 0).all()):
            raise ValueError("attention_mask marks padding, which linattn's causal LMs do not take (the padding would "
                             "enter the recurrent states): pass prompts of one length, or use linattn's own "
                             "CausalLM.generate, which takes a list of prompts of any lengths")
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True)) and not self.training
        cache = past_key_values.layer_caches if started else None
        logits, new_cache = self.model(input_ids, cache, use_cache=use_cache)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        if isinstance(logits_to_keep, int):
            logits = logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits
        else:
            logits = logits[:, logits_to_keep]
        if use_cache:
            past_key_values = past_key_values if past_key_values is not None else LinAttnCache()
            past_key_values.layer_caches = new_cache
        else:
            past_key_values = None
        out = outputs.CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values)
        return out if return_dict is not False else out.to_tuple()


class LinAttnForSequenceClassification(LinAttnPreTrainedModel):
    """A linattn SequenceClassifier for transformers: ``num_labels`` classes, config ``pooling`` and
    ``bidirectional``; ``attention_mask`` marks the real tokens of right-padded rows. ``labels``: class ids
    (cross-entropy) or, as floats [B, num_labels], multi-label targets (binary cross-entropy)."""

    def __init__(self, config: LinAttnConfig) -> None:
        super().__init__(config)
        self.model = SequenceClassifier(config.model_config(), config.num_labels, pooling=config.pooling,
                                        bidirectional=config.bidirectional)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_dict: bool | None = None, **kwargs: Any) -> Any:
        _check_kwargs(kwargs)
        if input_ids is None:
            raise ValueError("input_ids is required: an integer tensor [B, T]")
        mask = None if attention_mask is None else attention_mask.to(torch.bool)
        logits = self.model(input_ids, mask=mask)
        loss = None
        if labels is not None:
            if labels.is_floating_point():
                loss = F.binary_cross_entropy_with_logits(logits.float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels.to(logits.device))
        out = outputs.SequenceClassifierOutput(loss=loss, logits=logits)
        return out if return_dict is not False else out.to_tuple()
