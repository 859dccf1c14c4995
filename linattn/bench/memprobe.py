"""Peak CPU memory of one op call, measured in a fresh process.

``python -m linattn.bench.memprobe OP BACKEND B T H K V [fwd|fwdbwd]`` builds the op's example
inputs, resets the kernel's record of the process's peak resident set (writing 5 to
/proc/self/clear_refs, Linux), runs the op once, and prints the peak minus the resident set before
the call, in MiB. A fresh process per measurement keeps earlier allocations (and the allocator's
cache) out of the number.
"""

from __future__ import annotations

import subprocess
import sys

import torch


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set size


def measure(op: str, backend: str, B: int, T: int, H: int, K: int, V: int, mode: str = "fwdbwd") -> float:
    """Run in this process: peak RSS growth (MiB) of one forward (+ backward) call."""
    from linattn.ops import get_op

    spec = get_op(op)
    inputs = spec.example_inputs(B, T, H, K, V, dtype=torch.float32, device="cpu")
    if mode == "fwdbwd":
        for x in inputs.values():
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                x.requires_grad_(True)
    _reset_peak()
    base = _status_mb("VmRSS")
    o, _ = spec.fn(**inputs, backend=backend)
    if mode == "fwdbwd":
        o.float().sum().backward()
    return _status_mb("VmHWM") - base


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
