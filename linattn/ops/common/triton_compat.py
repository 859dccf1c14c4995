"""Import Triton for the kernels, and keep its CPU interpreter working on today's NumPy.

Triton's interpreter (``TRITON_INTERPRET=1``, used to run the kernels on the CPU in CI) has two
faults that :func:`patch_interpreter` mends, touching nothing else:

- it turns scalar values into Python ints with ``int(array)``; NumPy >= 2.4 refuses that for
  1-element arrays, so any kernel with a loop bound computed at run time fails;
- it rounds float32 -> bfloat16 conversions by truncation, where GPUs round to nearest even; the
  biased error then accumulates and bf16 results drift far more than on a GPU. The patched cast
  rounds through torch, exactly like the hardware.
"""

from __future__ import annotations

import os

import torch


def triton_available() -> bool:
    """True when Triton imports (kernels can run: on CUDA, or on the CPU under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


_IMPORTS: list[bool] = []  # the answer of triton_importable, once known


@torch.compiler.assume_constant_result
def triton_importable() -> bool:
    """:func:`triton_available`, tried once per process. Backend choices made while torch.compile traces read
    it as a constant: the import attempt is not traced (a functools.cache wrapper would be, with a warning)."""
    if not _IMPORTS:
        _IMPORTS.append(triton_available())
    return _IMPORTS[0]


def patch_interpreter() -> None:
    """Mend the interpreter's int conversion and its bf16 rounding (idempotent; no-op off the interpreter)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.runtime.interpreter as interpreter

    if getattr(interpreter, "_linattn_patched", False):
        return
    interpreter._linattn_patched = True
    _patch_int_conversion(interpreter)
    _patch_bf16_rounding(interpreter)


def _patch_int_conversion(interpreter) -> None:
    import numpy as np

    try:
        int(np.ones(1, dtype=np.int32))
        return  # this NumPy still converts 1-element arrays
    except TypeError:
        pass
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _patch_bf16_rounding(interpreter) -> None:
    import numpy as np
    import torch
    import triton.language as tl

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "cast_impl"):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
