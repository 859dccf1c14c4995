"""``linattn bench model``: what a user of a whole model sees, per mixer, next to softmax attention.

Training: one full step of a :class:`~linattn.models.CausalLM` (forward, next-token cross-entropy,
backward, AdamW step, zero_grad) per mixer, batch shape and mode ("eager", or "compiled":
``torch.compile(model)``, its compile time reported apart and kept out of the timing). Tokens/s is
``B * T`` over the step time of steps run back to back after warm-up (:func:`pipelined_ms`: the host queues the
next step while the GPU runs this one, as in the Trainer); the median time of a step synchronised on its own is
kept beside it (``synced_ms_per_step``), and the two differ most where a step's host time is near its device time.
Peak memory is the CUDA allocator's peak over the
timed steps (weights, gradients, optimizer state and activations; none on the CPU). On CUDA the step
runs under bf16 autocast with fused AdamW, as a user would train.

Decoding: per mixer, batch size and context length, milliseconds per generated token (greedy,
cached single-token calls) after an untimed prefill of random tokens, with the weights in bf16 on
CUDA; every timing goes through :func:`time_decoding`, whose ``path`` picks how tokens are generated.

softmax_attn (the reference) always runs with the same config in the same process, first, and every
row carries its ratio to it: ``speed_ratio`` = tokens/s over softmax_attn's (above 1: faster) and, for
training, ``memory_ratio`` = peak memory over softmax_attn's (below 1: less). An exception in one row
(out of memory, a compiler failure, a mixer's bug) is recorded in that row's ``error`` and the run goes
on. ``--profile`` adds, per training row, the top kernels of one profiled step and how much of the
step's wall time the GPU spent in kernels.

``--packed`` adds, after each fixed-length training row, a row of the same mixer, shape and mode that trains on
packed documents: B * T tokens per step as one row [1, B * T] with ``cu_seqlens``, the documents' lengths drawn
uniformly from ``--doc-lengths`` (64 to 4096 tokens by default; seeded; the last document of a step is cut to
fill it exactly), a new packing every step. Its ``packed_ratio`` is the fixed-length step's time over the packed
step's, both on the packed row's model, timed in alternation after its own timing: runs of ``--steps`` steps back to
back (as training runs them, and as tokens/s is measured), a fixed-length run then a packed one, five pairs, the
median of the pairs' ratios. An eager step waits on the host and a machine's speed drifts between rows by up to a
fifth, which alternation cancels. ``packed_ratio_synced`` is the same ratio with each step synchronised on its own
(``--steps`` pairs of single steps): it also counts the GPU work still queued when the host is done, which back to
back steps overlap with the next step's host time. ``fixed_row_ratio`` keeps the packed row's tokens/s over the
fixed-length row's. ``kernels_compiled_after_first_step`` counts the Triton kernel variants compiled over the
warm-up and timed steps' packings after the first packed step (:mod:`linattn.bench.kernel_variants`): a kernel
that specialised on the documents' lengths would compile again for new ones.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Container, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from linattn.compile_modes import TORCH_COMPILE_MODES, torch_compile_mode
from linattn.models import CausalLM, ModelConfig, list_mixers
from linattn.models.decode_bench import time_per_token

from .kernel_variants import compiled_variants
from .profile_op import kernel_times
from .timing import environment, median_ms, synchronize, write_rows

REFERENCE = "softmax_attn"
DEFAULT_MIXERS = "gated_delta_rule,delta_rule,gla,mamba2,retention,comba"
MODES = ("eager", "compiled")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GIB = 2**30
# The reference config on CUDA (head dim 128); on the CPU a size that runs in seconds.
DEFAULTS = {
    "cuda": dict(d_model=1024, layers=12, heads=8, vocab=32000, shapes="8x2048,2x8192,1x32768",
                 modes="eager,compiled", steps=10, warmup=3, decode_batch="1,16", decode_context="512,8192",
                 decode_tokens=64),
    "cpu": dict(d_model=64, layers=2, heads=4, vocab=256, shapes="2x128", modes="eager", steps=3, warmup=1,
                decode_batch="1", decode_context="64", decode_tokens=8),
}


@dataclass
class ModelBenchPlan:
    """What one run measures. ``mixers`` starts with the reference; ``mixer_kwargs`` maps a mixer
    name to its layer's keyword arguments; ``dtype`` is the autocast dtype of training and the weight
    dtype of decoding (float32: neither)."""

    device: torch.device
    dtype: torch.dtype
    mixers: list[str]
    d_model: int
    n_layers: int
    n_heads: int
    vocab_size: int
    mixer_kwargs: dict[str, dict]
    shapes: list[tuple[int, int]]
    modes: list[str]
    steps: int
    warmup: int
    compile_backend: str
    compile_scope: str
    profile: bool
    decode_batches: list[int]
    decode_contexts: list[int]
    decode_tokens: int
    decode_path: str
    seed: int = 0
    compile_mode: str = "default"
    profile_top: int = 10
    packed: bool = False
    doc_lengths: tuple[int, int] = (64, 4096)

    def model_config(self, mixer: str) -> ModelConfig:
        """The model config of ``mixer`` at this plan's size (ValueError on a bad size or layer argument)."""
        return ModelConfig(mixer=mixer, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                           vocab_size=self.vocab_size, mixer_kwargs=dict(self.mixer_kwargs.get(mixer, {})))

    def settings(self) -> dict:
        """What every row depends on (rows of an earlier run are reused by --resume only when these match)."""
        return {"device": self.device.type, "dtype": str(self.dtype).replace("torch.", ""), "d_model": self.d_model,
                "n_layers": self.n_layers, "n_heads": self.n_heads, "vocab_size": self.vocab_size,
                "mixer_kwargs": self.mixer_kwargs, "steps": self.steps, "warmup": self.warmup,
                "compile_backend": self.compile_backend, "compile_scope": self.compile_scope,
                "compile_mode": self.compile_mode,
                "decode_tokens": self.decode_tokens, "seed": self.seed, "doc_lengths": list(self.doc_lengths)}

    def lists(self) -> dict:
        """What is measured: mixers, shapes, modes, decoding batches and contexts."""
        return {"mixers": self.mixers, "shapes": [f"{b}x{t}" for b, t in self.shapes], "modes": self.modes,
                "decode_batch": self.decode_batches, "decode_context": self.decode_contexts,
                "decode_path": self.decode_path, "profile": self.profile, "packed": self.packed}


