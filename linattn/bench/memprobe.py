"""Peak CPU memory of one op call, measured in a fresh process.

``python -m linattn.bench.memprobe OP BACKEND B T H K V [fwd|fwdbwd]`` builds the op's example
inputs, records the process's peak resident set size, runs the op once, and prints the growth of the
peak in MiB. A fresh process per measurement is the only way to read a CPU peak that earlier work
has not already raised.
"""

from __future__ import annotations

import resource
import subprocess
import sys

import torch


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(op: str, backend: str, B: int, T: int, H: int, K: int, V: int, mode: str = "fwdbwd") -> float:
    """Run in this process: peak RSS growth (MiB) of one forward (+ backward) call."""
    from linattn.ops import get_op

    spec = get_op(op)
    inputs = spec.example_inputs(B, T, H, K, V, dtype=torch.float32, device="cpu")
    if mode == "fwdbwd":
        for x in inputs.values():
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                x.requires_grad_(True)
    base = _peak_rss_mb()
    o, _ = spec.fn(**inputs, backend=backend)
    if mode == "fwdbwd":
        o.float().sum().backward()
    return _peak_rss_mb() - base


def probe(op: str, backend: str, B: int, T: int, H: int, K: int, V: int, mode: str = "fwdbwd") -> float:
    """Run :func:`measure` in a fresh Python process and return its result (MiB)."""
    out = subprocess.run(
        [sys.executable, "-m", "linattn.bench.memprobe", op, backend, *map(str, (B, T, H, K, V)), mode],
        capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    a = sys.argv[1:]
    torch.set_num_threads(torch.get_num_threads())
    print(f"{measure(a[0], a[1], *map(int, a[2:7]), *(a[7:8] or ['fwdbwd'])):.3f}")
