"""common/positions.py: RoPE (plain, position interpolation, NTK scaling), ALiBi slopes and bias, masks."""

import math

import pytest
import torch

from linattn.ops.common.positions import (
    alibi_bias,
    alibi_slopes,
    apply_rope,
    rope_config,
    rope_inv_freq,
    visibility_mask,
)
from linattn.testing import assert_close, randn


def test_rope_rotates_channel_pairs_by_position_times_frequency():
    D, theta = 6, 100.0
    x = randn(1, 3, 1, D, dtype=torch.float64)
    y = apply_rope(x, 5, theta=theta)
    for t in range(3):
        for i in range(D // 2):
            angle = (5 + t) * theta ** (-2 * i / D)
            a, b = x[0, t, 0, i], x[0, t, 0, i + D // 2]
            assert_close(y[0, t, 0, i], a * math.cos(angle) - b * math.sin(angle), 1e-12, "first half")
            assert_close(y[0, t, 0, i + D // 2], b * math.cos(angle) + a * math.sin(angle), 1e-12, "second half")


@pytest.mark.parametrize("cfg", [{}, {"interpolation_factor": 4.0}, {"ntk_factor": 8.0, "theta": 500.0}])
def test_rope_dot_products_depend_on_relative_position_only(cfg):
    gen = torch.Generator().manual_seed(0)
    q, k = randn(1, 1, 2, 8, generator=gen, dtype=torch.float64), randn(1, 1, 2, 8, generator=gen, dtype=torch.float64)
    full = rope_config(cfg)
    dots = [(apply_rope(q, m + 3, **full) * apply_rope(k, m, **full)).sum(-1) for m in (0, 17, 1000)]
    for d in dots[1:]:
        assert_close(d, dots[0], 1e-9, "q_{m+3} . k_m")
    assert torch.allclose(apply_rope(q, 0, **full), q)  # position 0 is the identity


def test_position_interpolation_and_ntk_scaling():
    x = randn(1, 4, 1, 8, dtype=torch.float64)
    # position interpolation by 4: position 8 behaves like position 2
    assert_close(apply_rope(x[:, :1], 8, interpolation_factor=4.0), apply_rope(x[:, :1], 2), 1e-12, "PI")
    # NTK-aware scaling: base theta * a^(D / (D - 2)); the first frequency stays 1, the last shrinks
    f = rope_inv_freq(8, theta=10000.0, ntk_factor=2.0)
    base = 10000.0 * 2.0 ** (8 / 6)
    assert_close(f, base ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8), 1e-12, "NTK frequencies")
    assert f[0] == 1.0 and f[-1] < rope_inv_freq(8)[-1]


def test_rope_config_validation():
    assert rope_config(None) is None
    assert rope_config({"theta": 500}) == {"theta": 500.0, "interpolation_factor": 1.0, "ntk_factor": 1.0}
    with pytest.raises(ValueError, match="unknown keys"):
        rope_config({"base": 1.0})
    with pytest.raises(ValueError, match="theta"):
        rope_config({"theta": -1.0})
    with pytest.raises(TypeError, match="rope must be None or a dict"):
        rope_config(10000.0)
    with pytest.raises(ValueError, match="even head dim"):
        rope_inv_freq(5)


def test_alibi_slopes_match_the_paper():
    assert torch.equal(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)], dtype=torch.float64))
    assert torch.equal(alibi_slopes(4), torch.tensor([2.0 ** -(2 * (i + 1)) for i in range(4)], dtype=torch.float64))
    # 6 heads: the 4 slopes of 4 heads, then every other slope of the 8-head sequence (2^-1, 2^-3)
    expected = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert torch.equal(alibi_slopes(6), torch.tensor(expected, dtype=torch.float64))
    assert alibi_slopes(1).tolist() == [2.0 ** -8]


def test_alibi_bias_and_visibility_mask():
    q_pos, k_pos = torch.arange(2, 5), torch.arange(5)
    bias = alibi_bias(torch.tensor([0.5], dtype=torch.float64), q_pos, k_pos)
    assert bias[0, 2, 1] == -0.5 * 3 and bias[0, 0, 4] == -0.5 * 2 and bias[0, 1, 3] == 0.0
    causal = visibility_mask(q_pos, k_pos)
    assert causal.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    window = visibility_mask(q_pos, k_pos, window_size=2)
    assert window.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    both = visibility_mask(q_pos, k_pos, causal=False, window_size=2)
    assert both.tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]


def test_apply_rope_takes_a_start_per_row_and_a_position_per_token() -> None:
    from linattn.ops.common.positions import apply_rope

    x = torch.randn(3, 5, 2, 8, dtype=torch.float64)
    starts = torch.tensor([0, 7, 300])
    per_row = apply_rope(x, starts, theta=500.0, interpolation_factor=2.0)
    for b, s in enumerate(starts.tolist()):
        torch.testing.assert_close(per_row[b:b + 1], apply_rope(x[b:b + 1], s, theta=500.0, interpolation_factor=2.0),
                                   rtol=0, atol=0)
    positions = starts[:, None] + torch.arange(5)[None]
    torch.testing.assert_close(apply_rope(x, positions, theta=500.0, interpolation_factor=2.0), per_row,
                               rtol=0, atol=0)


@pytest.mark.parametrize("start", [5, "rows"])
def test_compiled_rope_keeps_its_tables_apart(start):
    """Under torch.compile the cos/sin tables are one opaque op (inductor would otherwise evaluate the float64
    cos and sin once per element of x, for every head and row), and the rotation equals the eager one."""
    torch._dynamo.reset()
    x = torch.randn(2, 9, 3, 8)
    offset = 5 if start == 5 else torch.tensor([3, 11])
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    def rotate(x):
        return apply_rope(x, offset, theta=500.0, interpolation_factor=2.0)

    got = torch.compile(rotate, backend=backend, fullgraph=True)(x)
    assert "linattn.rope_tables.default" in targets
    torch.testing.assert_close(got, rotate(x), rtol=0, atol=0)