@dataclass
class TrainRow:
    """One training measurement; times in ms, memory in GiB, ``params_m`` in millions; None: not measured."""

    mixer: str
    batch: int
    seq_len: int
    mode: str
    kind: str = "train"
    layout: str = "fixed"  # "packed": documents packed along one row with cu_seqlens (``--packed``)
    documents: float | None = None  # packed: documents per step (mean over the timed steps' packings)
    tokens_per_s: float | None = None  # from ms_per_step
    ms_per_step: float | None = None  # steps back to back (bench.model.pipelined_ms)
    synced_ms_per_step: float | None = None  # each step synchronised on its own (median)
    peak_gib: float | None = None
    compile_s: float | None = None
    graph_breaks: int | None = None
    params_m: float | None = None
    speed_ratio: float | None = None
    memory_ratio: float | None = None
    packed_ratio: float | None = None  # packed rows: fixed-length step time over packed, back-to-back runs alternated
    packed_ratio_synced: float | None = None  # the same, single synchronised steps alternated
    fixed_row_ratio: float | None = None  # packed rows: tokens/s over the fixed-length row's (same mixer, shape, mode)
    # packed rows: Triton kernel variants compiled after the first packed step, over the warm-up and timed steps'
    # new packings (None: no compiled Triton kernels to count, as on the CPU)
    kernels_compiled_after_first_step: int | None = None
    error: str | None = None
    profile: dict | None = None


@dataclass
class DecodeRow:
    """One decoding measurement: ``tokens_per_s`` counts every sequence of the batch."""

    mixer: str
    batch: int
    context: int
    path: str
    kind: str = "decode"
    new_tokens: int = 0
    ms_per_token: float | None = None
    tokens_per_s: float | None = None
    speed_ratio: float | None = None
    error: str | None = None


# --- arguments ------------------------------------------------------------------------------------------
def parse_ints(text: str, what: str) -> list[int]:
    """``"1,16"`` -> [1, 16] (positive ints)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{what} must be positive, got {text!r}")
    return values


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"8x2048,1x32768"`` -> [(8, 2048), (1, 32768)] (batch x sequence length)."""
    shapes = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        b, _, t = item.partition("x")
        if not (b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 1):
            raise ValueError(f"--shapes: each shape is BxT with B >= 1 and T >= 2 (e.g. 8x2048), got {item!r}")
        shapes.append((int(b), int(t)))
    return shapes


def parse_doc_lengths(text: str | None) -> tuple[int, int]:
    """``"64,4096"`` -> (64, 4096): the shortest and longest packed document (None: those)."""
    if text is None:
        return (64, 4096)
    values = parse_ints(text, "--doc-lengths")
    if len(values) != 2 or values[0] > values[1]:
        raise ValueError(f"--doc-lengths must be two lengths MIN,MAX with MIN <= MAX (e.g. 64,4096), got {text!r}")
    return values[0], values[1]


def _mixer_list(text: str) -> list[str]:
    names = [REFERENCE] + [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in list_mixers()]
    if unknown:
        raise ValueError(f"--mixers: unknown mixer(s) {', '.join(unknown)}; valid: {', '.join(list_mixers())}")
    return list(dict.fromkeys(names))  # the reference first, each name once


