"""linear_attn: the identity with simple_gla, the normaliser, the feature maps, bad inputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.linear_attn import FEATURE_MAPS, draw_feature_map_weight, linear_attn, linear_attn_step
from linattn.ops.linear_attn.feature_maps import apply_feature_map
from linattn.ops.simple_gla import simple_gla
from linattn.testing import assert_close, check_backends_agree, randn


def make(B=2, T=17, H=3, K=4, V=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (randn(B, T, H, K, dtype=dtype, generator=gen), randn(B, T, H, K, dtype=dtype, generator=gen),
            randn(B, T, H, V, dtype=dtype, generator=gen))


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_identity_map_equals_simple_gla_without_decay(backend):
    q, k, v = make()
    s0 = randn(2, 3, 4, 5, dtype=torch.float64)
    o, s = linear_attn(q, k, v, initial_state=s0, output_final_state=True, backend=backend, chunk_size=16)
    o2, s2 = simple_gla(q, k, v, torch.zeros(q.shape[:3], dtype=q.dtype), initial_state=s0,
                        output_final_state=True, backend="recurrent")
    assert_close(o, o2, 1e-12, "output")
    assert_close(s, s2, 1e-12, "state")


@pytest.mark.parametrize("feature_map", ["elu", "relu", "performer"])
@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_normalised_equals_explicit_attention(feature_map, backend):
    """o_t = sum_s phi(q_t).phi(k_s) v_s / sum_s phi(q_t).phi(k_s), and z is the state's last column."""
    q, k, v = make()
    W = draw_feature_map_weight(4, 4, seed=0) if feature_map == "performer" else None
    fq, fk = apply_feature_map(q, feature_map, W), apply_feature_map(k, feature_map, W)
    A = torch.einsum("bthm,bshm->bhts", fq, fk).tril()
    expected = torch.einsum("bhts,bshv->bthv", A / (A.sum(-1, keepdim=True) + 1e-6 / 0.5), v)
    o, s = linear_attn(q, k, v, feature_map=feature_map, normalize=True, output_final_state=True,
                       backend=backend, scale=0.5, chunk_size=16)
    assert_close(o, expected, 1e-10, "normalised output")
    assert s.shape == (2, 3, 4, 6)
    assert_close(s[..., -1], fk.sum(1), 1e-12, "normaliser column z = sum phi(k)")
    assert_close(s[..., :-1], torch.einsum("bthm,bthv->bhmv", fk, v), 1e-12, "state S = sum phi(k) v^T")


def test_feature_maps_estimate_their_kernels():
    """Performer: E phi(x).phi(y) = exp(x.y); random Fourier: E phi(x).phi(y) = exp(-|x - y|^2 / 2)."""
    gen = torch.Generator().manual_seed(3)
    x, y = 0.3 * randn(8, 1, 6, dtype=torch.float64, generator=gen), 0.3 * randn(8, 1, 6, dtype=torch.float64,
                                                                                  generator=gen)
    W = draw_feature_map_weight(100_000, 6, seed=0)
    est = (apply_feature_map(x, "performer", W) * apply_feature_map(y, "performer", W)).sum(-1)
    assert_close(est, torch.exp((x * y).sum(-1)), 2e-2, "performer kernel")
    est = (apply_feature_map(x, "fourier", W) * apply_feature_map(y, "fourier", W)).sum(-1)
    assert_close(est, torch.exp(-0.5 * ((x - y) ** 2).sum(-1)), 2e-2, "fourier kernel")
    assert_close(apply_feature_map(x, "elu", None), F.elu(x) + 1, 0, "elu + 1")


