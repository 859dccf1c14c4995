"""Kernel launches with less host time: ``@fast_launch`` over ``@triton.jit`` kernels that the library launches.

Each ``kernel[grid](...)`` call makes Triton re-derive how every argument specialises the kernel, look the
result up, read its runtime settings and canonicalise the grid before it launches: about 34 us of host time per
launch on the H100 machine (Triton 3.6), against 11 us for the compiled kernel's launcher alone. A chunked op's
forward and backward launch about ten kernels, and at training lengths the GPU then waits on the host.

:class:`FastKernel` keeps the compiled kernel of each *launch key*: the device, the constexpr arguments and
launch options as given, and for every other argument what Triton specialises on (a tensor's dtype and whether
its address is 16-byte aligned; an int's width, and unless the kernel does not specialise on it, whether it is 1
and whether 16 divides it; a bool's value; float or None). The key is at least as fine as Triton's own, so a hit
is the kernel Triton would have chosen. The first launch of a key goes through Triton (which compiles or loads
the kernel), later ones call the compiled kernel's launcher on the current stream.

Launches go through Triton unchanged under its CPU interpreter, while a profiler or tool has set Triton's launch
hooks or replaced ``JITFunction.__getitem__`` (bench/triton_resources.py), with an argument of a kind the key
does not cover, and everywhere when the setting ``fast_launch`` is off (``LINATTN_FAST_LAUNCH=0``,
``linattn.settings(fast_launch=False)``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

from linattn import switches

_GETITEM = JITFunction.__getitem__
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_CONSTEXPR, _NOT_SPECIALISED, _SPECIALISED = 0, 1, 2


class FastKernel:
    """A launched ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` as with Triton (see the module
    docstring); other attributes are the JIT function's."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.direct = isinstance(kernel, JITFunction) and hasattr(triton, "knobs")
        # Triton reads TRITON_INTERPRET when a kernel is defined, so it is read here once, not per launch
        self.interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if self.direct:
            dns = set(kernel.do_not_specialize or ())
            self.names = tuple(kernel.arg_names)
            self.kinds = tuple(_CONSTEXPR if p.is_constexpr else
                               _NOT_SPECIALISED if (p.num in dns or p.name in dns) else _SPECIALISED
                               for p in kernel.params)
        self.compiled: dict[tuple, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        """Launch on the current CUDA stream (through Triton the first time per launch key)."""
        if not (self.direct and switches.current().fast_launch) or self.interpreted \
                or JITFunction.__getitem__ is not _GETITEM or launch_hooks_set():
            self.kernel[grid](*args, **kwargs)
            return
        values, options = self._bind(args, kwargs)
        key = None if values is None else self._key(values, options)
        compiled = None if key is None else self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and compiled is not None:
                self.compiled[key] = compiled.result() if hasattr(compiled, "result") else compiled
            return
        driver = triton.runtime.driver.active
        stream = driver.get_current_stream(key[0])
        n = len(grid)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *values)

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list | None, tuple]:
        """Every parameter's value in signature order, and the launch options (None when a parameter is
        missing: the kernel's defaults are left to Triton)."""
        if len(args) == len(self.names) and not any(n in kwargs for n in self.names):
            return list(args), tuple(kwargs.items())
        values = list(args)
        for name in self.names[len(args):]:
            if name not in kwargs:
                return None, ()
            values.append(kwargs[name])
        return values, tuple((k, v) for k, v in kwargs.items() if k not in self.names)

    def _key(self, values: list, options: tuple) -> tuple | None:
        key: list[Any] = [torch.cuda.current_device(), options]
        for value, kind in zip(values, self.kinds):
            if kind == _CONSTEXPR:
                key.append(value)
                continue
            kind_of = type(value)
            if kind_of is torch.Tensor or isinstance(value, torch.Tensor):
                key.append(value.dtype)
                key.append(value.data_ptr() & 15 == 0)
            elif kind_of is bool or value is None:
                key.append(value)
            elif kind_of is int:
                wide = not _INT32_MIN <= value <= _INT32_MAX
                key.append((wide,) if kind == _NOT_SPECIALISED else (wide, value == 1, value & 15 == 0))
            elif kind_of is float:
                key.append(float)
            else:
                return None
        return tuple(key)


def _hook_set(hook: Any) -> bool:
    """Whether a Triton launch hook is installed: newer Triton keeps an always-present chain of hooks
    (``HookChain``, empty unless a tool adds one) where older Triton kept None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else len(calls) > 0


def launch_hooks_set() -> bool:
    """Whether a profiler or tool has installed a Triton launch hook (launches then go through Triton, which calls
    it)."""
    runtime = triton.knobs.runtime
    return _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


def fast_launch(kernel: Any) -> FastKernel:
    """Decorator over ``@triton.jit`` for kernels launched from Python: see :class:`FastKernel`."""
    return FastKernel(kernel)
