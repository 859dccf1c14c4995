"""Decoding cost against context length: time per generated token after prefilling a short and a long
context. Recurrent mixers carry a fixed-size state, so the ratio long/short should stay near 1
(<= 1.2 is the target); softmax-family mixers read a KV cache that grows with the context.

The two contexts are decoded in alternation (one token of each in turn), so drifts in machine load
hit both alike; each time is the median over the generated tokens."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .config import ModelConfig
from .lm import CausalLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_per_token(model: CausalLM, context_lengths: list[int], new_tokens: int, *, batch_size: int = 1,
                   warmup: int = 2, seed: int = 0) -> list[float]:
    """Median seconds per generated token (greedy, cached single-token calls) after prefilling each of
    ``context_lengths`` random tokens (prefill not timed); contexts are stepped in alternation."""
    if min(context_lengths) < 1 or new_tokens < 1 or warmup < 0:
        raise ValueError(f"need context lengths >= 1, new_tokens >= 1, warmup >= 0; got {context_lengths}, "
                         f"{new_tokens}, {warmup}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    streams = []
    for n in context_lengths:
        ids = torch.randint(0, model.config.vocab_size, (batch_size, n), generator=gen).to(device)
        streams.append(model(ids))
    times: list[list[float]] = [[] for _ in context_lengths]
    for i in range(warmup + new_tokens):
        for j, (logits, cache) in enumerate(streams):
            next_id = logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            t0 = time.perf_counter()
            streams[j] = model(next_id, cache)
            _sync(device)
            if i >= warmup:
                times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def decode_cost_ratio(mixer: str = "gated_delta_rule", *, short_context: int = 512, long_context: int = 8192,
                      new_tokens: int = 32, d_model: int = 256, n_layers: int = 2, n_heads: int = 4,
                      vocab_size: int = 256, batch_size: int = 1, mixer_kwargs: dict[str, Any] | None = None,
                      device: str | torch.device = "cpu", seed: int = 0) -> dict[str, Any]:
    """Time per generated token at ``long_context`` over that at ``short_context`` for one CausalLM of
    ``mixer`` (measured in one process on ``device``). Returns the two times (ms) and ``ratio``."""
    if not 1 <= short_context < long_context:
        raise ValueError(f"need 1 <= short_context < long_context, got {short_context} and {long_context}")
    torch.manual_seed(seed)
    cfg = ModelConfig(mixer=mixer, d_model=d_model, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab_size,
                      mixer_kwargs=dict(mixer_kwargs or {}))
    model = CausalLM(cfg).to(device).eval()
    short, long = time_per_token(model, [short_context, long_context], new_tokens, batch_size=batch_size, seed=seed)
    return {"mixer": mixer, "short_context": short_context, "long_context": long_context,
            "ms_per_token_short": 1e3 * short, "ms_per_token_long": 1e3 * long, "ratio": long / short,
            "device": str(device)}
