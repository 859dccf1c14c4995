"""``linattn bench ops``: per op and sequence length, forward and forward+backward time of every
backend, torch SDPA (causal flash attention), FLA (when importable) and, for forgetting_attn on CUDA, torch's
FlexAttention (``--impls ...,flex``; flex.py) in the same process, with ratios and peak memory. Forward+backward is
timed twice: each call synchronised (the ratios' figure), and calls back to back with one synchronisation at the
end, the rate of a training loop (host-bound small calls show their host time there).

Speed-ups are reported as ``other_time / our_time`` (above 1: ours is faster).
"""

from __future__ import annotations

import contextlib
import importlib
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from linattn.ops import get_op
from linattn.switches import settings

from .flex import flex_call
from .memprobe import probe
from .timing import back_to_back_ms, cuda_peak_mb, median_ms

# FLA's kernels for the ops that have one (chunk kernels; the parallel ones of the softmax family), same argument
# names and [B, T, H, K] layout.
FLA_FUNCTIONS = {
    "simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla"),
    "gla": ("fla.ops.gla", "chunk_gla"),
    "delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule"),
    "gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "retention": ("fla.ops.retention", "chunk_retention"),
    "linear_attn": ("fla.ops.linear_attn", "chunk_linear_attn"),
    "ttt_linear": ("fla.ops.ttt", "chunk_ttt_linear"),
    "mesa_net": ("fla.ops.mesa_net", "chunk_mesa_net"),
    "forgetting_attn": ("fla.ops.forgetting_attn", "parallel_forgetting_attn"),
    "path_attn": ("fla.ops.path_attn", "parallel_path_attn"),
}


def _fla_ttt_linear(x: dict) -> dict:
    """FLA's TTT-Linear always has the inner LayerNorm (weight 1, bias 0 here, as ours by default), eta [B, T, H, 1]
    and mini-batches of chunk_size = 16 tokens."""
    H, V = x["v"].shape[-2:]
    w = torch.ones(H, V, device=x["v"].device, dtype=x["v"].dtype)
    return dict(q=x["q"], k=x["k"], v=x["v"], w=w, b=torch.zeros_like(w), eta=x["eta"][..., None], chunk_size=16)


# FLA's chunk_mesa_net runs a fixed number of conjugate-gradient steps (30 by default); ours is timed with as many.
MESA_CG_STEPS = 30


def _fla_mesa_net(x: dict) -> dict:
    """Same names and shapes as ours (lamb [H, K]); the CG step count made explicit on both sides."""
    return dict(x, max_CG_iteration=MESA_CG_STEPS)


def _fla_path_attn(x: dict) -> dict:
    """FLA's parallel_path_attn asserts float32 w, beta and g ("to preserve precision"); the rest as ours."""
    return {**x, **{n: x[n].float() for n in ("w", "beta", "g") if x.get(n) is not None}}


# How an op's example inputs become FLA's arguments, where the names or shapes differ.
FLA_ARGUMENTS = {"ttt_linear": _fla_ttt_linear, "mesa_net": _fla_mesa_net, "path_attn": _fla_path_attn}
# Keywords of our op in the benchmark: ttt_linear as the paper's block (and FLA's kernel), with the inner norm;
# mesa_net with FLA's solver (CG, a fixed step count) rather than our default exact solve.
OP_KWARGS = {"ttt_linear": {"inner_norm": True}, "mesa_net": {"solver": "cg", "cg_steps": MESA_CG_STEPS}}


@dataclass
class BenchRow:
    """One measured implementation at one shape. Times in ms (None: not run), memory in MiB."""

    op: str
    T: int
    impl: str
    fwd_ms: float | None
    fwdbwd_ms: float | None
    peak_mb: float | None
    # forward+backward per call in a loop synchronised once at its end (timing.back_to_back_ms): below fwdbwd_ms
    # (each call synchronised) by the device's latency, or by nothing when the call is host-bound
    fwdbwd_b2b_ms: float | None = None
    note: str = ""


