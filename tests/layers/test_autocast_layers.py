"""Mixed precision: under CPU autocast (bf16) the delta-rule layers hand their op q, k, v in one dtype with
range checks off, l2norm keeps its input's dtype, and the chunk state scan promotes mixed M / R."""

from __future__ import annotations

import pytest
import torch

from linattn.layers import DeltaNetLayer, GatedDeltaNetLayer
from linattn.layers.norms import l2norm
from linattn.ops.common.matrix_scan import matrix_state_scan
from linattn.ops.common.values import value_checks_enabled
from linattn.testing import assert_close, randn


def _spy(layer: torch.nn.Module, calls: list[dict]) -> None:
    """Replace the layer's op by a recorder that still runs the op."""
    real = type(layer).op

    def spy(q, k, v, *args, **kwargs):
        calls.append({"dtypes": (q.dtype, k.dtype, v.dtype), "arg_dtypes": [a.dtype for a in args],
                      "checks": value_checks_enabled()})
        return real(q, k, v, *args, **kwargs)

    layer.op = spy


@pytest.mark.parametrize("cls", [GatedDeltaNetLayer, DeltaNetLayer])
@pytest.mark.parametrize("backend", ["auto", "chunk"])
def test_layer_calls_its_op_in_one_dtype_under_autocast(cls, backend):
    torch.manual_seed(0)
    layer = cls(16, 2, backend=backend, chunk_size=4)
    calls: list[dict] = []
    _spy(layer, calls)
    x = torch.randn(2, 10, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = layer(x, use_cache=False)
    (call,) = calls
    assert call["dtypes"] == (torch.bfloat16,) * 3, f"q, k, v dtypes {call['dtypes']}"
    assert all(d == torch.bfloat16 for d in call["arg_dtypes"]), f"gate dtypes {call['arg_dtypes']}"
    assert call["checks"] is False, "the layer calls its op with range checks off"
    assert value_checks_enabled(), "and turns them back on afterwards"
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.float().square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # the same layer without autocast: float32 throughout, and close to the bf16 output
    with torch.no_grad():
        y32, _ = layer(x, use_cache=False)
    assert calls[-1]["dtypes"] == (torch.float32,) * 3
    assert_close(y.float().detach(), y32, 5e-2, f"{cls.__name__} bf16 autocast vs float32", metric="rmse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_l2norm_keeps_the_input_dtype(dtype):
    x = randn(3, 5, 8, dtype=dtype)
    y = l2norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y.float().norm(dim=-1), torch.ones(3, 5), 1e-2 if dtype != torch.float32 else 1e-6, "unit norm")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert l2norm(x).dtype == dtype
    assert torch.equal(l2norm(torch.zeros(2, 4, dtype=dtype)), torch.zeros(2, 4, dtype=dtype)), "no NaN at zero"


def test_matrix_state_scan_promotes_float32_m_with_bf16_r():
    gen = torch.Generator().manual_seed(3)
    M = (0.4 * randn(3, 2, 4, 4, generator=gen)).requires_grad_()
    R = randn(3, 2, 4, 5, dtype=torch.bfloat16, generator=gen).requires_grad_()
    S0 = randn(2, 4, 5, dtype=torch.bfloat16, generator=gen)
    entering, final = matrix_state_scan(M, R, S0)
    assert entering.dtype == final.dtype == torch.float32
    S, want = S0.double(), []
    for n in range(3):
        want.append(S)
        S = M[n].double() @ S + R[n].double()
    assert_close(entering, torch.stack(want), 1e-6, "entering states")
    assert_close(final, S, 1e-6, "final state")
    final.sum().backward()
    assert M.grad.dtype == torch.float32 and R.grad.dtype == torch.bfloat16
    assert torch.isfinite(M.grad).all() and torch.isfinite(R.grad).all()
    # the reverse mix promotes too
    entering2, final2 = matrix_state_scan(M.detach().bfloat16(), R.detach().float(), None)
    assert entering2.dtype == final2.dtype == torch.float32 and torch.equal(entering2[0], torch.zeros(2, 4, 5))
