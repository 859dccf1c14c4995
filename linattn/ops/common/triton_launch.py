"""Kernel launches with less host time: ``@fast_launch`` over ``@triton.jit`` kernels that the library launches.

Each ``kernel[grid](...)`` call makes Triton re-derive how every argument specialises the kernel, look the
result up, read its runtime settings and canonicalise the grid before it launches. Its compiled launcher then
turns every tensor argument into a device pointer by calling ``data_ptr()`` and asking the CUDA driver
(``cuPointerGetAttribute``) whether the pointer is a device one. A chunked op's forward and backward launch about
ten kernels of ten or more pointers each, and at training lengths the GPU then waits on the host: on the H100
machine (Triton 3.6) a launch cost about 55 us of host time, of which the pointer queries were the larger part.

:class:`FastKernel` keeps the compiled kernel of each *launch key*: the device, the constexpr arguments and
launch options as given, and for every other argument what Triton specialises on (a tensor's dtype and whether
its address is 16-byte aligned, and whether it is a CUDA tensor; an int's width, and unless the kernel does not
specialise on it, whether it is 1 and whether 16 divides it; a bool's value; float or None). The key is at least
as fine as Triton's own, so a hit is the kernel Triton would have chosen. The first launch of a key goes through
Triton (which compiles or loads the kernel, and checks every pointer: a CPU tensor fails there with Triton's
error, and its key is never kept), later ones call the compiled kernel's launcher on the current stream with
each tensor's address as an integer, which the launcher takes as it is. That is safe because the key is only
kept after Triton accepted the same kinds of argument, and a tensor's address is what ``data_ptr()`` returns.

Launches go through Triton unchanged under its CPU interpreter, while a profiler or tool has set Triton's launch
hooks or replaced ``JITFunction.__getitem__`` (bench/triton_resources.py), with an argument of a kind the key
does not cover, and everywhere when the setting ``fast_launch`` is off (``LINATTN_FAST_LAUNCH=0``,
``linattn.settings(fast_launch=False)``).
"""

from __future__ import annotations

import inspect
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
            self.name_set = frozenset(self.names)
            # a parameter left out of a launch takes its default, as Triton's binding gives it
            self.defaults = {p.name: p.default for p in kernel.params if p.default is not inspect.Parameter.empty}
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
        plan = None if values is None else self._plan(values, options)
        compiled = None if plan is None else self.compiled.get(plan[0])
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if plan is not None and compiled is not None:
                self.compiled[plan[0]] = compiled.result() if hasattr(compiled, "result") else compiled
            return
        stream = triton.runtime.driver.active.get_current_stream(plan[0][0])
        n = len(grid)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *plan[1])

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list | None, tuple]:
        """Every parameter's value in signature order (a parameter left out: its default), and the launch options
        (None when a parameter without a default is missing: the launch is then left to Triton)."""
        if not args:  # the library launches by keyword
            try:
                values = [kwargs[name] for name in self.names]
            except KeyError:  # a parameter left to its default
                values = None
            if values is not None:
                if len(kwargs) == len(values):
                    return values, ()
                return values, tuple(item for item in kwargs.items() if item[0] not in self.name_set)
        values = list(args)
        for name in self.names[len(args):]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                return None, ()
        return values, tuple((k, v) for k, v in kwargs.items() if k not in self.name_set)

    def _plan(self, values: list, options: tuple) -> tuple[tuple, list] | None:
        """(launch key, the values as the compiled launcher takes them: each tensor as its address), or None
        for an argument of a kind the key does not cover."""
        key: list[Any] = [torch.cuda.current_device(), options]
        raw = list(values)
        for i, kind in enumerate(self.kinds):
            value = values[i]
            if kind == _CONSTEXPR:
                key.append(value)
                continue
            kind_of = type(value)
            if kind_of is torch.Tensor or isinstance(value, torch.Tensor):
                address = value.data_ptr()
                key.append((value.dtype, address & 15 == 0, value.is_cuda))
                raw[i] = address
            elif kind_of is bool or value is None:
                key.append(value)
            elif kind_of is int:
                wide = not _INT32_MIN <= value <= _INT32_MAX
                key.append((wide,) if kind == _NOT_SPECIALISED else (wide, value == 1, value & 15 == 0))
            elif kind_of is float:
                key.append(float)
            else:
                return None
        return tuple(key), raw


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
