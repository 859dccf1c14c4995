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
