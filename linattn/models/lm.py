"""CausalLM: embedding, pre-norm blocks, final RMSNorm, LM head; cached decoding."""

from __future__ import annotations

import torch
from torch import nn

from linattn.layers.cache import LayerCache
from linattn.ops.common.values import value_checks_enabled

from .blocks import Block
from .config import ModelConfig


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

    def forward(self, input_ids: torch.Tensor, cache: list[LayerCache] | None = None, *, use_cache: bool = True
                ) -> tuple[torch.Tensor, list[LayerCache] | None]:
        """input_ids [B, T] -> (logits [B, T, vocab_size], cache or None when use_cache=False)."""
        check_input_ids("input_ids", input_ids, self.config.vocab_size)
        if cache is not None and (not isinstance(cache, list) or len(cache) != len(self.blocks)):
            raise ValueError(f"cache must be None or a list of {len(self.blocks)} LayerCache (one per block), "
                             f"got {type(cache).__name__} of length {len(cache) if isinstance(cache, list) else '-'}")
        x = self.embed(input_ids.long())
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, None if cache is None else cache[i], use_cache=use_cache)
            new_cache.append(c)
        return self.lm_head(self.norm(x)), (new_cache if use_cache else None)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Prefill ``input_ids`` [B, T] then append ``max_new_tokens`` tokens one at a time with the cache.

        temperature 0: greedy (argmax); otherwise sample from softmax(logits / temperature), restricted
        to the ``top_k`` most likely tokens when given. Returns [B, T + max_new_tokens].
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a float >= 0 (0: greedy), got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= self.config.vocab_size):
            raise ValueError(f"top_k must be None or an int in [1, vocab_size={self.config.vocab_size}], got {top_k!r}")
        out = [input_ids]
        if max_new_tokens == 0:
            return input_ids
        logits, cache = self(input_ids)
        for i in range(max_new_tokens):
            next_id = sample_next(logits[:, -1].float(), temperature, top_k, generator)
            out.append(next_id[:, None])
            if i + 1 < max_new_tokens:
                logits, cache = self(next_id[:, None], cache)
        return torch.cat(out, dim=1)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B] from logits [B, vocab]: argmax at temperature 0, else (top-k) sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
