"""forgetting_attn (FoX): the definition, recurrent == parallel == chunk (outputs, caches, every gradient incl.
the gates), g = 0 equals softmax_attn, bf16, splitting, stepping, long T with extreme gates, bad inputs."""

import pytest
import torch

from linattn.ops.common.blockwise_softmax import _Blocks
from linattn.ops.common.kv_cache import KVCache
from linattn.ops.common.positions import alibi_slopes
from linattn.ops.common.values import value_checks
from linattn.ops.forgetting_attn import forgetting_attn, forgetting_attn_step
from linattn.ops.softmax_attn import softmax_attn
from linattn.testing import assert_close, check_backends_agree, grads, log_gate, randn

CASES = [  # B, T, H, H_kv, K, V, T0 (cache length)
    (1, 1, 1, 1, 4, 4, 3),
    (2, 7, 2, 1, 4, 6, 0),
    (1, 33, 4, 2, 6, 3, 5),
    (2, 20, 3, 3, 8, 5, 19),
]
OPTIONS = [{}, {"window_size": 3}, {"rope": {"theta": 500.0}, "window_size": 20}]
NAMES = ["q", "k", "v", "g", "cache.k", "cache.v", "cache.g"]


def make(B, T, H, H_kv, K, V, T0, dtype=torch.float64, seed=0, low=-1.0):
    gen = torch.Generator().manual_seed(seed)
    q = randn(B, T, H, K, dtype=dtype, generator=gen)
    k, v = randn(B, T, H_kv, K, dtype=dtype, generator=gen), randn(B, T, H_kv, V, dtype=dtype, generator=gen)
    g = log_gate(B, T, H, dtype=dtype, generator=gen, low=low)
    ck, cv = randn(B, T0, H_kv, K, dtype=dtype, generator=gen), randn(B, T0, H_kv, V, dtype=dtype, generator=gen)
    cg = log_gate(B, T0, H, dtype=dtype, generator=gen, low=low)
    return [q, k, v, g] + ([ck, cv, cg] if T0 else [None, None, None])


def run(q, k, v, g, ck, cv, cg, backend, **opts):
    """Output and the final cache's tensors (so that their gradients are compared too)."""
    cache = None if ck is None else KVCache(ck, cv, {"g": cg})
    o, state = forgetting_attn(q, k, v, g, initial_state=cache, output_final_state=True, backend=backend, **opts)
    return o, state.k, state.v, state.extras["g"]


