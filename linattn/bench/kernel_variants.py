"""How many compiled variants linattn's Triton kernels hold: the sum, over every kernel defined in a loaded
``linattn`` module, of the entries in its per-device caches (one entry per specialisation Triton compiled or
loaded from its disk cache in this process). Taken before and after a stretch of work, the difference is the
number of kernels that work compiled: a benchmark uses it to show that new inputs (a new packing of documents,
new lengths) compile nothing."""

from __future__ import annotations

import sys
from typing import Any


def _jit_function(value: Any) -> Any | None:
    """The Triton JIT function inside ``value``, or None: anything holding per-device kernel caches counts. Our
    launch wrapper forwards attribute reads to its kernel; autotuners and heuristics hold theirs as ``fn``."""
    for _ in range(4):  # wrappers nest a few deep at most (launch wrapper -> autotuner -> heuristics -> jit)
        if isinstance(getattr(value, "device_caches", None), dict):
            return value
        value = getattr(value, "fn", None)
        if value is None:
            return None
    return None


def compiled_variants(prefix: str = "linattn") -> int | None:
    """The number of compiled kernel variants held by the Triton kernels of the loaded modules named ``prefix``
    or ``prefix.*``; None when none of them holds a cache (Triton not loaded, or kernels run by its
    interpreter, which compiles nothing)."""
    seen: set[int] = set()
    total = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for value in list(vars(module).values()):
            fn = _jit_function(value)
            # keyed by the caches themselves: a wrapper and the JIT function it wraps share them
            if fn is None or id(fn.device_caches) in seen:
                continue
            seen.add(id(fn.device_caches))
            # each device's entry is a tuple whose first item maps a specialisation key to its compiled kernel
            total += sum(len(entry[0]) for entry in fn.device_caches.values())
    return total if seen else None