def launch_label(impl: str, launch: dict | None) -> str:
    """A row's implementation name: ``impl``, followed by the launch setting it ran under, if any."""
    return impl if launch is None else f"{impl} {json.dumps(launch, separators=(',', ':'))}"


def fla_function(op: str):
    if op not in FLA_FUNCTIONS:
        return None
    module, name = FLA_FUNCTIONS[op]
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # FLA missing or broken on this stack: the row is simply absent
        return None


def fla_output(result):
    """The output of an FLA function: the first element of a tuple (output, state), or the tensor it returned
    (parallel_forgetting_attn returns o alone)."""
    return result[0] if isinstance(result, tuple) else result


def _timed(call, inputs: dict, device: torch.device, repeats: int, budget_s: float, memory: bool,
           fwdbwd: bool) -> tuple[float, float | None, float | None, float | None]:
    leaves = {n: (x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
              for n, x in inputs.items()}

    def fwd():
        with torch.no_grad():
            call(leaves)

    def fwd_bwd():
        out = call(leaves)
        out.backward(torch.ones_like(out))
        for x in leaves.values():
            if isinstance(x, torch.Tensor):
                x.grad = None

    fwd_ms = median_ms(fwd, device, repeats, budget_s=budget_s)
    fb_ms = median_ms(fwd_bwd, device, repeats, budget_s=budget_s) if fwdbwd else None
    # the loop is as long as the repeats, unless the calls are short (then 20 calls, to see the host's rate)
    b2b_ms = back_to_back_ms(fwd_bwd, device, max(repeats, 20) if fb_ms < 10 else repeats) if fwdbwd else None
    peak = cuda_peak_mb(fwd_bwd if fwdbwd else fwd, device) if memory and device.type == "cuda" else None
    return fwd_ms, fb_ms, peak, b2b_ms


def bench_op(op: str, T: int, impl: str, *, B: int, H: int, K: int, V: int, dtype: torch.dtype,
             device: torch.device, repeats: int = 5, budget_s: float = 30.0, memory: bool = True,
             fwdbwd: bool = True, inputs: dict | None = None) -> BenchRow | None:
    """Time one implementation ("recurrent", "parallel", "chunk", "triton", "fla", "sdpa", "flex") of ``op``
    (``inputs``: the op's ``example_inputs`` at this shape, made here when None)."""
    spec = get_op(op)
    if inputs is None:
        inputs = spec.example_inputs(B, T, H, K, V, dtype=dtype, device=device)
    if impl == "sdpa":
        q, k, v = (inputs[n].transpose(1, 2) for n in ("q", "k", "v"))
        call = lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)
        inputs = {"q": q, "k": k, "v": v}
    elif impl == "fla":
        fn = fla_function(op)
        if fn is None:
            return None
        arguments = FLA_ARGUMENTS.get(op, lambda x: x)
        call = lambda x: fla_output(fn(**arguments(x)))
    elif impl == "flex":
        call = flex_call(op, device)
        if call is None:
            return None
    else:
        if impl not in spec.backends:
            return None
        call = lambda x: spec.fn(**x, **OP_KWARGS.get(op, {}), backend=impl)[0]
    try:
        fwd_ms, fb_ms, peak, b2b_ms = _timed(call, inputs, device, repeats, budget_s, memory, fwdbwd)
    except Exception as err:  # e.g. FLA refusing a kernel on this GPU: report it, keep going
        return BenchRow(op, T, impl, None, None, None, note=f"{type(err).__name__}: {str(err)[:80]}")
    if memory and device.type == "cpu" and impl in spec.backends and impl != "recurrent":
        peak = probe(op, impl, B, T, H, K, V, "fwdbwd" if fwdbwd else "fwd")  # fresh process: a clean peak
    return BenchRow(op, T, impl, fwd_ms, fb_ms, peak, b2b_ms)