def test_recurrent_is_the_definition():
    """o_t = sum_{s<=t} softmax_s(q_t.k_s scale + sum_{r=s+1..t} g_r) v_s, written out token by token."""
    q, k, v, g, *_ = make(1, 6, 2, 1, 3, 2, 0)
    o, _ = forgetting_attn(q, k, v, g, backend="recurrent")
    scale = 3 ** -0.5
    for h in range(2):
        for t in range(6):
            logits = torch.stack([q[0, t, h] @ k[0, s, 0] * scale + g[0, s + 1: t + 1, h].sum() for s in range(t + 1)])
            expected = torch.softmax(logits, 0) @ v[0, : t + 1, 0]
            assert_close(o[0, t, h], expected, 1e-12, f"o[{t}, {h}]")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backends_agree(case, opts, dtype):
    xs = make(*case, dtype=dtype)
    check_backends_agree(lambda *a, backend: run(*a, backend, chunk_size=16, **opts), xs, NAMES,
                         ["parallel", "chunk"], tol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
@pytest.mark.parametrize("low", [-0.05, -3.0])
def test_every_chunk_size(chunk_size, low):
    xs = make(1, 150, 2, 1, 8, 8, 37, dtype=torch.float32, seed=1, low=low)
    check_backends_agree(lambda *a, backend: run(*a, backend, chunk_size=chunk_size), xs, NAMES, ["chunk"], tol=1e-5)


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_zero_gates_equal_softmax_attn(backend):
    q, k, v, g, ck, cv, cg = make(2, 21, 4, 2, 6, 5, 4, seed=3)
    zero = torch.zeros_like(g)
    for opts in ({}, {"window_size": 5, "rope": {}}):
        o, s = forgetting_attn(q, k, v, zero, initial_state=KVCache(ck, cv, {"g": torch.zeros_like(cg)}),
                               output_final_state=True, backend=backend, chunk_size=16, **opts)
        o_ref, s_ref = softmax_attn(q, k, v, initial_state=KVCache(ck, cv), output_final_state=True,
                                    backend="recurrent", **opts)
        assert_close(o, o_ref, 1e-12, f"{backend} {opts}: g = 0 vs softmax_attn")
        assert_close(s.k, s_ref.k, 1e-12, "cache k")


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_constant_gates_equal_alibi(backend):
    """FoX is a data-dependent ALiBi: g = -slope_h at every token gives softmax_attn(alibi=True)."""
    q, k, v, *_ = make(2, 40, 4, 2, 6, 5, 0, seed=8)
    g = (-alibi_slopes(4)).expand(2, 40, 4).contiguous()
    o, _ = forgetting_attn(q, k, v, g, backend=backend, chunk_size=16)
    o_ref, _ = softmax_attn(q, k, v, alibi=True, backend="recurrent")
    assert_close(o, o_ref, 1e-12, f"{backend}: FoX with g = -slope vs ALiBi")


def test_bfloat16_against_float32_recurrent():
    xs = make(2, 45, 2, 1, 16, 16, 6, dtype=torch.bfloat16, seed=2)
    ref_out, ref_grad = grads(lambda *a: run(*a, "recurrent"), [x.float() for x in xs])
    for backend in ("recurrent", "parallel", "chunk"):
        out, grad = grads(lambda *a, b=backend: run(*a, b, chunk_size=16), xs)
        assert out[0].dtype == torch.bfloat16
        for i, (a, e) in enumerate(zip(out, ref_out)):
            assert_close(a, e, 5e-3, f"{backend} bf16 output {i}", metric="rmse")
        for name, a, e in zip(NAMES, grad, ref_grad):
            assert_close(a, e, 1e-2, f"{backend} bf16 grad of {name}", metric="rmse")


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_split_and_step_equal_full(backend):
    q, k, v, g, ck, cv, cg = make(2, 13, 4, 2, 6, 5, 3, seed=4)
    opts = {"window_size": 6}
    o, s = forgetting_attn(q, k, v, g, initial_state=KVCache(ck, cv, {"g": cg}), output_final_state=True,
                           backend="recurrent", **opts)
    o1, s1 = forgetting_attn(q[:, :5], k[:, :5], v[:, :5], g[:, :5], initial_state=KVCache(ck, cv, {"g": cg}),
                             output_final_state=True, backend=backend, chunk_size=16, **opts)
    o2, s2 = forgetting_attn(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], initial_state=s1, output_final_state=True,
                             backend=backend, chunk_size=16, **opts)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split outputs")
    assert_close(s2.extras["g"], s.extras["g"], 1e-12, "cache g")
    assert_close(s2.v, s.v, 1e-12, "cache v")
    state = KVCache(ck, cv, {"g": cg})
    for t in range(13):
        o_t, state = forgetting_attn_step(q[:, t], k[:, t], v[:, t], g[:, t], state=state, **opts)
        assert_close(o_t, o[:, t], 1e-12, f"step {t}")
    assert state.length == 16


def test_strong_forgetting_attends_to_the_current_token():
    """g = -20 per token: every earlier key is down-weighted by exp(-20) or more, so o_t = v_t to 1e-5."""
    q, k, v, _, *_ = make(1, 300, 2, 2, 8, 8, 0, dtype=torch.float32, seed=5)
    g = torch.full((1, 300, 2), -20.0)
    for backend in ("recurrent", "parallel", "chunk"):
        o, _ = forgetting_attn(q, k, v, g, backend=backend)
        assert_close(o, v, 1e-5, f"{backend}: o = v")


@pytest.mark.parametrize("g_value", [-20.0, 0.0])
def test_long_sequence_with_window_is_finite(g_value):
    T = 65536
    q, k, v, *_ = make(1, T, 1, 1, 16, 16, 0, dtype=torch.float32, seed=6)
    g = torch.full((1, T, 1), g_value)
    o, _ = forgetting_attn(q, k, v, g, window_size=64, backend="chunk")
    assert torch.isfinite(o).all()