def test_random_weight_seeding_per_head_and_gradient():
    q, k, v = make(T=9)
    o1, _ = linear_attn(q, k, v, feature_map="performer", num_features=7, feature_map_seed=5)
    o2, _ = linear_attn(q, k, v, feature_map="performer", feature_map_weight=draw_feature_map_weight(7, 4, 5))
    o3, _ = linear_attn(q, k, v, feature_map="performer", num_features=7, feature_map_seed=6)
    assert torch.equal(o1, o2) and not torch.allclose(o1, o3)
    W = draw_feature_map_weight(7, 4, 5)
    o4, s4 = linear_attn(q, k, v, feature_map="fourier", feature_map_weight=W.expand(3, 7, 4),
                         output_final_state=True)
    o5, _ = linear_attn(q, k, v, feature_map="fourier", feature_map_weight=W)
    assert_close(o4, o5, 1e-14, "per-head weight equal across heads")
    assert s4.shape == (2, 3, 14, 5)
    Wh = randn(3, 7, 4, dtype=torch.float64)  # one projection per head, differentiable

    def run(q, k, v, Wh, backend):
        return linear_attn(q, k, v, feature_map="performer", feature_map_weight=Wh, normalize=True,
                           output_final_state=True, backend=backend, chunk_size=16)

    check_backends_agree(run, [q, k, v, Wh], ["q", "k", "v", "feature_map_weight"], ["parallel", "chunk"],
                         tol=1e-10)


def test_step_with_normaliser():
    q, k, v = make(T=6)
    o, s = linear_attn(q, k, v, feature_map="relu", normalize=True, output_final_state=True, backend="recurrent")
    state = None
    for t in range(6):
        o_t, state = linear_attn_step(q[:, t], k[:, t], v[:, t], state=state, feature_map="relu", normalize=True)
        assert_close(o_t, o[:, t], 1e-12, f"step {t}")
    assert_close(state, s, 1e-12, "step state")


def test_bad_inputs():
    q, k, v = make(dtype=torch.float32)
    with pytest.raises(ValueError, match="feature_map must be one of") as err:
        linear_attn(q, k, v, feature_map="softmax")
    assert all(name in str(err.value) for name in FEATURE_MAPS)
    with pytest.raises(ValueError, match="feature_map_weight"):
        linear_attn(q, k, v, feature_map="elu", feature_map_weight=torch.randn(4, 4))
    with pytest.raises(ValueError, match="feature_map_weight must have shape"):
        linear_attn(q, k, v, feature_map="performer", feature_map_weight=torch.randn(8, 3))
    with pytest.raises(ValueError, match="feature_map_weight must have shape"):
        linear_attn(q, k, v, feature_map="performer", feature_map_weight=torch.randn(2, 8, 4))
    with pytest.raises(TypeError, match="feature_map_weight must be a floating tensor"):
        linear_attn(q, k, v, feature_map="performer", feature_map_weight=torch.ones(8, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="num_features"):
        linear_attn(q, k, v, feature_map="fourier", num_features=0)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B, H, M, V \+ 1\]"):
        linear_attn(q, k, v, normalize=True, initial_state=torch.zeros(2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[B, H, M, V\]"):
        linear_attn(q, k, v, feature_map="fourier", initial_state=torch.zeros(2, 3, 4, 5))
    with pytest.raises(TypeError, match="normalize"):
        linear_attn(q, k, v, normalize=1)
    with pytest.raises(ValueError, match="eps"):
        linear_attn(q, k, v, normalize=True, eps=-1.0)
    with pytest.raises(ValueError, match="k must have"):
        linear_attn(q, k[:, :3], v)
    with pytest.raises(TypeError, match="q must be a floating tensor"):
        linear_attn(q.int(), k, v)
    with pytest.raises(ValueError, match="backend"):
        linear_attn(q, k, v, backend="auto-magic")
    with pytest.raises(ValueError, match="state must have shape"):
        linear_attn_step(q[:, 0], k[:, 0], v[:, 0], state=torch.zeros(2, 3, 4, 5), normalize=True)
    assert math.isfinite(float(linear_attn(q, k, v, feature_map="relu", normalize=True)[0].abs().max()))
