"""Decoding cost against context length: time per generated token after prefilling a short and a long
context. Recurrent mixers carry a fixed-size state, so the ratio long/short should stay near 1
(<= 1.2 is the target); softmax-family mixers read a KV cache that grows with the context.

Two decoding paths (``path``): "eager", the cached single-token calls ``model(ids, cache)``, and "static",
:class:`~linattn.models.decode.StaticDecoder` (static buffers; on CUDA one CUDA graph replayed per token).
On the static path the softmax family reads its whole KV buffer (context + generated tokens) at every step.

The two contexts are decoded in alternation (one token of each in turn), so drifts in machine load
hit both alike; each time is the median over the generated tokens."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .config import ModelConfig
from .decode import StaticDecoder
from .lm import CausalLM

PATHS = ("eager", "static")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eager(model: CausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Prefill ``ids`` [B, T]; (last logits [B, vocab], step: next ids [B] -> logits [B, vocab]) on the cached path."""
    logits, cache = model(ids)
    state = [cache]

    def step(next_id: torch.Tensor) -> torch.Tensor:
        out, state[0] = model(next_id[:, None], state[0])
        return out[:, -1]

    return logits[:, -1], step


def _static(model: CausalLM, ids: torch.Tensor, steps: int, use_cuda_graph: bool | None, compile: bool
            ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """As :func:`_eager` with a StaticDecoder sized for ``steps`` more tokens."""
    decoder = StaticDecoder(model, ids.shape[0], ids.shape[1] + steps, use_cuda_graph=use_cuda_graph,
                            compile=compile)
    return decoder.prefill(list(ids)), decoder.step


@torch.no_grad()
def time_per_token(model: CausalLM, context_lengths: list[int], new_tokens: int, *, batch_size: int = 1,
                   warmup: int = 2, seed: int = 0, path: str = "eager", use_cuda_graph: bool | None = None,
                   compile: bool = False) -> list[float]:
    """Median seconds per generated token (greedy single-token steps on ``path``, "eager" or "static") after
    prefilling each of ``context_lengths`` random tokens (prefill not timed); contexts are stepped in alternation.
    ``use_cuda_graph``, ``compile``: the StaticDecoder's options."""
    if min(context_lengths) < 1 or new_tokens < 1 or warmup < 0:
        raise ValueError(f"need context lengths >= 1, new_tokens >= 1, warmup >= 0; got {context_lengths}, "
                         f"{new_tokens}, {warmup}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(map(repr, PATHS))}; got {path!r}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    streams = []
    for n in context_lengths:
        ids = torch.randint(0, model.config.vocab_size, (batch_size, n), generator=gen).to(device)
        streams.append(_eager(model, ids) if path == "eager" else _static(model, ids, warmup + new_tokens,
                                                                            use_cuda_graph, compile))
    logits = [first for first, _ in streams]
    times: list[list[float]] = [[] for _ in context_lengths]
    for i in range(warmup + new_tokens):
        for j, (_, step) in enumerate(streams):
            next_id = logits[j].argmax(-1)
            _sync(device)
            t0 = time.perf_counter()
            logits[j] = step(next_id)
            _sync(device)
            if i >= warmup:
                times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def decode_cost_ratio(mixer: str = "gated_delta_rule", *, short_context: int = 512, long_context: int = 8192,
                      new_tokens: int = 32, d_model: int = 256, n_layers: int = 2, n_heads: int = 4,
                      vocab_size: int = 256, batch_size: int = 1, mixer_kwargs: dict[str, Any] | None = None,
                      device: str | torch.device = "cpu", seed: int = 0, path: str = "eager",
                      dtype: torch.dtype = torch.float32, use_cuda_graph: bool | None = None,
                      compile: bool = False) -> dict[str, Any]:
    """Time per generated token at ``long_context`` over that at ``short_context`` for one CausalLM of
    ``mixer`` (measured in one process on ``device``, parameters in ``dtype``) on decoding ``path``. Returns the
    two times (ms), ``ratio`` and the tokens per second (batch_size / time per step) at both contexts."""
    if not 1 <= short_context < long_context:
        raise ValueError(f"need 1 <= short_context < long_context, got {short_context} and {long_context}")
    torch.manual_seed(seed)
    cfg = ModelConfig(mixer=mixer, d_model=d_model, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab_size,
                      mixer_kwargs=dict(mixer_kwargs or {}))
    model = CausalLM(cfg).to(device=device, dtype=dtype).eval()
    short, long = time_per_token(model, [short_context, long_context], new_tokens, batch_size=batch_size, seed=seed,
                                 path=path, use_cuda_graph=use_cuda_graph, compile=compile)
    return {"mixer": mixer, "path": path, "short_context": short_context, "long_context": long_context,
            "batch_size": batch_size, "ms_per_token_short": 1e3 * short, "ms_per_token_long": 1e3 * long,
            "ratio": long / short, "tokens_per_s_short": batch_size / short, "tokens_per_s_long": batch_size / long,
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "compile": compile}
