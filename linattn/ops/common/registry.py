"""The op registry: per-op metadata and backend dispatch.

Each op module builds one :class:`OpSpec` and registers it; ``linattn.ops.list_ops()`` and
``linattn.ops.op_info(name)`` read the registry. ``OpSpec.resolve`` turns a ``backend=`` argument
into the implementation to call, with a clear error when that backend does not exist for the op.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from linattn import switches

from .checks import CHUNK_SIZES

BACKENDS = ("recurrent", "parallel", "chunk", "triton")
AUTO_ORDER_CPU = ("chunk", "parallel", "recurrent")


@dataclass
class OpSpec:
    """Metadata and implementations of one op.

    ``implementations`` maps a backend name to a callable with the op's full signature minus
    ``backend`` (inputs already validated). ``no_parallel_reason`` says why an op has no explicit
    matrix form, where it has none. ``example_inputs(B, T, H, K, V, *, dtype, device, seed, g_value)``
    returns a dict of keyword arguments for ``fn`` (q, k, v and the op's own arguments) with
    realistic values (e.g. L2-normalised keys for delta rules); ``g_value`` (when not None) sets every
    log gate to that constant. Benchmarks and registry-wide tests use it.
    """

    name: str
    family: str
    equation: str
    op_args: tuple[str, ...]
    state_shape: str
    fn: Callable | None = None
    step: Callable | None = None
    implementations: dict[str, Callable] = field(default_factory=dict)
    example_inputs: Callable[..., dict] | None = None
    auto_cuda: str = ""  # the backend "auto" takes on CUDA when there is no triton one ("" = as on CPU)
    triton_chunk_sizes: tuple[int, ...] = CHUNK_SIZES  # "auto" passes over triton for any other chunk_size
    no_parallel_reason: str = ""
    notes: str = ""

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(b for b in BACKENDS if b in self.implementations)

    def resolve(self, backend: str, device: torch.device, chunk_size: int | None = None) -> Callable:
        """The implementation for ``backend`` ("auto": the setting ``op_backend`` where this op has it, else
        triton on CUDA when present and it takes ``chunk_size``, else ``auto_cuda`` on CUDA when set, else chunk)."""
        if backend == "auto":  # the setting op_backend chooses for "auto" calls where this op has that backend
            preferred = switches.current().op_backend
            if preferred != "auto" and preferred in self.implementations:
                backend = preferred
        if backend == "auto":
            triton_fits = chunk_size is None or chunk_size in self.triton_chunk_sizes
            if device.type == "cuda" and "triton" in self.implementations and triton_fits:
                return self.implementations["triton"]
            if device.type == "cuda" and self.auto_cuda in self.implementations:
                return self.implementations[self.auto_cuda]
            for name in AUTO_ORDER_CPU:
                if name in self.implementations:
                    return self.implementations[name]
        if backend not in BACKENDS:
            raise ValueError(
                f"backend must be one of 'auto', {', '.join(repr(b) for b in BACKENDS)}; got {backend!r}"
            )
        if backend not in self.implementations:
            why = f" ({self.no_parallel_reason})" if backend == "parallel" and self.no_parallel_reason else ""
            raise ValueError(
                f"backend={backend!r} is not available for {self.name}{why}; "
                f"available: {', '.join(self.backends)}"
            )
        if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got device {device}); "
                "set TRITON_INTERPRET=1 to run the kernels on the CPU"
            )
        return self.implementations[backend]

    def packs_natively(self, arguments: dict) -> bool:
        """Whether a packed call with these arguments (by name) resolves to a backend that runs packed inputs itself
        (its implementation has ``native_cu_seqlens = True``); False where the arguments cannot be resolved (the
        op's own checks then name what is wrong)."""
        q = arguments.get("q")
        if not isinstance(q, torch.Tensor):
            return False
        try:
            impl = self.resolve(arguments.get("backend", "auto"), q.device, arguments.get("chunk_size"))
        except (TypeError, ValueError):
            return False
        return bool(getattr(impl, "native_cu_seqlens", False))

    def info(self) -> dict:
        """Plain-data description of the op (for ``linattn list`` and docs)."""
        return {
            "name": self.name,
            "family": self.family,
            "equation": self.equation,
            "args": list(self.op_args),
            "state_shape": self.state_shape,
            "backends": list(self.backends),
            "has_step": self.step is not None,
            "no_parallel_reason": self.no_parallel_reason,
            "notes": self.notes,
        }


_REGISTRY: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    """Add ``spec`` to the registry (re-registering a name replaces it)."""
    _REGISTRY[spec.name] = spec
    return spec


def get_op(name: str) -> OpSpec:
    """The spec of op ``name``; ValueError listing the known ops otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def list_ops() -> list[str]:
    """Names of all registered ops, sorted."""
    return sorted(_REGISTRY)
