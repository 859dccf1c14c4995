"""simple_gla: recurrent == parallel (outputs, states, every gradient), splitting, stepping, checks."""

import pytest
import torch

from linattn.ops import simple_gla, simple_gla_step
from linattn.testing import assert_close, check_backends_agree, log_gate, randn

SHAPES = [(1, 1, 1, 4, 4), (2, 7, 3, 5, 6), (1, 33, 2, 8, 3)]  # B, T, H, K, V


def make(B, T, H, K, V, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (randn(B, T, H, K, dtype=dtype, generator=gen), randn(B, T, H, K, dtype=dtype, generator=gen),
            randn(B, T, H, V, dtype=dtype, generator=gen), log_gate(B, T, H, dtype=dtype, generator=gen),
            randn(B, H, K, V, dtype=dtype, generator=gen))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_recurrent_equals_parallel(shape, with_state, dtype):
    q, k, v, g, s0 = make(*shape, dtype=dtype)

    def run(q, k, v, g, s0, backend):
        return simple_gla(q, k, v, g, initial_state=s0, output_final_state=True, backend=backend)

    check_backends_agree(run, [q, k, v, g, s0 if with_state else None], ["q", "k", "v", "g", "s0"],
                         ["parallel"], tol=1e-5)


def test_split_and_step_equal_full():
    q, k, v, g, s0 = make(2, 11, 2, 4, 5)
    o, s = simple_gla(q, k, v, g, initial_state=s0, output_final_state=True, backend="recurrent")
    o1, s1 = simple_gla(q[:, :4], k[:, :4], v[:, :4], g[:, :4], initial_state=s0, output_final_state=True,
                        backend="parallel")
    o2, s2 = simple_gla(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:], initial_state=s1, output_final_state=True,
                        backend="parallel")
    assert_close(torch.cat([o1, o2], 1), o, 1e-10, "split o")
    assert_close(s2, s, 1e-10, "split state")
    state = s0
    for t in range(11):
        o_t, state = simple_gla_step(q[:, t], k[:, t], v[:, t], g[:, t], state=state)
        assert_close(o_t, o[:, t], 1e-10, f"step {t}")
    assert_close(state, s, 1e-10, "step state")


def test_bad_inputs():
    q, k, v, g, s0 = make(1, 5, 2, 4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="g must have shape"):
        simple_gla(q, k, v, g[:, :4])
    with pytest.raises(ValueError, match="q must have shape"):
        simple_gla(q[0], k, v, g)
    with pytest.raises(TypeError, match="k must be a floating tensor"):
        simple_gla(q, k.long(), v, g)
    with pytest.raises(ValueError, match="backend"):
        simple_gla(q, k, v, g, backend="cuda-magic")
    with pytest.raises(ValueError, match="initial_state"):
        simple_gla(q, k, v, g, initial_state=s0[:, :1])
