"""transformers models around linattn's CausalLM and SequenceClassifier.

``LinAttnForCausalLM`` holds a :class:`~linattn.models.CausalLM` as ``self.model`` (parameter names
``model.<linattn name>``), so save_pretrained / from_pretrained write and read our own state dict as safetensors,
and transformers' ``generate`` decodes through :class:`LinAttnCache` on the mixers' O(1) recurrent states (single
tokens go through each op's step function, as in ``CausalLM.forward``). ``LinAttnForSequenceClassification``
holds a :class:`~linattn.models.SequenceClassifier` with transformers' ``num_labels`` classes.

Padding (``LinAttnForCausalLM``): in a forward that starts a cache (none passed, or an empty one),
``attention_mask`` [B, T] (1: token, 0: padding) may pad each row on the left (``0 ... 0 1 ... 1``, what
``generate`` needs) or on the right. Each row then runs on its real tokens alone, as ``CausalLM.generate``
prefills prompts of different lengths: no padding enters a state or a ShortConv, and positions (RoPE) count the
row's own tokens (``position_ids``, which transformers derives from the mask, are ignored). So a row's logits at
its tokens and its cache equal those of the row run alone; the logits at padding are 0, and with ``labels`` the
loss counts only predictions of a real token from a real token (labels at padding need not be -100). The
cache keeps the rows of each real length in one group, and every later forward runs once per group. Without a
cache (``use_cache=False``, as in training) the rows run packed in one forward (``CausalLM``'s attention_mask).
Tokens that continue a cache are real in every row: ``attention_mask`` is then transformers' growing mask
[B, seen + T] (its first columns repeating the padding the cache saw, ones after) or [B, T] of ones.

Not supported, each raising ValueError naming ``attention_mask`` before any compute: padding between a row's
tokens, a row without tokens, zeros among tokens that continue a cache, a mask that does not repeat the padding
the cache saw. Also not supported: ``inputs_embeds``, hidden states or attentions as outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from linattn.layers.cache import LayerCache
from linattn.layers.shortconv import ShortConv, fixed_kernel
from linattn.models import CausalLM, SequenceClassifier
from linattn.models.decode import group_rows, prefill_forward

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
    ``labels`` are given, -100 ignored); ``generate`` works with greedy search, sampling and beam search, on
    left-padded prompts with their ``attention_mask`` too (padding: see the module docstring)."""

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
        """The tokens the cache has not seen yet (all of them at the first step, then the last one) and the
        whole attention mask (forward checks that it repeats the padding the cache has seen)."""
        seen = past_key_values.get_seq_length() if isinstance(past_key_values, LinAttnCache) else 0
        inputs = {"input_ids": input_ids[:, seen:], "past_key_values": past_key_values, "use_cache": use_cache,
                  "attention_mask": attention_mask}
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: LinAttnCache | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0, return_dict: bool | None = None,
                **kwargs: Any) -> Any:
        """``attention_mask`` (1: token, 0: padding): see the module docstring. ``position_ids`` are ignored:
        each row's positions count its own real tokens, kept in the cache."""
        _check_kwargs(kwargs)
        if input_ids is None:
            raise ValueError("input_ids is required: an integer tensor [B, T]")
        if past_key_values is not None and not isinstance(past_key_values, LinAttnCache):
            raise TypeError(f"past_key_values must be None or a LinAttnCache (what this model returns), got "
                            f"{type(past_key_values).__name__}")
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        padding = _check_attention_mask(attention_mask, input_ids, seen, past_key_values)
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True)) and not self.training
        if seen:
            logits, groups = self._continue(input_ids, past_key_values.groups, use_cache)
            mask = past_key_values.mask
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], input_ids.shape[1])], dim=1)
        elif padding is None:  # a prompt when it starts a cache (generate), a training batch otherwise
            run = prefill_forward if use_cache else lambda model, ids, **kw: model(ids, **kw)
            logits, new_cache = run(self.model, input_ids, use_cache=use_cache)
            groups, mask = [(None, new_cache)], None
        elif not use_cache:
            logits, groups, mask = self.model(input_ids, attention_mask=padding)[0], [], padding
        else:
            logits, groups = self._prefill_padded(input_ids, padding)
            mask = padding
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            if padding is not None:  # as for each row alone: only predictions of a real token from a real token
                pairs = padding[:, :-1] & padding[:, 1:]
                labels = torch.cat([labels[:, :1], labels[:, 1:].masked_fill(~pairs.to(labels.device), -100)], 1)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        if isinstance(logits_to_keep, int):
            logits = logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits
        else:
            logits = logits[:, logits_to_keep]
        if use_cache:
            past_key_values = past_key_values if past_key_values is not None else LinAttnCache()
            past_key_values.groups, past_key_values.mask = groups, mask
        else:
            past_key_values = None
        out = outputs.CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values)
        return out if return_dict is not False else out.to_tuple()

    def _continue(self, input_ids: torch.Tensor, groups: list[tuple[torch.Tensor | None, list[LayerCache]]],
                  use_cache: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor | None, list[LayerCache]]]]:
        """Logits [B, T, vocab] of tokens that continue every row's cache: one forward per group of rows."""
        if len(groups) == 1 and groups[0][0] is None:
            logits, caches = self.model(input_ids, groups[0][1], use_cache=use_cache)
            return logits, [(None, caches)]
        logits, new_groups = None, []
        for rows, caches in groups:
            out, caches = self.model(input_ids.index_select(0, rows.to(input_ids.device)), caches, use_cache=use_cache)
            if logits is None:
                logits = out.new_zeros(input_ids.shape[0], *out.shape[1:])
            logits = logits.index_copy(0, rows.to(out.device), out)
            new_groups.append((rows, caches))
        return logits, new_groups

    def _prefill_padded(self, input_ids: torch.Tensor, padding: torch.Tensor
                        ) -> tuple[torch.Tensor, list[tuple[torch.Tensor | None, list[LayerCache]]]]:
        """The first forward of padded rows with a cache: the rows of each real length run together on their
        tokens alone (no padding enters a state or shifts a position), as CausalLM.generate prefills prompts.
        Logits [B, T, vocab], 0 at padding; one group of rows per length."""
        B, T = input_ids.shape
        device = input_ids.device
        mask = padding.cpu()
        lengths = mask.sum(1)
        starts = mask.int().argmax(1)  # each row's first token: its tokens are one run (checked)
        logits, groups = None, []
        for n, rows in group_rows(lengths.tolist()).items():
            rows = torch.tensor(rows)
            cols = (starts[rows][:, None] + torch.arange(n)).to(device)
            rows = rows.to(device)
            out, caches = prefill_forward(self.model, input_ids[rows[:, None], cols], use_cache=True)
            if logits is None:
                logits = out.new_zeros(B, T, out.shape[-1])
            logits = logits.index_put((rows[:, None].expand_as(cols), cols), out)
            groups.append((rows, caches))
        if len(groups) == 1:  # every row has one real length: one group of all rows, in order
            groups = [(None, groups[0][1])]
        return logits, groups


