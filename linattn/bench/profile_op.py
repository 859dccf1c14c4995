"""Where does an op's time go? ``python -m linattn.bench.profile_op OP [--backend chunk] [--T 16384]
[--device cuda]`` runs forward+backward under torch.profiler and prints the most expensive kernels."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from linattn.ops import get_op


def profile_op(op: str, backend: str, B: int, T: int, H: int, K: int, V: int, device: str, dtype: torch.dtype,
               rows: int = 25) -> str:
    spec = get_op(op)
    inputs = spec.example_inputs(B, T, H, K, V, dtype=dtype, device=device)
    for x in inputs.values():
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x.requires_grad_(True)

    def step():
        o, _ = spec.fn(**inputs, backend=backend)
        o.backward(torch.ones_like(o))

    step()  # warm-up (compilation, allocator)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("op")
    p.add_argument("--backend", default="chunk")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    print(profile_op(a.op, a.backend, a.B, a.T, a.H, a.K, a.V, a.device, getattr(torch, a.dtype)))