def plan_from_args(args: argparse.Namespace) -> ModelBenchPlan:
    """The plan of ``linattn bench model`` options; options left out take the device's defaults
    (:data:`DEFAULTS`). Raises ValueError naming a bad option."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
    d = DEFAULTS[device.type]
    pick = lambda name: d[name] if getattr(args, name) is None else getattr(args, name)
    modes = [m for m in pick("modes").split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"--modes: choose from {', '.join(MODES)}, got {pick('modes')!r}")
    kwargs = json.loads(args.mixer_kwargs) if args.mixer_kwargs else {}
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) for v in kwargs.values()):
        raise ValueError('--mixer-kwargs must be a JSON object of mixer -> layer arguments, e.g. '
                         '\'{"gla": {"chunk_size": 64}}\'')
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    plan = ModelBenchPlan(
        device=device, dtype=dtype, mixers=_mixer_list(args.mixers or DEFAULT_MIXERS), d_model=pick("d_model"),
        n_layers=pick("layers"), n_heads=pick("heads"), vocab_size=pick("vocab"), mixer_kwargs=kwargs,
        shapes=[] if args.no_train else parse_shapes(pick("shapes")), modes=modes, steps=pick("steps"),
        warmup=pick("warmup"), compile_backend=args.compile_backend,
        compile_scope=args.compile_scope, compile_mode=getattr(args, "compile_mode", "default"), profile=args.profile,
        profile_top=getattr(args, "profile_top", 10),
        decode_batches=[] if args.no_decode else parse_ints(pick("decode_batch"), "--decode-batch"),
        decode_contexts=parse_ints(pick("decode_context"), "--decode-context"),
        decode_tokens=pick("decode_tokens"), decode_path=args.decode_path, seed=args.seed,
        packed=bool(getattr(args, "packed", False)), doc_lengths=parse_doc_lengths(getattr(args, "doc_lengths", None)))
    if plan.decode_path not in DECODE_PATHS:
        raise ValueError(f"--decode-path: choose from {', '.join(DECODE_PATHS)}, got {plan.decode_path!r}")
    if plan.steps < 1 or plan.warmup < 0 or plan.decode_tokens < 1:
        raise ValueError(f"need --steps >= 1, --warmup >= 0, --decode-tokens >= 1; got {plan.steps}, "
                         f"{plan.warmup}, {plan.decode_tokens}")
    if plan.profile_top < 1:
        raise ValueError(f"--profile-top must be >= 1, got {plan.profile_top}")
    for mixer in plan.mixers:  # a bad size or layer argument fails now, not after an hour of measuring
        plan.model_config(mixer)
    return plan


# --- one model ------------------------------------------------------------------------------------------
def build_model(plan: ModelBenchPlan, mixer: str) -> CausalLM:
    """A freshly initialised CausalLM of ``mixer`` on the plan's device (same seed for every mixer)."""
    torch.manual_seed(plan.seed)
    with plan.device:  # initialise on the device: a 200M-parameter model is slow to initialise on the CPU
        model = CausalLM(plan.model_config(mixer))
    return model.to(plan.device)


def make_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; the fused CUDA kernel on CUDA (one launch for every parameter), as one would train."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed precision in ``dtype`` on ``device``; float32: none."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def make_train_step(model: Callable, optimizer: torch.optim.Optimizer, ids: torch.Tensor, device: torch.device,
                    dtype: torch.dtype) -> Callable[[], None]:
    """One full training step on ``ids`` [B, T + 1]: forward of the first T tokens (``model`` may be
    compiled), mean cross-entropy against the next tokens, backward, optimizer step, zero_grad."""
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step() -> None:
        with autocast(device, dtype):
            logits, _ = model(inputs, use_cache=False)  # no decoding cache: training keeps none
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def packed_documents(tokens: int, low: int, high: int, gen: torch.Generator) -> list[int]:
    """Offsets [0, L1, L1 + L2, ..., tokens] of documents with lengths drawn uniformly from [low, high] (the last
    one cut so that the documents fill ``tokens`` exactly)."""
    offsets = [0]
    while offsets[-1] < tokens:
        length = int(torch.randint(low, high + 1, (1,), generator=gen))
        offsets.append(min(offsets[-1] + length, tokens))
    return offsets


def make_packed_train_step(model: Callable, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
                           packings: list[torch.Tensor], device: torch.device, dtype: torch.dtype
                           ) -> Callable[[], None]:
    """One training step on packed documents: ``ids`` [1, tokens + 1], ``packings`` a list of offsets tensors
    (cu_seqlens), one per step in turn. The forward sees the first ``tokens`` tokens with that
    step's offsets; the last token of each document predicts nothing (its target is ignored)."""
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    masked = []
    for cu in packings:
        t = targets.clone()
        t[0, cu[1:].long().to(t.device) - 1] = -100  # the next token belongs to the next document
        masked.append(t)
    turn = [0]

    def step() -> None:
        i = turn[0] % len(packings)
        turn[0] += 1
        with autocast(device, dtype):
            logits, _ = model(inputs, use_cache=False, cu_seqlens=packings[i])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), masked[i].flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call, synchronised on CUDA."""
    return median_ms(fn, device, repeats=1, warmup=0) / 1e3


def profile_step(step: Callable[[], None], device: torch.device, step_ms: float, top: int = 10) -> dict:
    """One ``step`` under torch.profiler: its top kernels by device time (on the CPU: top-level operators
    by CPU time), the sum of kernel time, the profiled wall time, and ``device_share`` = kernel time over
    ``step_ms`` (the unprofiled median): near 1 the GPU is busy; far below, the step waits on the host."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        wall_s = _seconds(step, device)
    times = kernel_times(prof, on_device=cuda)
    device_ms = sum(ms for _, ms, _ in times) if cuda else None
    return {"timed": "device kernels" if cuda else "top-level CPU operators", "wall_ms": 1e3 * wall_s,
            "device_ms": device_ms, "device_share": None if device_ms is None else device_ms / step_ms,
            "top": [{"name": name, "ms": ms, "calls": calls} for name, ms, calls in times[:top]]}