def long_run(g_value):
    T = 65536
    q, k, v, *_ = make(1, T, 1, 1, 16, 16, 0, dtype=torch.float32, seed=7)
    g = torch.full((1, T, 1), g_value, requires_grad=True)
    q.requires_grad_(True)
    o, _ = forgetting_attn(q, k, v, g, backend="chunk", chunk_size=128)
    o.square().mean().backward()
    assert torch.isfinite(o).all() and torch.isfinite(q.grad).all() and torch.isfinite(g.grad).all()
    return o, v


def test_long_sequence_strong_forgetting_is_finite():
    """T = 65536, g = -20, full causal with gradients: finite, o_t = v_t, and fast (far blocks are pruned)."""
    o, v = long_run(-20.0)
    assert_close(o, v, 1e-4, "o = v")


@pytest.mark.slow
def test_long_sequence_no_forgetting_is_finite():
    long_run(0.0)


@pytest.mark.parametrize("gates", ["sparse-strong", "mixed-sign"])
def test_pruned_blocks_match_recurrent(gates):
    """Far blocks skipped by the chunk backend's logit bound change nothing (float64, every gradient). With
    mixed-sign gates some block totals are > 0, so only the per-block bound prunes (lags 13-20 of 0-20)."""
    xs = make(2, 300, 4, 2, 6, 5, 21, seed=9)
    gen = torch.Generator().manual_seed(10)
    for i in (3, 6):  # g and the cache's g
        u = torch.rand(xs[i].shape, dtype=torch.float64, generator=gen)
        xs[i] = torch.where(u < 0.3, -8.0 * u, 0.0 * u) if gates == "sparse-strong" else 12.0 * u - 7.0
    xs[0] = 3.0 * xs[0]
    # mixed-sign gates are outside the documented g <= 0 (the op refuses them where value checks run); with the
    # checks off they stress the chunk backend's per-block bound, which must stay exact for any gate values
    with value_checks("off"):
        check_backends_agree(lambda *a, backend: run(*a, backend, chunk_size=16), xs, NAMES, ["chunk"], tol=1e-10)


def test_strong_forgetting_prunes_far_blocks():
    T, C = 4096, 64
    q, k, v, *_ = make(1, T, 2, 2, 8, 8, 0, dtype=torch.float32)
    blocks = _Blocks(q, k, v, torch.full((1, T, 2), -2.0), None, 8 ** -0.5, True, None, C)
    reference = torch.zeros(blocks.q.shape[:-1])  # a running max of 0: lag 2 (distance >= 65) has bias <= -130
    assert [lag.d for lag in blocks.iter_logits(reference)] == [0, 1]


def test_bad_inputs():
    q, k, v, g, ck, cv, cg = make(1, 5, 4, 2, 4, 3, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="g must have shape"):
        forgetting_attn(q, k, v, g[:, :4])
    with pytest.raises(ValueError, match="g must have shape"):
        forgetting_attn(q, k, v, g[:, :, :2])  # gates are per query head
    with pytest.raises(TypeError, match="g must be a floating tensor"):
        forgetting_attn(q, k, v, g.long())
    with pytest.raises(ValueError, match="q must have shape"):
        forgetting_attn(q[0], k, v, g)
    with pytest.raises(ValueError, match="v must have shape"):
        forgetting_attn(q, k, v[:, :3], g)
    with pytest.raises(ValueError, match="backend"):
        forgetting_attn(q, k, v, g, backend="flash")
    with pytest.raises(ValueError, match="window_size"):
        forgetting_attn(q, k, v, g, window_size=-1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'alibi'"):
        forgetting_attn(q, k, v, g, alibi=True)
    with pytest.raises(ValueError, match=r"initial_state.extras must have keys \['g'\]"):
        forgetting_attn(q, k, v, g, initial_state=KVCache(ck, cv))
    with pytest.raises(ValueError, match=r"initial_state.extras\['g'\] must have shape"):
        forgetting_attn(q, k, v, g, initial_state=KVCache(ck, cv, {"g": cg[:, :1]}))
    with pytest.raises(ValueError, match="^g must have shape"):
        forgetting_attn_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0, :2])
