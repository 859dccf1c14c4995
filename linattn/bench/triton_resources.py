"""Registers, stack (spills) and shared memory of an op's Triton kernels, compiled for a GPU without one.

``python -m linattn.bench.triton_resources OP [OP ...] [--T 256] [--K 128] [--V 128] [--dtype bfloat16]
[--arch 90]`` runs the op's Triton forward and backward launchers on CPU tensors with the kernel launches
intercepted (nothing runs), compiles every launched kernel for ``sm_<arch>`` with the launch's own
constexprs, warps and stages, and prints what ``cuobjdump -res-usage`` reports. Stack bytes are register
spills; a kernel that needs more shared memory than the GPU has (an H100: 227 KB) fails to launch there.
Shapes other than T only change the constexprs; T changes nothing (kernels do not specialise on it).

On sm_90 it also counts, in the kernel's SASS, the Hopper tensor-core instructions (``HGMMA``) and the waits for
them (``WARPGROUP.DEPBAR``). A chain of products issued back to back ends in one wait; a kernel with about as many
waits as products issues them one at a time (forgetting_attn's forward did, in every loop, while its masked blocks
edited the value tile in registers: docs/triton.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from linattn.bench.ops import OP_KWARGS
from linattn.bench.shape_args import add_shape_arguments
from linattn.ops import get_op

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}


@dataclass
class Launch:
    """One intercepted kernel launch."""

    fn: JITFunction
    args: tuple
    kwargs: dict


@contextmanager
def intercepted_launches():
    """Within the block, ``kernel[grid](...)`` records a Launch instead of running (outputs stay unwritten)."""
    launches: list[Launch] = []
    original = JITFunction.__getitem__

    def record(self, grid):
        return lambda *args, **kwargs: launches.append(Launch(self, args, kwargs))

    JITFunction.__getitem__ = record
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = original


def _source(launch: Launch) -> tuple[ASTSource, dict]:
    """The ASTSource of a launch (pointers and specialisable ints marked 16-divisible) and its options."""
    fn = launch.fn
    options = {k: v for k, v in launch.kwargs.items() if k in ("num_warps", "num_stages")}
    values = dict(zip(fn.arg_names, launch.args))
    values.update({k: v for k, v in launch.kwargs.items() if k in fn.arg_names})
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = values[name]
        if name == "UP":  # the interpreter's upcast of bf16 products (triton_utils.upcast_dots): off on a GPU
            value = False
        if param.is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0 and name not in fn.do_not_specialize and i not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"argument {name} of {fn.__name__}: cannot type {type(value).__name__}")
    return ASTSource(fn, signature, constexprs, attrs), options


def resource_usage(launch: Launch, arch: int = 90) -> dict:
    """{"kernel", "warps", "stages", "regs", "stack", "shared", "mma", "mma_waits"} of one launch compiled for
    sm_<arch> (mma, mma_waits: HGMMA and WARPGROUP.DEPBAR instructions in its SASS; 0 off sm_90)."""
    src, options = _source(launch)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        report = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", report))
    return {"kernel": launch.fn.__name__, "warps": options.get("num_warps", 4), "stages": options.get("num_stages", 3),
            "regs": int(found.get("REG", 0)), "stack": int(found.get("STACK", 0)),
            "shared": int(compiled.metadata.shared), "mma": len(re.findall(r"\bHGMMA\.", sass)),
            "mma_waits": len(re.findall(r"\bWARPGROUP\.DEPBAR\b", sass))}


@contextmanager
def triton_path_on_cpu():
    """Within the block an op's triton backend takes CPU tensors and records its kernel launches instead of running
    them (yields the list of Launch); the ops' value checks are off, as they would read the unwritten outputs."""
    from linattn.ops.common import values

    # the kernels are already compiled-on-demand JITFunctions (imported without the interpreter); the variable only
    # lets the op accept CPU tensors for its triton backend, whose launches are intercepted
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with intercepted_launches() as launches, values.value_checks(False):
            yield launches
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def op_inputs(op: str, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype) -> dict:
    """``op``'s example inputs on the CPU, floating-point ones requiring grad."""
    return {n: (x.requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in get_op(op).example_inputs(B, T, H, K, V, dtype=dtype).items()}


def op_launches(op: str, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype) -> list[Launch]:
    """The kernel launches of one forward and one backward of ``op``'s triton backend (first of each kernel), with
    ``linattn bench ops``' settings (e.g. mesa_net's CG solver, which has kernels of its own)."""
    inputs = op_inputs(op, B, T, H, K, V, dtype)
    with triton_path_on_cpu() as launches:
        o, _ = get_op(op).fn(**inputs, **OP_KWARGS.get(op, {}), backend="triton")
        o.backward(torch.ones_like(o))
    seen, unique = set(), []
    for launch in launches:
        if launch.fn.__name__ not in seen:
            seen.add(launch.fn.__name__)
            unique.append(launch)
    return unique


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="+")
    add_shape_arguments(p, B=1, T=256, H=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--arch", type=int, default=90)
    a = p.parse_args()
    print(f"{'op':<18} {'kernel':<26} {'warps':>5} {'stages':>6} {'regs':>5} {'stack':>6} {'shared':>7} {'mma':>5} "
          f"{'waits':>5}")
    for op in a.ops:
        for launch in op_launches(op, a.B, a.T, a.H, a.K, a.V, getattr(torch, a.dtype)):
            r = resource_usage(launch, a.arch)
            print(f"{op:<18} {r['kernel']:<26} {r['warps']:>5} {r['stages']:>6} {r['regs']:>5} {r['stack']:>6} "
                  f"{r['shared']:>7} {r['mma']:>5} {r['mma_waits']:>5}", flush=True)


if __name__ == "__main__":
    main()