def run_ops_bench(ops: list[str], lengths: list[int], impls: list[str], *, B: int, H: int, K: int, V: int,
                  dtype: torch.dtype, device: torch.device, repeats: int = 5, budget_s: float = 30.0,
                  max_recurrent_T: int = 4096, max_parallel_T: int = 8192, memory: bool = True,
                  progress: bool = True, on_row=None, launches: list[dict] | None = None) -> list[BenchRow]:
    """Measure every (op, T, impl); the recurrent and parallel forms are skipped above their limits
    (a Python loop over T tokens, and a T x T matrix). Each of ``launches`` (triton_launch settings) adds a row of
    the triton backend run under it, named :func:`launch_label`, in the same process as the others (its ratios
    are to the same SDPA and FLA rows). ``on_row(row)`` is called as each row is measured, so that a long run loses
    nothing when it is interrupted."""
    from tqdm import tqdm

    jobs = [(op, T, impl, None) for op in ops for T in lengths for impl in impls]
    jobs += [(op, T, "triton", launch) for op in ops for T in lengths for launch in launches or []]
    rows: list[BenchRow] = []
    sdpa_done: set[int] = set()
    cached: tuple[str, int, dict] | None = None  # one shape's inputs, shared by its impls (made on the CPU,
    # for identical numbers on every device, which takes seconds at T = 65536)

    def inputs_for(name: str, T: int) -> dict:
        nonlocal cached
        if cached is None or cached[:2] != (name, T):
            cached = None  # free the previous shape first
            cached = (name, T, get_op(name).example_inputs(B, T, H, K, V, dtype=dtype, device=device))
        return cached[2]

    for op, T, impl, launch in tqdm(jobs, disable=not progress, desc="bench ops"):
        if (impl == "recurrent" and T > max_recurrent_T) or (impl == "parallel" and T > max_parallel_T):
            continue
        if impl == "sdpa":  # one SDPA row per length, shared by every op
            if T in sdpa_done:
                continue
            sdpa_done.add(T)
            row = bench_op(ops[0], T, "sdpa", B=B, H=H, K=K, V=V, dtype=dtype, device=device, repeats=repeats,
                           budget_s=budget_s, memory=memory, inputs=inputs_for(ops[0], T))
            row.op = "(sdpa causal)"
        else:
            # no launch: the settings in force (LINATTN_TRITON_LAUNCH included) stay
            with settings(triton_launch=launch) if launch is not None else contextlib.nullcontext():
                row = bench_op(op, T, impl, B=B, H=H, K=K, V=V, dtype=dtype, device=device, repeats=repeats,
                               budget_s=budget_s, memory=memory, inputs=inputs_for(op, T))
            if row is not None:
                row.impl = launch_label(impl, launch)
        if row is not None:
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(rows: list[BenchRow]) -> str:
    """Markdown table with, per row, speed-ups (fwd+bwd) over recurrent, SDPA and FLA at the same T."""
    by_key = {(r.op, r.T, r.impl): r for r in rows}
    sdpa = {r.T: r for r in rows if r.impl == "sdpa"}
    lines = ["| op | T | impl | fwd ms | fwd+bwd ms | fwd+bwd ms, back to back | peak MiB | x recurrent | x sdpa "
             "| x fla | note |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def ratio(other: BenchRow | None, r: BenchRow) -> str:
        if other is None or other.fwdbwd_ms is None or r.fwdbwd_ms is None:
            return "-"
        return f"{other.fwdbwd_ms / r.fwdbwd_ms:.2f}"

    for r in rows:
        rec = by_key.get((r.op, r.T, "recurrent"))
        fla = by_key.get((r.op, r.T, "fla"))
        own = r.impl not in ("sdpa",)
        lines.append(
            f"| {r.op} | {r.T} | {r.impl} | {_fmt(r.fwd_ms)} | {_fmt(r.fwdbwd_ms)} | {_fmt(r.fwdbwd_b2b_ms)} | "
            f"{_fmt(r.peak_mb, 1)} | "
            f"{ratio(rec, r) if own and r.impl != 'recurrent' else '-'} | "
            f"{ratio(sdpa.get(r.T), r) if own else '-'} | "
            f"{ratio(fla, r) if own and r.impl not in ('fla',) else '-'} | {r.note} |"
        )
    return "\n".join(lines)


def rows_as_dicts(rows: list[BenchRow]) -> list[dict]:
    return [asdict(r) for r in rows]
