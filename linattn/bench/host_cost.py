"""Host cost of the ops' Triton paths, measured without a GPU.

``python -m linattn.bench.host_cost [OP ...] [--B 1] [--T 64] [--H 2] [--K 16] [--V 16] [--repeats 30]`` runs one
forward and one backward of each op's triton backend on small CPU tensors with every kernel launch intercepted
(:func:`linattn.bench.triton_resources.triton_path_on_cpu`: nothing runs, outputs stay unwritten; value checks off,
as they are by default for CUDA tensors; the finiteness fast path that only CPU tensors take,
:func:`~linattn.ops.common.masking.all_finite_here`, off too, so the guarded products run their CUDA form) and
prints the median host time, the kernel launches and the top-level PyTorch operations of that call. On a GPU each
PyTorch operation is a launch too, and an eager training step whose layers make many of them waits on the host
(titans' gate coefficients were ~60 of them per layer: docs/benchmarks.md). Times here are the CPU's, lower than on
a GPU machine where allocations and launches cost more; the counts are the same. Default: every op with a triton
backend.

``--layers MIXER,...`` measures a whole layer instead: one training step (forward, cross-entropy, backward) of a
small CausalLM with CUDA's choices (the ops, ShortConvs and the layers' norm and gate kernels on Triton, launches
intercepted, under bf16 autocast), at 1 and at 3 layers; half the difference is one layer's share (the embedding,
head and loss cancel): its host ms, Triton launches and top-level PyTorch operations per training step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from unittest import mock

import torch

from linattn.bench.ops import OP_KWARGS
from linattn.bench.shape_args import add_shape_arguments
from linattn.bench.triton_resources import op_inputs, triton_path_on_cpu
from linattn.ops import get_op, list_ops


@dataclass
class HostCost:
    """One op's forward + backward through its triton backend: median host ms, kernel launches, top-level PyTorch
    operations."""

    op: str
    ms: float
    launches: int
    torch_ops: int


def cuda_guards():
    """A context in which :func:`~linattn.ops.common.masking.all_finite_here` answers False, as it does for CUDA
    tensors (it reads the values only on the CPU), for the guarded products of masking.py that the Triton paths
    call (tril_matmul and the attention guard)."""
    from linattn.ops.common import masking

    return mock.patch.object(masking, "all_finite_here", lambda *xs: False)


def _top_level_ops(call) -> int:
    """The PyTorch operations ``call()`` dispatches that no other operation called (each a kernel launch on a GPU).
    The backward pass's run under the autograd engine's events (not operations), so an operation counts when none
    of its enclosing events is an operation."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()

    def top_level(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in prof.events() if e.name.startswith("aten::") and top_level(e))


def host_cost(op: str, B: int = 1, T: int = 64, H: int = 2, K: int = 16, V: int = 16, repeats: int = 30,
              dtype: torch.dtype = torch.bfloat16) -> HostCost:
    """The :class:`HostCost` of ``op`` at this shape (after three untimed calls). RuntimeError under Triton's
    interpreter (TRITON_INTERPRET=1 when linattn was imported): its kernels would run, not be intercepted."""
    from linattn.ops.common.triton_utils import interpreting

    if interpreting():
        raise RuntimeError("host_cost needs the real Triton kernels, whose launches it intercepts: run it without "
                           "TRITON_INTERPRET=1")
    spec = get_op(op)
    inputs = op_inputs(op, B, T, H, K, V, dtype)
    launches: list = []

    def step() -> None:
        with triton_path_on_cpu() as recorded:
            o = spec.fn(**inputs, **OP_KWARGS.get(op, {}), backend="triton")[0]
            o.float().sum().backward()
        launches[:] = recorded

    with cuda_guards():
        ms, torch_ops = _timed(step, repeats)
    return HostCost(op, ms, len(launches), torch_ops)


def _timed(step, repeats: int) -> tuple[float, int]:
    """(median host ms of ``step()`` after three untimed calls, its top-level PyTorch operations)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), _top_level_ops(step)


def _import_layer_kernels() -> None:
    """Import every Triton kernel module of the ops and layers now, without the interpreter: a module first imported
    inside :func:`triton_path_on_cpu` (the layers import theirs on first use) would define interpreted kernels,
    which run instead of being intercepted."""
    import importlib
    import pkgutil

    import linattn.layers
    import linattn.ops

    for package in (linattn.layers, linattn.ops):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if "triton" in module.name.rsplit(".", 1)[-1] or module.name.endswith("shortconv_joint"):
                importlib.import_module(module.name)


def _model_step_cost(mixer: str, n_layers: int, T: int, repeats: int) -> tuple[float, int, int]:
    """(median host ms, launches, top-level PyTorch operations) of one training step of a small CausalLM."""
    import linattn
    from linattn.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(mixer=mixer, d_model=64, n_layers=n_layers, n_heads=2, vocab_size=64))
    ids = torch.randint(0, 64, (1, T + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    launches: list = []

    def step() -> None:
        with triton_path_on_cpu() as recorded:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, _ = model(inputs, use_cache=False)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
        launches[:] = recorded
        model.zero_grad(set_to_none=True)

    with linattn.settings(op_backend="triton", shortconv_backend="triton", fused_backend="triton"), cuda_guards():
        ms, torch_ops = _timed(step, repeats)
    return ms, len(launches), torch_ops


def layer_host_cost(mixer: str, T: int = 64, repeats: int = 30) -> HostCost:
    """One layer's share of a CausalLM training step on CUDA's choices (module docstring): the difference between
    3 layers and 1, halved. RuntimeError under Triton's interpreter, as :func:`host_cost`."""
    from linattn.ops.common.triton_utils import interpreting

    if interpreting():
        raise RuntimeError("host_cost needs the real Triton kernels, whose launches it intercepts: run it without "
                           "TRITON_INTERPRET=1")
    _import_layer_kernels()
    one, three = (_model_step_cost(mixer, n, T, repeats) for n in (1, 3))
    ms, launches, ops = ((b - a) / 2 for a, b in zip(one, three))
    return HostCost(mixer, ms, round(launches), round(ops))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m linattn.bench.host_cost", description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="*", help="op names (default: every op with a triton backend)")
    add_shape_arguments(p, B=1, T=64, H=2, K=16, V=16)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--layers", default=None, metavar="MIXER,...",
                   help="measure one layer's share of a small CausalLM's training step for these mixers instead "
                        "(host ms, launches and PyTorch operations per layer; --T is the sequence length)")
    a = p.parse_args(argv)
    if a.layers is not None:
        mixers = [m for m in a.layers.split(",") if m]
        if not mixers:
            p.error("--layers: give at least one mixer name")
        print(f"{'layer':<22} {'host ms':>8} {'launches':>9} {'torch ops':>10}")
        for mixer in mixers:
            c = layer_host_cost(mixer, a.T, a.repeats)
            print(f"{c.op:<22} {c.ms:8.2f} {c.launches:9d} {c.torch_ops:10d}")
        return
    ops = a.ops or [op for op in list_ops() if "triton" in get_op(op).backends]
    print(f"{'op':<22} {'host ms':>8} {'launches':>9} {'torch ops':>10}")
    for op in ops:
        c = host_cost(op, a.B, a.T, a.H, a.K, a.V, a.repeats)
        print(f"{c.op:<22} {c.ms:8.2f} {c.launches:9d} {c.torch_ops:10d}")


if __name__ == "__main__":
    main()