def _graph_break_count() -> int | None:
    """Graph breaks Dynamo has counted in this process (a compiled model that breaks into pieces runs partly
    eager: the count explains a compiled row no faster than the eager one)."""
    try:
        from torch._dynamo.utils import counters  # not a public API: the count is a hint, not a measurement
    except ImportError:
        return None
    return sum(counters["graph_break"].values())


COMPILE_SCOPES = ("model", "blocks")
COMPILE_MODES = TORCH_COMPILE_MODES


def compile_model(model: CausalLM, backend: str, scope: str = "model", mode: str = "default") -> Callable:
    """``torch.compile(model)`` ("model": one graph of the whole forward), or each block compiled in place
    ("blocks": identical blocks share one compiled graph, so compiling takes about one block's time; the
    embedding, final norm and LM head stay eager), in torch.compile's ``mode`` (:data:`COMPILE_MODES`). Dynamo's
    cache is reset first: entries of earlier models would count towards the recompile limit, past which Dynamo
    silently runs eager."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope must be one of {', '.join(COMPILE_SCOPES)}, got {scope!r}")
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    torch.compiler.reset()
    if scope == "blocks":
        for block in model.blocks:
            block.compile(backend=backend, mode=torch_compile_mode(mode))
        return model
    return torch.compile(model, backend=backend, mode=torch_compile_mode(mode))


def first_compiled_step(step: Callable[[], None], device: torch.device) -> tuple[float, int | None]:
    """Run the first step of a compiled model (the one that compiles): (its seconds, graph breaks counted)."""
    before = _graph_break_count()
    seconds = _seconds(step, device)
    after = _graph_break_count()
    return seconds, None if after is None or before is None else after - before


PIPELINED_ROUNDS = 3  # runs of plan.steps back-to-back steps; the median run is kept


def _clock_mark(device: torch.device) -> torch.cuda.Event | float:
    """A point on the device's timeline: a CUDA event recorded on the current stream, or the wall clock on the
    CPU (whose work is done when the call returns)."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _clock_ms(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
    """Milliseconds between two marks of :func:`_clock_mark` (CUDA: after a synchronisation)."""
    if isinstance(start, float):
        return (end - start) * 1e3
    return start.elapsed_time(end)


def pipelined_ms(step: Callable[[], None], steps: int, device: torch.device, rounds: int = PIPELINED_ROUNDS
                 ) -> float:
    """Median over ``rounds`` of the mean ms per step of ``steps`` steps run back to back with one synchronisation
    at the end: the host queues the next step's kernels while the GPU runs this one's, as in a training loop
    that does not wait on each step (the Trainer on CUDA).

    Each round starts with an untimed lead step, and on CUDA the clock is two events on the stream, around the
    timed steps: the clock starts when the GPU has finished the lead step, not when the host starts queueing.
    Without the lead step a round also counts its start (the GPU idle while the host queues the first kernels) and
    its end (the last step's kernels still queued when the host is done), which a long training run never sees
    again, and which weigh most in short rounds of steps whose host time is near their device time. What is timed
    is the steady rate: the device's time per step when the host keeps ahead of it, the host's when it does not."""
    runs = []
    for _ in range(rounds):
        synchronize(device)
        step()
        start = _clock_mark(device)
        for _ in range(steps):
            step()
        end = _clock_mark(device)
        synchronize(device)
        runs.append(_clock_ms(start, end) / steps)
    return statistics.median(runs)


def time_steps(step: Callable[[], None], plan: ModelBenchPlan, graphs: bool = False
               ) -> tuple[float, float, float | None]:
    """(ms per step of back-to-back steps (:func:`pipelined_ms`), median ms of a step synchronised on its own,
    CUDA peak GiB over the timed steps or None on the CPU), after ``plan.warmup`` untimed steps. A step whose
    host time (Python, launches) is near its device time runs much slower synchronised on its own than back to
    back, where the two overlap across steps. ``graphs``: the step replays CUDA graphs (compile mode
    reduce-overhead), whose replays allocate nothing: the peak is then the memory reserved, which holds the
    graphs' memory pools."""
    for _ in range(plan.warmup):
        step()
    cuda = plan.device.type == "cuda"
    if cuda:  # after warm-up the optimizer state exists: the peak is that of steady training
        torch.cuda.synchronize(plan.device)
        torch.cuda.reset_peak_memory_stats(plan.device)
    synced = median_ms(step, plan.device, repeats=plan.steps, warmup=0)
    ms = pipelined_ms(step, plan.steps, plan.device)
    if not cuda:
        return ms, synced, None
    peak = torch.cuda.max_memory_reserved if graphs else torch.cuda.max_memory_allocated
    return ms, synced, peak(plan.device) / GIB


def alternated_ratio(first: Callable[[], None], second: Callable[[], None], pairs: int, device: torch.device
                     ) -> float:
    """Median over ``pairs`` of ``first``'s wall time over ``second``'s, the two run in alternation (each call
    synchronised): what drifts during the run (clocks, host load) touches both sides of a pair alike."""
    ratios = [_seconds(first, device) / _seconds(second, device) for _ in range(max(pairs, 1))]
    return statistics.median(ratios)


