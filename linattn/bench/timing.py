"""Timing and peak-memory primitives for the benchmarks (CPU and CUDA).

Timings are medians over repeats after warm-up; on CUDA, each repeat is bracketed by
synchronisation so that asynchronous launches are counted. Figures are meant to be read as ratios
measured in one process on one device.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1,
              budget_s: float | None = None) -> float:
    """Median wall time of ``fn()`` in milliseconds (stops early once ``budget_s`` is spent)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    start_all = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if budget_s is not None and time.perf_counter() - start_all > budget_s:
            break
    return statistics.median(times)


def back_to_back_ms(fn: Callable[[], object], device: torch.device, calls: int = 20) -> float:
    """Wall time per call of ``fn()`` called ``calls`` times in a row with one synchronisation at the end (after one
    untimed call), in milliseconds: the rate at which a loop of such calls runs when nothing waits for their
    results, as a training loop. When the host issues work faster than the device does it, this is the device's
    time per call; when a call is host-bound (small shapes), it is the host's."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3 / calls


def cuda_peak_mb(fn: Callable[[], object], device: torch.device) -> float:
    """Peak CUDA memory allocated during ``fn()`` above what was allocated before, in MiB."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def format_row(row: dict) -> str:
    """One benchmark row as ``key=value`` pairs (floats to 4 significant digits), for progressive printing."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def write_rows(path: str, bench: str, meta: dict, rows: list[dict], *, announce: bool = True) -> None:
    """Write ``{"bench": bench, **meta, "rows": rows}`` as JSON to ``path`` (and say so when ``announce``).

    The file is replaced atomically (written beside it, then renamed), so a run killed while writing
    still leaves the previous complete file: benchmarks rewrite it after every row."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"bench": bench, **meta, "rows": rows}, f, indent=1)
    os.replace(tmp, path)
    if announce:
        print(f"wrote {path}", flush=True)


def triton_version() -> str | None:
    """Triton's version, or None where it does not import."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def environment(device: torch.device) -> dict:
    """Where a benchmark ran: UTC date, device name, torch and Triton versions."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": name,
            "torch": torch.__version__, "triton": triton_version()}
