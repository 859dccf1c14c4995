"""softmax_attn: recurrent (explicit) == parallel (SDPA) == chunk (blockwise) for outputs, caches and every
gradient; torch SDPA as the independent reference; bf16; splitting; stepping; long T; bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.common.kv_cache import KVCache
from linattn.ops.softmax_attn import softmax_attn, softmax_attn_step
from linattn.testing import assert_close, check_backends_agree, grads, randn

CASES = [  # B, T, H, H_kv, K, V, T0 (cache length)
    (1, 1, 1, 1, 4, 4, 3),  # T = 1 without a cache: see test_single_token_attends_to_itself
    (2, 7, 2, 1, 4, 6, 0),
    (1, 33, 4, 2, 6, 3, 5),
    (2, 20, 3, 3, 8, 5, 19),
]
OPTIONS = [
    {},
    {"causal": False},
    {"window_size": 3},
    {"rope": {"theta": 500.0}},
    {"alibi": True},
    {"window_size": 5, "alibi": True, "rope": {"interpolation_factor": 2.0, "ntk_factor": 3.0}},
    {"causal": False, "window_size": 4, "alibi": True},
]
NAMES = ["q", "k", "v", "cache.k", "cache.v"]


def make(B, T, H, H_kv, K, V, T0, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = randn(B, T, H, K, dtype=dtype, generator=gen)
    k, v = randn(B, T, H_kv, K, dtype=dtype, generator=gen), randn(B, T, H_kv, V, dtype=dtype, generator=gen)
    ck, cv = randn(B, T0, H_kv, K, dtype=dtype, generator=gen), randn(B, T0, H_kv, V, dtype=dtype, generator=gen)
    return [q, k, v, ck if T0 else None, cv if T0 else None]


def run(q, k, v, ck, cv, backend, **opts):
    """Output and the final cache's tensors (so that their gradients are compared too)."""
    cache = None if ck is None else KVCache(ck, cv)
    o, state = softmax_attn(q, k, v, initial_state=cache, output_final_state=True, backend=backend, **opts)
    return o, state.k, state.v


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backends_agree(case, opts, dtype):
    xs = make(*case, dtype=dtype)
    check_backends_agree(lambda *a, backend: run(*a, backend, chunk_size=16, **opts), xs, NAMES,
                         ["parallel", "chunk"], tol=1e-5)


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_single_token_attends_to_itself(backend):
    q, k, v, _, _ = make(2, 1, 4, 2, 4, 3, 0)
    o, state = softmax_attn(q, k, v, backend=backend, output_final_state=True, alibi=True, rope={})
    assert_close(o, v.repeat_interleave(2, dim=2), 1e-15, "o = v")
    assert state.length == 1


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
@pytest.mark.parametrize("opts", [{}, {"window_size": 40, "alibi": True}], ids=["plain", "window-alibi"])
def test_every_chunk_size(chunk_size, opts):
    xs = make(1, 150, 2, 1, 8, 8, 37, dtype=torch.float32, seed=1)
    check_backends_agree(lambda *a, backend: run(*a, backend, chunk_size=chunk_size, **opts), xs, NAMES,
                         ["chunk"], tol=1e-5)


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_matches_torch_sdpa(backend):
    q, k, v, _, _ = make(2, 45, 4, 4, 8, 8, 0, dtype=torch.float64, seed=3)
    o, _ = softmax_attn(q, k, v, backend=backend, chunk_size=16)
    sdpa = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
    assert_close(o, sdpa, 1e-12, f"{backend} vs SDPA causal")
    o, _ = softmax_attn(q, k[:, :, :2], v[:, :, :2], causal=False, scale=0.3, backend=backend, chunk_size=16)
    kk, vv = (x[:, :, :2].repeat_interleave(2, dim=2).transpose(1, 2) for x in (k, v))
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, scale=0.3).transpose(1, 2)
    assert_close(o, sdpa, 1e-12, f"{backend} vs SDPA non-causal GQA")


@pytest.mark.parametrize("opts", [{}, {"window_size": 9, "alibi": True, "rope": {}}], ids=["plain", "all"])
def test_bfloat16_against_float32_recurrent(opts):
    xs = make(2, 45, 2, 1, 16, 16, 6, dtype=torch.bfloat16, seed=2)
    ref_out, ref_grad = grads(lambda *a: run(*a, "recurrent", **opts), [x.float() for x in xs])
    for backend in ("recurrent", "parallel", "chunk"):
        out, grad = grads(lambda *a, b=backend: run(*a, b, chunk_size=16, **opts), xs)
        assert out[0].dtype == torch.bfloat16
        for i, (a, e) in enumerate(zip(out, ref_out)):
            assert_close(a, e, 5e-3, f"{backend} bf16 output {i}", metric="rmse")
        for name, a, e in zip(NAMES, grad, ref_grad):
            assert_close(a, e, 1e-2, f"{backend} bf16 grad of {name}", metric="rmse")