ALTERNATED_RUNS = 5  # pairs of back-to-back runs in alternated_pipelined_ratio


def alternated_pipelined_ratio(first: Callable[[], None], second: Callable[[], None], steps: int,
                               device: torch.device, pairs: int = ALTERNATED_RUNS) -> float:
    """Median over ``pairs`` of ``first``'s ms per step over ``second``'s, each timed as a run of ``steps`` steps back
    to back (:func:`pipelined_ms`, one run), the two runs in alternation: the throughput ratio a training loop
    sees, with the drift between rows cancelled as in :func:`alternated_ratio`."""
    ratios = [pipelined_ms(first, steps, device, rounds=1) / pipelined_ms(second, steps, device, rounds=1)
              for _ in range(max(pairs, 1))]
    return statistics.median(ratios)


def _train_once(plan: ModelBenchPlan, row: TrainRow) -> None:
    """Fill ``row``'s measurements (raises on any failure; the caller records it)."""
    model = build_model(plan, row.mixer)
    row.params_m = sum(p.numel() for p in model.parameters()) / 1e6
    optimizer = make_optimizer(model, plan.device)
    gen = torch.Generator().manual_seed(plan.seed)
    compiled = row.mode == "compiled"
    net = compile_model(model, plan.compile_backend, plan.compile_scope, plan.compile_mode) if compiled else model
    if row.layout == "packed":  # the same tokens per step, as documents along one row; a new packing each step
        tokens = row.batch * row.seq_len
        ids = torch.randint(0, plan.vocab_size, (1, tokens + 1), generator=gen).to(plan.device)
        offsets = [packed_documents(tokens, *plan.doc_lengths, gen) for _ in range(plan.warmup + plan.steps + 1)]
        row.documents = sum(len(o) - 1 for o in offsets) / len(offsets)
        # the offsets stay on the CPU, as the Trainer keeps them (the model reads them with no device sync)
        packings = [torch.tensor(o, dtype=torch.int32) for o in offsets]
        step = make_packed_train_step(net, optimizer, ids, packings, plan.device, plan.dtype)
    else:
        ids = torch.randint(0, plan.vocab_size, (row.batch, row.seq_len + 1), generator=gen).to(plan.device)
        step = make_train_step(net, optimizer, ids, plan.device, plan.dtype)
    if compiled:  # compile time apart, and out of the timing
        row.compile_s, row.graph_breaks = first_compiled_step(step, plan.device)
    graphs = compiled and plan.compile_mode == "reduce-overhead"
    if row.layout == "packed":  # every later packing must reuse the first step's kernels
        step()
        variants = compiled_variants()
    row.ms_per_step, row.synced_ms_per_step, row.peak_gib = time_steps(step, plan, graphs)
    if row.layout == "packed" and variants is not None:
        row.kernels_compiled_after_first_step = compiled_variants() - variants
    row.tokens_per_s = row.batch * row.seq_len / (row.ms_per_step / 1e3)
    if row.layout == "packed":
        ids = torch.randint(0, plan.vocab_size, (row.batch, row.seq_len + 1), generator=gen).to(plan.device)
        fixed_step = make_train_step(net, optimizer, ids, plan.device, plan.dtype)
        fixed_step()  # a compiled model compiles the fixed-length shape here, out of the timing
        row.packed_ratio = alternated_pipelined_ratio(fixed_step, step, plan.steps, plan.device)
        row.packed_ratio_synced = alternated_ratio(fixed_step, step, plan.steps, plan.device)
    if plan.profile:
        row.profile = profile_step(step, plan.device, row.ms_per_step, top=plan.profile_top)


def error_text(err: BaseException, limit: int = 600) -> str:
    """``Type: message`` of an exception, cut to ``limit`` characters (compiler errors run to pages)."""
    return f"{type(err).__name__}: {str(err).strip()}"[:limit]


@contextlib.contextmanager
def recorded_errors(row: TrainRow | DecodeRow) -> Iterator[None]:
    """Record an exception of the block in ``row.error`` instead of raising it."""
    try:
        yield
    except Exception as err:  # out of memory, a compiler failure, a mixer's bug: this row says so, the run goes on
        row.error = error_text(err)


