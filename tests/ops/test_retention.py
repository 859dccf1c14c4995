"""retention: the fixed per-head decays, the identity with simple_gla, bad inputs."""

import math

import pytest
import torch

from linattn.ops.common.registry import get_op
from linattn.ops.retention import retention, retention_log_decay, retention_step
from linattn.ops.simple_gla import simple_gla
from linattn.testing import assert_close, randn


def make(B=2, T=19, H=4, K=5, V=3, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return (randn(B, T, H, K, dtype=dtype, generator=gen), randn(B, T, H, K, dtype=dtype, generator=gen),
            randn(B, T, H, V, dtype=dtype, generator=gen), randn(B, H, K, V, dtype=dtype, generator=gen))


def test_decays_are_retnets():
    gamma = torch.exp(retention_log_decay(4, dtype=torch.float64))
    assert gamma.tolist() == pytest.approx([1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128, 1 - 1 / 256], rel=1e-15)


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_equals_simple_gla_with_constant_gate(backend):
    q, k, v, s0 = make()
    B, T, H, _ = q.shape
    g = torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(H)], dtype=torch.float64).expand(B, T, H)
    o_r, s_r = retention(q, k, v, initial_state=s0, output_final_state=True, backend=backend, chunk_size=16)
    o_s, s_s = simple_gla(q, k, v, g, initial_state=s0, output_final_state=True, backend=backend, chunk_size=16)
    assert_close(o_r, o_s, 1e-12, "retention vs simple_gla output")
    assert_close(s_r, s_s, 1e-12, "retention vs simple_gla state")


def test_state_decays_by_gamma_per_step():
    q, k, v, s0 = make(T=1)
    _, s1 = retention_step(q[:, 0], torch.zeros_like(k[:, 0]), v[:, 0], state=s0)
    gamma = torch.exp(retention_log_decay(4, dtype=torch.float64))
    assert_close(s1, gamma[None, :, None, None] * s0, 1e-14, "one step with k = 0")


def test_registry_entry():
    info = get_op("retention").info()
    assert {"recurrent", "parallel", "chunk"} <= set(info["backends"]) and info["has_step"]
    inputs = get_op("retention").example_inputs(1, 5, 2, 4, 3)
    o, _ = get_op("retention").fn(**inputs)
    assert o.shape == (1, 5, 2, 3)


def test_bad_inputs():
    q, k, v, s0 = make(dtype=torch.float32)
    with pytest.raises(ValueError, match="q must have shape"):
        retention(q[0], k, v)
    with pytest.raises(ValueError, match="v must have shape"):
        retention(q, k, v[:, :5])
    with pytest.raises(ValueError, match="k must have the shape of q"):
        retention(q, k[:, :, :2], v)
    with pytest.raises(TypeError, match="v must be a floating tensor"):
        retention(q, k, v.int())
    with pytest.raises(ValueError, match="initial_state"):
        retention(q, k, v, initial_state=s0[..., :2])
    with pytest.raises(ValueError, match="backend"):
        retention(q, k, v, backend="fastest")
    with pytest.raises(ValueError, match="state must have shape"):
        retention_step(q[:, 0], k[:, 0], v[:, 0], state=s0[:1])