OPTS_ALL = {"window_size": 6, "alibi": True, "rope": {"theta": 1000.0}}


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_split_and_step_equal_full(backend):
    q, k, v, ck, cv = make(2, 13, 4, 2, 6, 5, 3, seed=4)
    o, s = softmax_attn(q, k, v, initial_state=KVCache(ck, cv), output_final_state=True, backend="recurrent",
                        **OPTS_ALL)
    _, s1 = softmax_attn(q[:, :5], k[:, :5], v[:, :5], initial_state=KVCache(ck, cv), output_final_state=True,
                         backend=backend, chunk_size=16, **OPTS_ALL)
    o2, s2 = softmax_attn(q[:, 5:], k[:, 5:], v[:, 5:], initial_state=s1, output_final_state=True,
                          backend=backend, chunk_size=16, **OPTS_ALL)
    assert_close(o2, o[:, 5:], 1e-12, "second half")
    assert_close(s2.k, s.k, 1e-12, "cache k")
    assert_close(s2.v, s.v, 1e-12, "cache v")
    state = KVCache(ck, cv)
    for t in range(13):
        o_t, state = softmax_attn_step(q[:, t], k[:, t], v[:, t], state=state, **OPTS_ALL)
        assert_close(o_t, o[:, t], 1e-12, f"step {t}")
    assert state.length == 16
    assert_close(state.k, s.k, 1e-12, "step cache k")


def test_step_starts_an_empty_cache():
    q, k, v, _, _ = make(1, 4, 2, 2, 4, 4, 0, dtype=torch.float32)
    o, _ = softmax_attn(q, k, v)
    state = None
    for t in range(4):
        o_t, state = softmax_attn_step(q[:, t], k[:, t], v[:, t], state=state)
        assert_close(o_t, o[:, t], 1e-6, f"step {t}")
    assert state.k.dtype == torch.float32 and state.length == 4


def test_long_sequence_with_window_is_finite_and_local():
    """T = 65536 through the chunk backend with a window: finite, and equal to attention on the window alone."""
    T, w = 65536, 50
    q, k, v, _, _ = make(1, T, 1, 1, 16, 16, 0, dtype=torch.float32, seed=5)
    o, _ = softmax_attn(q, k, v, window_size=w, alibi=True, backend="chunk")
    assert torch.isfinite(o).all()
    tail = slice(T - 70, T)
    ref, _ = softmax_attn(q[:, tail], k[:, tail], v[:, tail], window_size=w, alibi=True, backend="recurrent")
    assert_close(o[:, T - 20:], ref[:, -20:], 1e-5, "last queries")


@pytest.mark.slow
def test_long_sequence_full_causal_is_finite():
    q, k, v, _, _ = make(1, 65536, 1, 1, 16, 16, 0, dtype=torch.float32, seed=6)
    o, _ = softmax_attn(q * 30, k * 30, v, backend="chunk", chunk_size=128)
    assert torch.isfinite(o).all()


def test_bad_inputs():
    q, k, v, ck, cv = make(1, 5, 4, 2, 4, 3, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="q must have shape"):
        softmax_attn(q[0], k, v)
    with pytest.raises(ValueError, match="k must have shape"):
        softmax_attn(q, k[:, :4], v)
    with pytest.raises(ValueError, match="v must have shape"):
        softmax_attn(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="dividing the H = 4"):
        softmax_attn(q, k[:, :, :1].expand(1, 5, 3, 4), v[:, :, :1].expand(1, 5, 3, 3))
    with pytest.raises(TypeError, match="k must be a floating tensor"):
        softmax_attn(q, k.long(), v)
    with pytest.raises(ValueError, match="backend"):
        softmax_attn(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="window_size"):
        softmax_attn(q, k, v, window_size=0)
    with pytest.raises(TypeError, match="causal"):
        softmax_attn(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="alibi"):
        softmax_attn(q, k, v, alibi=1)
    with pytest.raises(ValueError, match="rope has unknown keys"):
        softmax_attn(q, k, v, rope={"base": 10.0})
    with pytest.raises(ValueError, match="chunk_size"):
        softmax_attn(q, k, v, chunk_size=0)
    with pytest.raises(TypeError, match="initial_state must be None or a KVCache"):
        softmax_attn(q, k, v, initial_state=torch.zeros(1, 2, 4, 3))
    with pytest.raises(ValueError, match=r"initial_state.k must have shape"):
        softmax_attn(q, k, v, initial_state=KVCache(ck[:, :, :1], cv))
    with pytest.raises(ValueError, match=r"initial_state.extras"):
        softmax_attn(q, k, v, initial_state=KVCache(ck, cv, {"g": torch.zeros(1, 2, 4)}))
    with pytest.raises(ValueError, match="^k must have shape"):
        softmax_attn_step(q[:, 0], k[:, 0, :, :3], v[:, 0])
    with pytest.raises(ValueError, match="rope needs an even head dim"):
        softmax_attn(q[..., :3], k[..., :3], v, rope={})
