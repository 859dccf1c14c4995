"""Decoders of a CausalLM: prefill a batch of prompts, then step one token per row.

:class:`StaticDecoder` (the fast path) keeps every layer's cache in static buffers (static_cache.py) and
runs :meth:`CausalLM.static_step`, which updates them in place. On CUDA it records that whole step
(embedding, blocks, final norm, LM head) once in a CUDA graph and replays it: one launch per token instead
of hundreds. :class:`EagerDecoder` is the cached path (lists of LayerCache), kept for comparison.

Prompts may differ in length: rows of one length are prefilled together by the full-sequence forward (no
padding ever enters a state), and their caches copied into their rows; rows then sit at different
positions, which the static step reads from the device tensor ``cache.pos``.

    decoder = StaticDecoder(model, batch_size=4, max_length=512)
    logits = decoder.prefill([p0, p1, p2, p3])   # 1-D token tensors; logits [B, vocab] at each last token
    logits = decoder.step(next_ids)               # next_ids [B]; logits [B, vocab]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from linattn.layers.cache import LayerCache
from linattn.ops.common.varlen import sdpa_for_new_lengths

from .lm import CausalLM


def group_rows(lengths: Sequence[int]) -> dict[int, list[int]]:
    """Row indices by length, lengths in first-seen order."""
    groups: dict[int, list[int]] = {}
    for row, n in enumerate(lengths):
        groups.setdefault(n, []).append(row)
    return groups


def _check_prompts(prompts: object, batch_size: int | None) -> list[torch.Tensor]:
    """A sequence of non-empty 1-D integer tensors (``batch_size`` of them when given)."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a sequence of 1-D token tensors, got {type(prompts).__name__}")
    if batch_size is not None and len(prompts) != batch_size:
        raise ValueError(f"expected {batch_size} prompts (the decoder's batch size), got {len(prompts)}")
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() < 1 or p.is_floating_point():
            what = list(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D integer tensor, got {what}")
    return list(prompts)


def _check_step_ids(token_ids: object, batch_size: int) -> torch.Tensor:
    if not isinstance(token_ids, torch.Tensor) or tuple(token_ids.shape) != (batch_size,) \
            or token_ids.is_floating_point():
        what = list(token_ids.shape) if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        raise ValueError(f"token_ids must be an integer tensor [B] with B = {batch_size}, got {what}")
    return token_ids


def prefill_forward(model: CausalLM, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, list[LayerCache]]:
    """``model(ids, **kwargs)`` for a prompt: prompts bring sequence lengths a step has not seen, and on CUDA SDPA's
    cuDNN backend builds a plan for every new length (``sdpa_for_new_lengths``), so the prefill keeps SDPA on its
    flash and memory-efficient kernels."""
    with sdpa_for_new_lengths(ids):
        return model(ids, **kwargs)


class StaticDecoder:
    """Static-buffer decoding of ``model`` for ``batch_size`` rows of up to ``max_length`` tokens each (prompt
    and generated; the softmax family's KV buffers hold that many, and every step reads all of them).

    ``use_cuda_graph`` (default: whether the model is on CUDA) captures the step in a CUDA graph when the
    decoder is built; the graph reads the model's parameters and the buffers by address, so update weights
    in place (``load_state_dict`` does) and build a new decoder after moving or re-creating them.
    ``step`` then returns the graph's output tensor, overwritten by the next step: read (or clone) it first.
    ``dtype``: the activations' dtype of the buffers (default the embedding's). ``warmup_steps``: eager steps
    run before the capture (Triton compilation, cuBLAS and allocator set-up must not happen inside it).
    ``compile`` (experimental): ``torch.compile`` the step (fusing its many small elementwise kernels) before
    the warm-up; the compiled step is what the graph captures. It changes rounding (fused float32 math), so
    tokens may differ from the eager path's in half precision.
    """

    def __init__(self, model: CausalLM, batch_size: int, max_length: int, *, use_cuda_graph: bool | None = None,
                 dtype: torch.dtype | None = None, warmup_steps: int = 3, compile: bool = False) -> None:
        if not isinstance(model, CausalLM):
            raise TypeError(f"model must be a CausalLM, got {type(model).__name__}")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be a positive int, got {warmup_steps!r}")
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be a bool, got {type(compile).__name__}")
        self.model = model
        self._step_fn = torch.compile(model.static_step, dynamic=False) if compile else model.static_step
        self.cache = model.allocate_static_cache(batch_size, max_length, dtype=dtype)
        self.device = self.cache.pos.device
        uncapturable = sorted({type(m).__name__ for m in model.modules() if not getattr(m, "graph_capturable", True)})
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda" and not uncapturable
        if use_cuda_graph and uncapturable:
            raise ValueError(f"use_cuda_graph=True: the decoding step of {', '.join(uncapturable)} cannot be captured "
                             "in a CUDA graph (MesaNet's exact solver; use solver='cg'), pass use_cuda_graph=False")
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs the model on a CUDA device, it is on {self.device}")
        self.use_cuda_graph = bool(use_cuda_graph)
        self._tokens = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # the step's static input
        self._logits: torch.Tensor | None = None  # the captured step's output
        self._graph: torch.cuda.CUDAGraph | None = None
        self._length = 0  # the largest row position, counted on the host (max_length check without a sync)
        if self.use_cuda_graph:
            self._capture(warmup_steps)

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    @property
    def max_length(self) -> int:
        return self.cache.max_length

    def _run(self) -> torch.Tensor:
        with torch.no_grad():
            return self._step_fn(self._tokens, self.cache)

    def _capture(self, warmup_steps: int) -> None:
        """Record one step in a CUDA graph, by PyTorch's documented pattern: warm-up steps on a side stream,
        then the capture under ``torch.cuda.graph`` on that same stream (so the libraries' per-stream handles
        and workspaces exist before the capture). Both run on the zeroed buffers at position 0 (reset after
        each warm-up step, so any max_length fits), and the buffers are zeroed again afterwards. The last
        warm-up step (of two or more) runs with CUDA sync debugging set to "error": an operation that would
        synchronise with the host, and so break the capture, raises there, naming itself."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        previous = torch.cuda.get_sync_debug_mode()
        with torch.cuda.stream(side):
            for i in range(warmup_steps):
                checked = warmup_steps > 1 and i == warmup_steps - 1  # the first steps may initialise libraries
                torch.cuda.set_sync_debug_mode("error" if checked else previous)
                try:
                    self._run()
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
                self.cache.pos.zero_()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            self._logits = self._run()
        self._graph = graph
        self.cache.reset()

    @torch.no_grad()
    def prefill(self, prompts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Start ``batch_size`` sequences: reset the buffers, run the full forward over the rows of each prompt
        length together, copy their caches into their rows. ``prompts``: 1-D token tensors of 1 to max_length
        tokens. Returns the logits [B, vocab] at each row's last prompt token."""
        prompts = _check_prompts(prompts, self.batch_size)
        lengths = [int(p.numel()) for p in prompts]
        if max(lengths) > self.max_length:
            raise ValueError(f"a prompt of {max(lengths)} tokens does not fit max_length={self.max_length}")
        self.cache.reset()
        logits = None
        for length, rows in group_rows(lengths).items():
            ids = torch.stack([prompts[r] for r in rows]).to(self.device)
            out, caches = prefill_forward(self.model, ids)
            idx = torch.tensor(rows, device=self.device)
            self.cache.load(self.model, caches, idx, length)
            if logits is None:
                logits = out.new_empty(self.batch_size, out.shape[-1])
            logits.index_copy_(0, idx, out[:, -1])
        self._length = max(lengths)
        return logits

    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (token_ids [B], values in [0, vocab_size), not checked: that would read them on
        the host); returns logits [B, vocab] (on the graph path a tensor the next step overwrites)."""
        _check_step_ids(token_ids, self.batch_size)
        if self._length >= self.max_length:
            raise ValueError(f"the static cache is full: a row has reached max_length={self.max_length} tokens; "
                             "build the decoder with a larger max_length")
        self._tokens.copy_(token_ids)
        if self._graph is not None:
            self._graph.replay()
            logits = self._logits
        else:
            logits = self._run()
        self._length += 1
        return logits


class EagerDecoder:
    """The cached path (``model(ids, cache)`` with lists of LayerCache), with the interface of StaticDecoder.
    A LayerCache holds one position for all its rows, so rows of one prompt length share a cache and each
    step runs the model once per distinct prompt length."""

    def __init__(self, model: CausalLM) -> None:
        if not isinstance(model, CausalLM):
            raise TypeError(f"model must be a CausalLM, got {type(model).__name__}")
        self.model = model
        self.device = model.embed.weight.device
        self._groups: list[tuple[torch.Tensor, list[LayerCache]]] = []
        self.batch_size = 0

    @torch.no_grad()
    def prefill(self, prompts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Prefill each prompt length's rows; returns the logits [B, vocab] at each row's last prompt token."""
        prompts = _check_prompts(prompts, None)
        self.batch_size = len(prompts)
        self._groups, logits = [], None
        for rows in group_rows([int(p.numel()) for p in prompts]).values():
            out, cache = prefill_forward(self.model, torch.stack([prompts[r] for r in rows]).to(self.device))
            idx = torch.tensor(rows, device=self.device)
            self._groups.append((idx, cache))
            if logits is None:
                logits = out.new_empty(self.batch_size, out.shape[-1])
            logits.index_copy_(0, idx, out[:, -1])
        return logits

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (token_ids [B]); returns logits [B, vocab]."""
        _check_step_ids(token_ids, self.batch_size)
        logits = None
        for i, (idx, cache) in enumerate(self._groups):
            out, cache = self.model(token_ids.index_select(0, idx)[:, None], cache)
            self._groups[i] = (idx, cache)
            if logits is None:
                logits = out.new_empty(self.batch_size, out.shape[-1])
            logits.index_copy_(0, idx, out[:, 0])
        return logits