def free_memory(device: torch.device) -> None:
    """Return what the last model held, so that the next one starts from an empty allocator."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_training(plan: ModelBenchPlan, mixer: str, batch: int, seq_len: int, mode: str, layout: str = "fixed"
                     ) -> TrainRow:
    """One training row (``layout`` "fixed" or "packed"); an exception is recorded in it. Memory is freed before
    returning."""
    row = TrainRow(mixer, batch, seq_len, mode, layout=layout)
    with recorded_errors(row):
        _train_once(plan, row)
    if mode == "compiled":
        torch.compiler.reset()  # Dynamo's cache refers to the model: drop it before the next one
    free_memory(plan.device)
    return row


# --- decoding -------------------------------------------------------------------------------------------
def _eager_decoding(model: CausalLM, batch: int, context: int, tokens: int) -> float:
    return time_per_token(model, [context], tokens, batch_size=batch)[0]


def _static_decoding(model: CausalLM, batch: int, context: int, tokens: int) -> float:
    return time_per_token(model, [context], tokens, batch_size=batch, path="static")[0]


# How tokens are generated, by --decode-path: (model, batch, context, new tokens) -> median seconds per token.
DECODE_PATHS: dict[str, Callable[[CausalLM, int, int, int], float]] = {"eager": _eager_decoding,
                                                                       "static": _static_decoding}


def time_decoding(model: CausalLM, batch: int, context: int, tokens: int, path: str = "eager") -> float:
    """Median seconds per generated token (greedy) for ``batch`` sequences after an untimed prefill of
    ``context`` random tokens, generating ``tokens`` tokens the ``path`` way ("eager": ``model(ids)``
    then ``model(next_ids[:, None], cache)`` per token; "static": a StaticDecoder's steps, replaying one CUDA
    graph per token on CUDA)."""
    if path not in DECODE_PATHS:
        raise ValueError(f"unknown decode path {path!r}; available: {', '.join(DECODE_PATHS)}")
    return DECODE_PATHS[path](model, batch, context, tokens)


def measure_decoding(plan: ModelBenchPlan, rows: list[DecodeRow]) -> Iterator[DecodeRow]:
    """Measure ``rows`` (of one mixer: one model serves them all), yielding each as it completes; an
    exception is recorded in its row (one while building the model, in every row)."""
    model, failed = None, None
    try:
        model = build_model(plan, rows[0].mixer).eval().to(plan.dtype)
    except Exception as err:  # e.g. out of memory: every row of this mixer says so
        failed = error_text(err)
    for row in rows:
        row.error = failed
        if model is not None:
            with recorded_errors(row):
                seconds = time_decoding(model, row.batch, row.context, row.new_tokens, row.path)
                row.ms_per_token, row.tokens_per_s = 1e3 * seconds, row.batch / seconds
        yield row
    del model
    free_memory(plan.device)


# --- the run --------------------------------------------------------------------------------------------
def row_key(row: dict) -> tuple:
    """What identifies a row across runs (for --resume and to find its reference row)."""
    if row["kind"] == "train":
        layout = row.get("layout", "fixed")
        return ("train", row["mixer"], row["batch"], row["seq_len"], row["mode"]) + (() if layout == "fixed" else
                                                                                      (layout,))
    return ("decode", row["mixer"], row["batch"], row["context"], row["path"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def attach_ratios(row: dict, rows: list[dict]) -> dict:
    """Set ``row``'s ratios to the reference row of the same key measured in the same run among ``rows``."""
    ref_key = row_key({**row, "mixer": REFERENCE})
    same = [r for r in rows if row_key(r) == ref_key and r.get("run", 0) == row.get("run", 0)]
    ref = row if row["mixer"] == REFERENCE else (same[-1] if same else None)
    if ref is not None:
        row["speed_ratio"] = _ratio(row["tokens_per_s"], ref["tokens_per_s"])
        if row["kind"] == "train":
            row["memory_ratio"] = _ratio(row["peak_gib"], ref["peak_gib"])
            # a step time ratio is the inverse of a speed ratio; rows of older runs have no synced time
            row["synced_speed_ratio"] = _ratio(ref.get("synced_ms_per_step"), row.get("synced_ms_per_step"))
    if row["kind"] == "train" and row.get("layout", "fixed") == "packed":
        fixed_key = row_key({**row, "layout": "fixed"})
        fixed = [r for r in rows if row_key(r) == fixed_key and r.get("run", 0) == row.get("run", 0)]
        if fixed:
            row["fixed_row_ratio"] = _ratio(row["tokens_per_s"], fixed[-1]["tokens_per_s"])
    return row


def training_todo(plan: ModelBenchPlan, skip: Container[tuple] = ()) -> list[tuple[str, int, int, str, str]]:
    """(mixer, batch, seq_len, mode, layout) of the training rows to measure, in order: per shape and mode the
    reference first, measured again whenever another mixer's row is (ratios are taken within one process);
    with ``plan.packed`` each mixer's packed row right after its fixed-length one (measured again with it);
    rows whose :func:`row_key` is in ``skip`` are left out."""
    todo = []
    for batch, seq_len in plan.shapes:
        for mode in plan.modes:
            layouts = ["fixed", "packed"] if plan.packed else ["fixed"]
            keys = {(m, lay): row_key({"kind": "train", "mixer": m, "batch": batch, "seq_len": seq_len, "mode": mode,
                                       "layout": lay}) for m in plan.mixers for lay in layouts}
            group = [m for m in plan.mixers if any(keys[m, lay] not in skip for lay in layouts)]
            if group and group[0] != REFERENCE:
                group.insert(0, REFERENCE)
            todo += [(m, batch, seq_len, mode, lay) for m in group for lay in layouts]
    return todo