def _check_attention_mask(attention_mask: object, input_ids: torch.Tensor, seen: int,
                          cache: LinAttnCache | None) -> torch.Tensor | None:
    """The padding of a first forward, as a bool mask [B, T] (None: no padding, or a cache is continued). Checked
    before any compute: values 0/1; in a first forward each row's tokens one run with at least one token; once
    the cache has started, the mask is [B, T] or transformers' [B, seen + T] whose first columns repeat the
    padding the cache saw, and every new token is real."""
    if attention_mask is None:
        return None
    B, T = input_ids.shape
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 \
            or attention_mask.is_floating_point() or attention_mask.is_complex():
        what = (f"{attention_mask.dtype} {list(attention_mask.shape)}" if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__)
        raise ValueError(f"attention_mask must be a bool or 0/1 integer tensor [B, T] (1: token, 0: padding), "
                         f"got {what}")
    widths = [T] if not seen else [seen + T, T]
    if attention_mask.shape[0] != B or attention_mask.shape[1] not in widths:
        want = f"[{B}, {T}]"
        if seen:
            want = f"[{B}, {seen + T}] (the {seen} columns seen and the new ones) or {want}"
        raise ValueError(f"attention_mask must have shape {want}, got {list(attention_mask.shape)}")
    values = attention_mask.to(torch.int64)
    if bool(((values != 0) & (values != 1)).any()):
        raise ValueError("attention_mask values must be 0 (padding) or 1 (token)")
    mask = values.bool()
    if seen:
        if not bool(mask[:, -T:].all()):
            raise ValueError("attention_mask marks padding among new tokens after the cache has started: padding is "
                             "taken in the first forward only (left padding 0 ... 0 1 ... 1, or right padding); "
                             "the tokens that continue a cache must all be real (1)")
        if mask.shape[1] > T:
            past = cache.mask if cache.mask is not None else mask.new_ones(B, seen)
            if not torch.equal(mask[:, :seen], past.to(mask.device)):
                raise ValueError(f"attention_mask's first {seen} columns must repeat the padding of the tokens the "
                                 "cache has seen (transformers' mask grows by ones as tokens are added)")
        return None
    if bool(mask.all()):
        return None
    lengths = mask.sum(1)
    if not bool((lengths > 0).all()):
        rows = torch.nonzero(lengths == 0).flatten().tolist()
        raise ValueError(f"attention_mask must mark at least one token (1) in every row; rows {rows} have none")
    starts = mask.int().argmax(1)
    cols = torch.arange(T, device=mask.device)[None]
    if not torch.equal(mask, (cols >= starts[:, None]) & (cols < (starts + lengths)[:, None])):
        raise ValueError("attention_mask must mark each row's tokens as one run: left padding 0 ... 0 1 ... 1 (what "
                         "generate needs) or right padding 1 ... 1 0 ... 0; padding between tokens is not supported")
    return mask


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
