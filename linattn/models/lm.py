"""CausalLM: embedding, pre-norm blocks, final RMSNorm, LM head; cached and static decoding, generate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from linattn.layers.cache import LayerCache
from linattn.ops.common.values import value_checks_enabled
from linattn.ops.common.varlen import check_cu_seqlens, check_packed_batch, mask_to_cu_seqlens

from .blocks import Block
from .config import ModelConfig
from .static_cache import StaticCache

if TYPE_CHECKING:  # decode.py imports this module
    from .decode import StaticDecoder


def check_input_ids(name: str, ids: object, vocab_size: int) -> torch.Tensor:
    """``ids`` is an integer ``[B, T]`` tensor (dtype int64, int32, int16 or uint8) with B >= 1, T >= 1 and
    values in [0, vocab_size)."""
    id_dtypes = (torch.int64, torch.int32, torch.int16, torch.uint8)
    accepted = ", ".join(str(d).replace("torch.", "") for d in id_dtypes)
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor of shape [B, T] (dtype {accepted}), "
                        f"got {type(ids).__name__}")
    if ids.dtype not in id_dtypes:
        # int8 cannot hold ids >= 128; floats and bools are not ids
        raise TypeError(f"{name} must have dtype {accepted}, got {str(ids.dtype).replace('torch.', '')}")
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise ValueError(f"{name} must have shape [B, T] with B >= 1 and T >= 1, got {list(ids.shape)}")
    if value_checks_enabled(ids):
        lo, hi = torch.stack([ids.min(), ids.max()]).tolist()  # one host sync
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} values must lie in [0, vocab_size={vocab_size}), got min {lo}, max {hi}")
    return ids


class CausalLM(nn.Module):
    """Decoder-only language model of ``config``: ``logits, cache = model(input_ids, cache=None)``.

    ``cache`` is a list with one :class:`LayerCache` per block; passing it back continues the
    sequence (single-token calls use each mixer's step function: O(1) per token for recurrent mixers).
    Static decoding: :meth:`allocate_static_cache` and :meth:`static_step` (one token per row, buffers
    updated in place; what :class:`~linattn.models.decode.StaticDecoder` captures in a CUDA graph).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, cache: list[LayerCache] | None = None, *, use_cache: bool = True,
                cu_seqlens: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[LayerCache] | None]:
        """input_ids [B, T] -> (logits [B, T, vocab_size], cache or None when use_cache=False).

        ``cu_seqlens``: input_ids [1, T] packs N documents at these offsets (1-D int32/int64 [N+1], from 0 to T,
        strictly increasing; linattn/ops/common/varlen.py); every block runs each document as if alone (states,
        ShortConvs and positions restart at each offset). No cache in or out: the cache returned is None.

        ``attention_mask`` [B, T] (1: token, 0: padding, left or right): the rows' tokens are packed, one sequence
        per row, and run as with ``cu_seqlens``; padded positions get logits 0. No cache in or out."""
        check_input_ids("input_ids", input_ids, self.config.vocab_size)
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError("pass cu_seqlens or attention_mask, not both")
            return self._masked_forward(input_ids, cache, attention_mask), None
        if cu_seqlens is not None:
            return self._packed_forward(input_ids, cache, cu_seqlens), None
        if isinstance(cache, StaticCache):
            raise TypeError("a StaticCache is continued with static_step(token_ids, cache), not forward")
        if cache is not None and (not isinstance(cache, list) or len(cache) != len(self.blocks)):
            raise ValueError(f"cache must be None or a list of {len(self.blocks)} LayerCache (one per block), "
                             f"got {type(cache).__name__} of length {len(cache) if isinstance(cache, list) else '-'}")
        x = self.embed(input_ids.long())
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, None if cache is None else cache[i], use_cache=use_cache)
            new_cache.append(c)
        return self.lm_head(self.norm(x)), (new_cache if use_cache else None)

    def _packed_forward(self, input_ids: torch.Tensor, cache: object, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Logits of packed documents (offsets checked here, before any compute)."""
        if cache is not None:
            raise ValueError(f"cache must be None with cu_seqlens (packed documents start from zero states), "
                             f"got {type(cache).__name__}")
        check_packed_batch("input_ids", input_ids)
        check_cu_seqlens(cu_seqlens, input_ids.shape[1], input_ids.device)
        x = self.embed(input_ids.long())
        for block in self.blocks:
            x, _ = block(x, use_cache=False, cu_seqlens=cu_seqlens)
        return self.lm_head(self.norm(x))

    def _masked_forward(self, input_ids: torch.Tensor, cache: object, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits of padded rows: their tokens packed and run alone, scattered back (zeros at padding)."""
        if cache is not None:
            raise ValueError(f"cache must be None with attention_mask, got {type(cache).__name__}")
        B, T = input_ids.shape
        indices, cu_seqlens = mask_to_cu_seqlens(attention_mask.to(input_ids.device), (B, T))
        packed = self._packed_forward(input_ids.flatten()[indices][None], None, cu_seqlens)[0]
        logits = packed.new_zeros(B * T, packed.shape[-1]).index_copy(0, indices, packed)
        return logits.view(B, T, -1)

    def allocate_static_cache(self, batch_size: int, max_length: int, *, dtype: torch.dtype | None = None,
                              device: torch.device | str | None = None) -> StaticCache:
        """Zeroed static decoding buffers for ``batch_size`` rows of up to ``max_length`` tokens (prompt and
        generated): ShortConv caches in ``dtype`` (default: the embedding's), recurrent states and KV buffers
        in float32 (float64 for float64), positions [B] int64, all on ``device`` (default: the model's)."""
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        dtype = self.embed.weight.dtype if dtype is None else dtype
        device = self.embed.weight.device if device is None else torch.device(device)
        pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        layers = []
        for block in self.blocks:
            mixer = block.mixer
            if not hasattr(mixer, "allocate_static_cache"):
                raise NotImplementedError(f"mixer {self.config.mixer!r} ({type(mixer).__name__}) has no static "
                                          "decoding path")
            layers.append(mixer.allocate_static_cache(batch_size, max_length, dtype=dtype, device=device, pos=pos))
        return StaticCache(layers, pos, max_length)

    def static_step(self, token_ids: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """One token per row, token_ids [B] -> logits [B, vocab_size], continuing ``cache``, whose buffers are
        updated in place and whose positions advance by one. Shapes only are checked (reading the ids' values
        or the positions would synchronise with the host): ids must lie in [0, vocab_size) and every row's
        position below the cache's max_length (StaticDecoder counts the steps on the host)."""
        if not isinstance(cache, StaticCache) or len(cache.layers) != len(self.blocks):
            raise TypeError(f"cache must be a StaticCache of {len(self.blocks)} layers (allocate_static_cache)")
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.shape[0] != cache.batch_size \
                or token_ids.is_floating_point():
            what = list(token_ids.shape) if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
            raise ValueError(f"token_ids must be an integer tensor [B] with B = {cache.batch_size}, got {what}")
        x = self.embed(token_ids.long())[:, None]
        for block, layer_cache in zip(self.blocks, cache.layers):
            x, _ = block(x, layer_cache)
        logits = self.lm_head(self.norm(x))[:, 0]
        cache.pos.add_(1)
        return logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | Sequence[torch.Tensor], max_new_tokens: int, *,
                 attention_mask: torch.Tensor | None = None, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int | None = None, generator: torch.Generator | None = None, static: bool = True,
                 decoder: StaticDecoder | None = None, use_cuda_graph: bool | None = None, stop_check_interval: int = 16
                 ) -> torch.Tensor | list[torch.Tensor]:
        """Greedy or sampled continuation of ``input_ids`` ([B, T], or a list of 1-D prompts): see
        :func:`linattn.models.generate.generate`. The static decoder (a CUDA graph on CUDA) runs by default;
        ``static=False`` runs the cached eager path."""
        from .generate import generate

        return generate(self, input_ids, max_new_tokens, attention_mask=attention_mask, temperature=temperature,
                        top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        generator=generator, static=static, decoder=decoder, use_cuda_graph=use_cuda_graph,
                        stop_check_interval=stop_check_interval)