def decoding_todo(plan: ModelBenchPlan, skip: Container[tuple] = ()) -> dict[str, list[DecodeRow]]:
    """The decoding rows to measure by mixer (the reference first, at every batch and context that another
    mixer is measured at), leaving out those whose :func:`row_key` is in ``skip``."""
    grid = [(b, c) for b in plan.decode_batches for c in plan.decode_contexts]
    new = lambda mixer, b, c: DecodeRow(mixer, b, c, plan.decode_path, new_tokens=plan.decode_tokens)
    todo = {m: [new(m, b, c) for b, c in grid if ("decode", m, b, c, plan.decode_path) not in skip]
            for m in plan.mixers}
    needed = {(r.batch, r.context) for rows in todo.values() for r in rows}
    todo[REFERENCE] = [new(REFERENCE, b, c) for b, c in grid if (b, c) in needed]
    return {m: rows for m, rows in todo.items() if rows}


def run_model_bench(plan: ModelBenchPlan, done: list[dict] | None = None, run: int = 0,
                    on_row: Callable[[list[dict]], None] | None = None,
                    on_start: Callable[[str], None] | None = None) -> list[dict]:
    """Measure every training row (shape x mode x mixer, the reference first) then every decoding row
    (mixer x batch x context); rows whose key is among ``done`` (an earlier run's rows) are not measured
    again, except the reference's where another mixer's are. Returns all rows (``done`` first) as dicts,
    each with ``run`` (which invocation measured it) and its ratios. ``on_row(rows)`` is called with all
    rows so far as each row completes, ``on_start(label)`` before a model is measured."""
    rows = list(done or [])
    skip = {row_key(r) for r in rows}
    start = on_start or (lambda label: None)

    def add(row: TrainRow | DecodeRow) -> None:
        rows.append(attach_ratios({**asdict(row), "run": run}, rows))
        if on_row is not None:
            on_row(rows)

    for mixer, batch, seq_len, mode, layout in training_todo(plan, skip):
        start(f"train {mixer} {batch}x{seq_len} {mode}" + (" packed" if layout == "packed" else ""))
        add(measure_training(plan, mixer, batch, seq_len, mode, layout))
    for mixer, todo in decoding_todo(plan, skip).items():
        start(f"decode {mixer} ({plan.decode_path})")
        for row in measure_decoding(plan, todo):
            add(row)
    return rows


# --- output ---------------------------------------------------------------------------------------------
def table_cell(x: float | None, fmt: str = ".2f") -> str:
    """A number of a printed table in ``fmt``, "-" for None (not measured)."""
    return "-" if x is None else format(x, fmt)


def _note(row: dict) -> str:
    return "" if not row.get("error") else row["error"].splitlines()[0][:80]


def _shape(r: dict) -> str:
    if r.get("layout", "fixed") == "packed":
        return f"1x{r['batch'] * r['seq_len']} packed"
    return f"{r['batch']}x{r['seq_len']}"


def _top_kernel(r: dict) -> str:
    top = r["profile"]["top"]
    return f"{top[0]['name'][:50]} ({top[0]['ms']:.2f} ms)" if top else "-"


# Columns of the printed tables: (header, right-aligned, cell of a row).
Column = tuple[str, bool, Callable[[dict], str]]
TRAIN_COLUMNS: list[Column] = [
    ("mixer", False, lambda r: r["mixer"]), ("B x T", False, _shape), ("mode", False, lambda r: r["mode"]),
    ("tokens/s", True, lambda r: table_cell(r["tokens_per_s"], ",.0f")),
    (f"x {REFERENCE}", True, lambda r: table_cell(r["speed_ratio"])),
    ("ms/step", True, lambda r: table_cell(r["ms_per_step"], ".1f")),
    ("ms/step synced", True, lambda r: table_cell(r.get("synced_ms_per_step"), ".1f")),
    (f"synced x {REFERENCE}", True, lambda r: table_cell(r.get("synced_speed_ratio"))),
    ("peak GiB", True, lambda r: table_cell(r["peak_gib"])),
    (f"memory x {REFERENCE}", True, lambda r: table_cell(r["memory_ratio"])),
    ("x fixed", True, lambda r: table_cell(r.get("packed_ratio"))),
    ("x fixed synced", True, lambda r: table_cell(r.get("packed_ratio_synced"))),
    ("kernels compiled after step 1", True, lambda r: table_cell(r.get("kernels_compiled_after_first_step"), "d")),
    ("compile s", True, lambda r: table_cell(r["compile_s"], ".1f")),
    ("graph breaks", True, lambda r: table_cell(r["graph_breaks"], "d")), ("error", False, _note)]
DECODE_COLUMNS: list[Column] = [
    ("mixer", False, lambda r: r["mixer"]), ("B", True, lambda r: str(r["batch"])),
    ("context", True, lambda r: str(r["context"])), ("path", False, lambda r: r["path"]),
    ("ms/token", True, lambda r: table_cell(r["ms_per_token"], ".3f")),
    ("tokens/s", True, lambda r: table_cell(r["tokens_per_s"], ",.1f")),
    (f"x {REFERENCE}", True, lambda r: table_cell(r["speed_ratio"])), ("error", False, _note)]
