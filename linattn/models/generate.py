"""CausalLM.generate: prefill the prompts, then sample one token per row and step, until max_new_tokens or
every row has emitted a stop token.

Prompts of different lengths: a list of 1-D token tensors, or ``input_ids`` [B, T] with an ``attention_mask``
[B, T] marking each row's prompt at its end (left padding: 0 ... 0 1 ... 1). Each row is then prefilled
without its padding (decode.py), so the result equals generating that prompt alone.

Stopping: a row that emits one of ``eos_token_id`` keeps that token and afterwards emits ``pad_token_id``.
Whether every row has stopped is read on the host only every ``stop_check_interval`` tokens (each read
waits for the GPU); the output is cut after the first token at which all rows had stopped, so it does not
depend on the interval. The loop itself samples on the device (sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .decode import EagerDecoder, StaticDecoder, _check_prompts
from .lm import CausalLM, check_input_ids
from .sampling import check_sampling, sample_next


def _stop_ids(eos_token_id: object, pad_token_id: object, vocab_size: int) -> tuple[list[int], int | None]:
    """The stop ids as a list (empty: no stopping) and the pad id (default: the first stop id)."""
    def is_id(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab_size

    stops = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if isinstance(eos_token_id, bool) or not isinstance(stops, (list, tuple)) or not all(map(is_id, stops)) \
            or (eos_token_id is not None and not stops):
        raise ValueError(f"eos_token_id must be None, an int or a non-empty list of ints in [0, vocab_size="
                         f"{vocab_size}), got {eos_token_id!r}")
    if pad_token_id is not None and not is_id(pad_token_id):
        raise ValueError(f"pad_token_id must be None or an int in [0, vocab_size={vocab_size}), got {pad_token_id!r}")
    return list(stops), (stops[0] if pad_token_id is None and stops else pad_token_id)


def _rows_of(prompts: object, attention_mask: object, vocab_size: int) -> list[torch.Tensor]:
    """One 1-D prompt per row from a list, or from input_ids [B, T] and an optional left-padding mask."""
    if not isinstance(prompts, torch.Tensor):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with input_ids [B, T]; prompts given as a list need none")
        rows = _check_prompts(prompts, None)
        if not rows:
            raise ValueError("prompts must hold at least one prompt")
        for i, p in enumerate(rows):
            check_input_ids(f"prompts[{i}]", p[None], vocab_size)
        return rows
    ids = check_input_ids("input_ids", prompts, vocab_size)
    B, T = ids.shape
    if attention_mask is None:
        return list(ids)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T) \
            or attention_mask.is_floating_point():
        what = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a bool or 0/1 integer tensor of input_ids' shape {[B, T]}, "
                         f"got {what}")
    mask = attention_mask.to(device="cpu", dtype=torch.long)
    lengths = mask.sum(1)
    left_padded = mask == (torch.arange(T)[None] >= T - lengths[:, None]).long()
    if not bool(((mask == 0) | (mask == 1)).all() & left_padded.all() & (lengths >= 1).all()):
        raise ValueError("attention_mask must mark each row's prompt at its end (left padding: 0 ... 0 1 ... 1, "
                         "at least one 1 per row)")
    return [ids[b, T - int(n):] for b, n in enumerate(lengths)]


@torch.no_grad()
def generate(model: CausalLM, input_ids: torch.Tensor | Sequence[torch.Tensor], max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, generator: torch.Generator | None = None, static: bool = True,
             decoder: StaticDecoder | None = None, use_cuda_graph: bool | None = None,
             stop_check_interval: int = 16) -> torch.Tensor | list[torch.Tensor]:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    input_ids: the prompts, [B, T] (with ``attention_mask`` for left-padded prompts of different lengths) or a
    list of 1-D token tensors. temperature 0: greedy; otherwise sample softmax(logits / temperature), restricted to
    the ``top_k`` most likely tokens and to the nucleus of mass ``top_p`` when given (``generator``, on the
    model's device, makes samples reproducible). eos_token_id: stop id(s); pad_token_id: emitted after a row's
    stop (default: the first stop id). static: decode with :class:`StaticDecoder` (a CUDA graph on CUDA unless
    ``use_cuda_graph=False``; ``decoder`` reuses one built for this model, its batch size and enough
    max_length), else the cached eager path. stop_check_interval: tokens between host reads of "all stopped".

    Returns for input_ids [B, T + n], the generated tokens after each (padded) row; for a list, a list of 1-D
    tensors, each prompt followed by its tokens up to and including its stop token. n <= max_new_tokens is
    the number of steps until every row had stopped.
    """
    if not isinstance(model, CausalLM):
        raise TypeError(f"model must be a CausalLM, got {type(model).__name__}")
    vocab = model.config.vocab_size
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p, vocab)
    stops, pad = _stop_ids(eos_token_id, pad_token_id, vocab)
    device = model.embed.weight.device
    if generator is not None and (not isinstance(generator, torch.Generator) or generator.device.type != device.type):
        what = generator.device if isinstance(generator, torch.Generator) else type(generator).__name__
        raise ValueError(f"generator must be a torch.Generator on the model's device type ({device.type}), "
                         f"got {what}")
    if not isinstance(stop_check_interval, int) or isinstance(stop_check_interval, bool) or stop_check_interval < 1:
        raise ValueError(f"stop_check_interval must be a positive int, got {stop_check_interval!r}")
    if not isinstance(static, bool):
        raise TypeError(f"static must be a bool, got {type(static).__name__}")
    rows = [r.to(device) for r in _rows_of(input_ids, attention_mask, vocab)]
    B, longest = len(rows), max(int(r.numel()) for r in rows)
    if decoder is not None:
        needed = longest + max_new_tokens - 1
        if not static or not isinstance(decoder, StaticDecoder) or decoder.model is not model \
                or decoder.batch_size != B or decoder.max_length < needed:
            raise ValueError(f"decoder must be a StaticDecoder of this model with batch_size {B} and max_length >= "
                             f"{needed} (static=True)")
    if max_new_tokens == 0:
        return input_ids

    if not static:
        dec = EagerDecoder(model)
    else:
        dec = decoder or StaticDecoder(model, B, longest + max_new_tokens - 1, use_cuda_graph=use_cuda_graph)
    tokens = decode_loop(dec, rows, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stops=stops,
                         pad=pad, generator=generator, stop_check_interval=stop_check_interval)
    if isinstance(input_ids, torch.Tensor):
        return torch.cat([input_ids.to(device), tokens.to(input_ids.dtype)], dim=1)
    out = []
    for r, t in zip(rows, tokens.cpu()):
        hit = torch.isin(t, torch.tensor(stops)).nonzero() if stops else []
        n = int(hit[0]) + 1 if len(hit) else t.numel()
        out.append(torch.cat([r, t[:n].to(device=device, dtype=r.dtype)]))
    return out


