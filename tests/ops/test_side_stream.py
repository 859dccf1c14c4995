"""Work on a side CUDA stream (common/side_stream.py): in place on the CPU; on CUDA the backward passes of the delta
family, gla and simple_gla recompute their chunk states there, with the same gradients as in one stream, eagerly and
inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from linattn.ops.common.side_stream import beside
from linattn.ops.common.triton_compat import triton_available

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (side streams)")


def test_in_place_off_cuda_and_the_handle_lets_go():
    out = torch.zeros(3)
    handle = beside(lambda: out.add_(1.0), torch.device("cpu"), keep=(out,))
    assert out.tolist() == [1.0, 1.0, 1.0]  # ran before beside returned
    handle.join()
    assert handle.keep == ()


# op -> the module whose LAUNCH holds its overlap_scans switch
MODULES = {"gated_delta_rule": "linattn.ops.gated_delta_rule.triton", "gla": "linattn.ops.gla.triton",
           "simple_gla": "linattn.ops.simple_gla.triton"}


def _grads(name: str, overlap: int, graph: bool = False) -> list[torch.Tensor]:
    import importlib

    from linattn.ops import get_op

    spec = get_op(name)
    launch = importlib.import_module(MODULES[name]).LAUNCH
    inputs = {a: x.cuda().to(torch.bfloat16 if a in ("q", "k", "v") else torch.float32).requires_grad_()
              for a, x in spec.example_inputs(2, 300, 4, 64, 64, seed=0).items()}
    leaves = list(inputs.values())
    w = torch.randn(2, 300, 4, 64, generator=torch.Generator().manual_seed(1)).cuda()
    before = launch["overlap_scans"]
    launch["overlap_scans"] = overlap
    try:
        def step() -> list[torch.Tensor]:
            o, _ = spec.fn(**inputs, backend="triton", chunk_size=64)
            return list(torch.autograd.grad((o.float() * w).sum(), leaves))

        if not graph:
            return step()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (compilation, allocator), as CUDA graphs need
            step()
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            grads = step()
        captured.replay()
        torch.cuda.synchronize()
        return [x.clone() for x in grads]
    finally:
        launch["overlap_scans"] = before


@cuda
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("name", list(MODULES))
def test_backward_with_the_states_beside_equals_one_stream(name, graph):
    one_stream = _grads(name, overlap=0)
    for a, b in zip(_grads(name, overlap=1, graph=graph), one_stream, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