PROFILE_COLUMNS: list[Column] = [
    ("mixer", False, lambda r: r["mixer"]), ("B x T", False, _shape), ("mode", False, lambda r: r["mode"]),
    ("step ms", True, lambda r: table_cell(r["ms_per_step"], ".1f")),
    ("profiled step ms", True, lambda r: table_cell(r["profile"]["wall_ms"], ".1f")),
    ("kernel ms", True, lambda r: table_cell(r["profile"]["device_ms"], ".1f")),
    ("kernel share", True, lambda r: table_cell(r["profile"]["device_share"], ".0%")), ("top", False, _top_kernel)]


def markdown_table(columns: list[Column], rows: list[dict]) -> str:
    """A Markdown table of ``rows`` with ``columns``."""
    lines = ["| " + " | ".join(head for head, _, _ in columns) + " |",
             "| " + " | ".join("---:" if right else "---" for _, right, _ in columns) + " |"]
    lines += ["| " + " | ".join(cell(r) for _, _, cell in columns) + " |" for r in rows]
    return "\n".join(lines)


def format_tables(rows: list[dict]) -> dict[str, str]:
    """The printed tables by name ("train", "profile", "decode"): those with at least one row. Rows of
    several runs (--resume) get a column "run": a ratio is taken to the reference row of its own run."""
    tables = {"train": (TRAIN_COLUMNS, [r for r in rows if r["kind"] == "train"]),
              "profile": (PROFILE_COLUMNS, [r for r in rows if r["kind"] == "train" and r.get("profile")]),
              "decode": (DECODE_COLUMNS, [r for r in rows if r["kind"] == "decode"])}
    first: list[Column] = [("run", True, lambda r: str(r.get("run", 0)))]
    if len({r.get("run", 0) for r in rows}) < 2:
        first = []
    return {name: markdown_table(first + cols, chosen) for name, (cols, chosen) in tables.items() if chosen}


def _progress_line(row: dict) -> str:
    if row["kind"] == "train":
        what, extra = f"{_shape(row)} {row['mode']}", f"peak {table_cell(row['peak_gib'])} GiB"
        if row.get("packed_ratio") is not None:
            extra += f", x{row['packed_ratio']:.2f} the fixed-length step (alternated)"
            if row.get("packed_ratio_synced") is not None:
                extra += f", x{row['packed_ratio_synced']:.2f} synced"
    else:
        what, extra = f"B={row['batch']} context={row['context']}", f"{table_cell(row['ms_per_token'], '.3f')} ms/token"
    if row["error"]:
        return f"  {row['mixer']} {what}: ERROR {_note(row)}"
    return f"  {row['mixer']} {what}: {row['tokens_per_s']:,.0f} tokens/s, x{table_cell(row['speed_ratio'])}, {extra}"


def _earlier_rows(path: str, plan: ModelBenchPlan, retry_errors: bool) -> tuple[list[dict], list[dict]]:
    """Rows and headers of an earlier run written to ``path`` with the same settings (--resume); without
    the rows that recorded an error when ``retry_errors`` (e.g. all those after a fault that left the CUDA
    context unusable)."""
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        data = json.load(f)
    header = data.get("header", {})
    if header.get("settings") != json.loads(json.dumps(plan.settings())):
        raise ValueError(f"--resume: {path} was measured with other settings ({header.get('settings')}); "
                         f"use another --out")
    rows = [r for r in data.get("rows", []) if not (retry_errors and r.get("error"))]
    return rows, [*data.get("earlier_runs", []), header]


def cli_bench_model(args: argparse.Namespace) -> int:
    """``linattn bench model``: run the plan of ``args``, print the tables, write ``--out`` as rows complete."""
    try:
        plan = plan_from_args(args)
        done, earlier = _earlier_rows(args.out, plan, args.retry_errors) if args.out and args.resume else ([], [])
    except ValueError as err:
        print(f"linattn bench model: {err}", file=sys.stderr)
        return 2
    argv = getattr(args, "argv", None)
    command = "linattn " + shlex.join(sys.argv[1:] if argv is None else argv)
    header = {**environment(plan.device), "command": command, "settings": plan.settings(), "measured": plan.lists()}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    progress = (lambda text: print(text, file=sys.stderr, flush=True)) if not args.no_progress else None

    def on_row(rows: list[dict]) -> None:  # save as we go: an interrupted run keeps what it measured
        if progress is not None:
            progress(_progress_line(rows[-1]))
        if args.out:
            write_rows(args.out, "model", {"header": header, "earlier_runs": earlier}, rows, announce=False)

    rows = run_model_bench(plan, done, len(earlier), on_row=on_row, on_start=progress)
    cfg = (f"d_model={plan.d_model} n_layers={plan.n_layers} n_heads={plan.n_heads} vocab={plan.vocab_size} "
           f"dtype={str(plan.dtype).replace('torch.', '')}")
    print(f"{header['device']}, torch {header['torch']}, triton {header['triton']}; {cfg}")
    titles = {"train": f"training step (median of {plan.steps} after {plan.warmup} warm-up)",
              "profile": "one profiled training step (kernel share: kernel time over the unprofiled step time)",
              "decode": f"decoding ({plan.decode_tokens} tokens after an untimed prefill)"}
    for name, table in format_tables(rows).items():
        print(f"\n{titles[name]}\n\n{table}")
    if args.out:
        print(f"\nwrote {args.out}")
    return 0