def decode_loop(decoder: StaticDecoder | EagerDecoder, rows: list[torch.Tensor], max_new_tokens: int, *,
                temperature: float, top_k: int | None, top_p: float | None, stops: list[int], pad: int | None,
                generator: torch.Generator | None, stop_check_interval: int) -> torch.Tensor:
    """Prefill ``rows`` and generate: tokens [B, n] (n <= max_new_tokens, cut after all rows stopped)."""
    logits = decoder.prefill(rows)
    device, B, N = logits.device, len(rows), max_new_tokens
    out = torch.empty(B, N, dtype=torch.long, device=device)
    stop_ids = torch.tensor(stops, device=device) if stops else None  # made once, before the loop
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    all_done = torch.zeros(N, dtype=torch.bool, device=device)  # after step i, had every row stopped?
    n = N
    for i in range(N):
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if stop_ids is not None:
            nxt = torch.where(finished, pad, nxt)
            finished |= (nxt[:, None] == stop_ids).any(dim=-1)
            all_done[i] = finished.all()
        out[:, i] = nxt
        if stop_ids is not None and (i + 1) % stop_check_interval == 0 and bool(finished.all()):  # host read
            n = i + 1
            break
        if i + 1 < N:
            logits = decoder.step(nxt)
    if stop_ids is not None:
        done = all_done[:n].nonzero()
        n = int(done[0]) + 1 if len(done) else n
    return out[:, :n]
