"""Where does an op's time go? ``python -m linattn.bench.profile_op OP [OP ...] [--backend triton|chunk|fla]
[--T 16384] [--device cuda]`` runs one forward and one backward under torch.profiler (after a warm-up)
and prints, for each pass, the device kernels by total time (the CPU operators on a CPU run)."""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from linattn.bench.ops import FLA_ARGUMENTS, OP_KWARGS, fla_function, fla_output
from linattn.bench.shape_args import add_shape_arguments
from linattn.ops import get_op


def kernel_times(prof, on_device: bool) -> list[tuple[str, float, int]]:
    """(name, total ms, calls) of every device kernel (``on_device``) or top-level CPU operator of a
    finished ``torch.profiler.profile``, longest first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        is_kernel = ev.device_type == torch.autograd.DeviceType.CUDA
        if on_device != is_kernel or (not on_device and ev.cpu_parent is not None):
            continue
        totals[ev.name][0] += ev.device_time if on_device else ev.cpu_time_total
        totals[ev.name][1] += 1
    return sorted(((name, us / 1e3, int(count)) for name, (us, count) in totals.items()), key=lambda t: -t[1])


def _kernel_table(prof, on_device: bool, rows: int) -> tuple[str, float]:
    """Kernels (device) or top-level operators (CPU) by total time: (table, total ms)."""
    times = kernel_times(prof, on_device)
    total = sum(ms for _, ms, _ in times)
    lines = []
    for name, ms, count in times[:rows]:
        share = ms / total if total else 0.0
        lines.append(f"  {ms:8.3f} ms {share:6.1%} x{count:<3d} {name[:90]}")
    return "\n".join(lines), total


def profile_op(op: str, backend: str, B: int, T: int, H: int, K: int, V: int, device: str, dtype: torch.dtype,
               rows: int = 25) -> str:
    """The kernel tables of one forward and one backward of ``op`` (backend "fla": FLA's chunk kernel), with the
    settings of ``linattn bench ops`` (ttt_linear with its inner norm, mesa_net with 30 CG steps on both sides) so
    that the tables explain its rows."""
    spec = get_op(op)
    inputs = spec.example_inputs(B, T, H, K, V, dtype=dtype, device=device)
    for x in inputs.values():
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x.requires_grad_(True)
    if backend == "fla":
        fla_fn = fla_function(op)
        if fla_fn is None:
            return f"{op}: FLA not importable or has no chunk kernel for it"
        arguments = FLA_ARGUMENTS.get(op, lambda x: x)
        call = lambda: fla_output(fla_fn(**arguments(inputs)))
    else:
        call = lambda: spec.fn(**inputs, **OP_KWARGS.get(op, {}), backend=backend)[0]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    try:
        out = call()  # warm-up (compilation, autotuning, allocator)
        out.backward(torch.ones_like(out))
    except Exception as err:  # e.g. FLA refusing this GPU
        return f"{op} [{backend}]: {type(err).__name__}: {str(err)[:200]}"
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as fwd_prof:
        out = call()
        sync()
    grad = torch.ones_like(out)
    with profile(activities=activities) as bwd_prof:
        out.backward(grad)
        sync()
    parts = []
    for label, prof in (("forward", fwd_prof), ("backward", bwd_prof)):
        table, total = _kernel_table(prof, device == "cuda", rows)
        where = "in kernels" if device == "cuda" else "in top-level operators (CPU)"
        parts.append(f"{op} [{backend}] {label}: {total:.3f} ms {where}\n{table}")
    return "\n".join(parts)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("ops", nargs="+")
    p.add_argument("--backend", default="chunk", help="an op backend, or fla (FLA's chunk kernel)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_shape_arguments(p, B=4, T=16384, H=16)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    for name in a.ops:
        print(profile_op(name, a.backend, a.B, a.T, a.H, a.K, a.V, a.device, getattr(torch, a.dtype), a.rows),
              flush=True)
