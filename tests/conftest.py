"""Test-session setup: without a GPU, Triton kernels run through Triton's CPU interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (``triton.jit`` reads it when a
kernel is defined), so it is set here, before the test modules load.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test tree mirrors the package; a few modules share fixtures across folders by module name
# (test basenames are unique), so every folder is importable whatever xdist collects first.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith((".", "_")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


@pytest.fixture
def one_thread():
    """Tiny models: one torch thread is fastest and keeps a shared machine usable (restored afterwards).
    Modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gpu_dot_rounding(monkeypatch):
    """The interpreter's dots with a GPU's rounding: float32 operands rounded to tf32 (10 mantissa bits, to nearest;
    depending on how the compiler converts them a GPU may round differently, the size of the error is the same) before
    the product. On the CPU the kernels upcast bf16 blocks and multiply in IEEE float32 (``upcast_dots``), which hides
    what tf32 tensor-core products do to 16-bit inputs on a GPU; bf16 operands are exact in tf32, so rounding every
    float32 operand is what a GPU does for 16-bit inputs. Float32 inputs (IEEE dots on a GPU too) must not use it.
    On CUDA the kernels round for real and this does nothing."""
    if torch.cuda.is_available():
        return
    import numpy as np
    import triton.runtime.interpreter as interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def tf32(handle):
        if handle.data.dtype != np.float32:
            return handle
        bits = np.ascontiguousarray(handle.data, dtype=np.float32).view(np.uint32)
        finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
        nearest_even = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
        return interpreter.TensorHandle(np.where(finite, nearest_even, bits).view(np.float32), handle.dtype)

    def rounded_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, tf32(a), tf32(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", rounded_dot)
