"""Work on a side CUDA stream (common/side_stream.py): in place on the CPU; on CUDA the delta family's backward
recomputes its chunk states there, with the same gradients as in one stream, eagerly and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from linattn.ops.common.side_stream import beside
from linattn.ops.common.triton_compat import triton_available

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (side streams)")


def test_in_place_off_cuda():
    out = torch.zeros(3)
    beside(lambda: out.add_(1.0), torch.device("cpu"), keep=(out,))
    assert out.tolist() == [1.0, 1.0, 1.0]  # ran before beside returned


@cuda
def test_the_handle_holds_the_tensors_until_the_join():
    out = torch.zeros(1 << 20, device="cuda")
    handle = beside(lambda: out.add_(1.0), out.device, keep=(out,))
    assert handle.side is not None and handle.keep[0] is out  # a caller dropping out now would not free it early
    handle.join()
    assert handle.keep == () and bool((out == 1.0).all())


def _gdn_grads(overlap: int, graph: bool = False) -> list[torch.Tensor]:
    from linattn.ops.gated_delta_rule import gated_delta_rule
    from linattn.ops.gated_delta_rule import triton as gdn_triton

    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 300, 4, 64, 64
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    k = k / k.norm(dim=-1, keepdim=True)
    g, beta = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    xs = [x.cuda().to(torch.bfloat16 if i < 3 else torch.float32).requires_grad_() for i, x in
          enumerate((q, k, v, g, beta))]
    w = torch.randn(B, T, H, V, generator=gen).cuda()
    before = gdn_triton.LAUNCH["overlap_scans"]
    gdn_triton.LAUNCH["overlap_scans"] = overlap
    try:
        def step() -> list[torch.Tensor]:
            o, _ = gated_delta_rule(*xs, backend="triton", chunk_size=64)
            return list(torch.autograd.grad((o.float() * w).sum(), xs))

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
        gdn_triton.LAUNCH["overlap_scans"] = before


@cuda
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_delta_backward_with_the_states_beside_equals_one_stream(graph):
    one_stream = _gdn_grads(overlap=0)
    for a, b in zip(_gdn_grads(overlap=1, graph=graph), one_stream, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
