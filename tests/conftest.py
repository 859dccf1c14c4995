"""Test-session setup: without a GPU, Triton kernels run through Triton's CPU interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (``triton.jit`` reads it when a
kernel is defined), so it is set here, before the test modules load.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
