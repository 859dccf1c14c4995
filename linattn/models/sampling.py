"""The next token from logits: greedy, or sampled with temperature, top-k and top-p (nucleus), on the device.

Nothing here reads a tensor value on the host, so a decoding loop does not wait on the GPU at every token.
Sampling draws one exponential variate E_i per token and takes argmax_i p_i / E_i, which picks token i with
probability p_i (the smallest of the independent E_i / p_i, exponentials of rates p_i, is E_i / p_i with
probability p_i / sum_j p_j); ``torch.multinomial`` would check its input on the host.
"""

from __future__ import annotations

import math

import torch


def check_sampling(temperature: object, top_k: object, top_p: object, vocab_size: int) -> None:
    """temperature a finite number >= 0 (0: greedy); top_k None or an int in [1, vocab_size]; top_p None or a
    number in (0, 1]. Errors name the argument."""
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= vocab_size):
        raise ValueError(f"top_k must be None or an int in [1, vocab_size={vocab_size}], got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or isinstance(top_p, bool)
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a float in (0, 1], got {top_p!r}")


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """logits [B, vocab] with -inf outside the ``top_k`` largest and outside the nucleus: the most likely tokens
    whose probabilities, taken in decreasing order, first reach ``top_p`` (the most likely token always stays)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        ordered = ordered.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return logits


def sample_next(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, vocab]: argmax at temperature 0, else a sample of
    softmax(filter(logits / temperature)) (see the module docstring; ``generator`` on the logits' device)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    # a zero variate would make a token of probability 0 win (0 / 0): clamp to the smallest normal float
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
