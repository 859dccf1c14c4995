"""forgetting_attn backend="triton" == recurrent: outputs, final cache and the gradients of q, k, v, g and the cache
tensors; odd T, GQA, windows, RoPE, a KV cache, g = 0 (softmax attention), strong gates, bf16, decoding steps.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py). Small blocks make the
kernels' masked / unmasked block ranges all occur at these lengths."""

import pytest
import torch

from linattn.ops.common.kv_cache import KVCache
from linattn.ops.common.triton_compat import triton_available
from linattn.ops.forgetting_attn import forgetting_attn, forgetting_attn_step
from linattn.ops.softmax_attn import softmax_attn
from linattn.testing import assert_close, check_backends_agree, check_half_against_float32, grads, log_gate, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "g", "cache.k", "cache.v", "cache.g"]
SMALL_BLOCKS = {"fwd_BM": 16, "fwd_BN": 16, "dkv_BM": 16, "dkv_BN": 16, "dq_BM": 16, "dq_BN": 16, "delta_BM": 16}
MIXED_BLOCKS = {"fwd_BM": 32, "fwd_BN": 16, "dkv_BM": 16, "dkv_BN": 32, "dq_BM": 16, "dq_BN": 32, "delta_BM": 32}


@pytest.fixture
def blocks(request, monkeypatch):
    """Set the kernels' block sizes (LAUNCH is read at every launch)."""
    from linattn.ops.forgetting_attn import triton as fox_triton

    for key, value in request.param.items():
        monkeypatch.setitem(fox_triton.LAUNCH, key, value)
    return request.param


def make(B, T, H, H_kv, K, V, T0, dtype=torch.float32, seed=0, low=-1.0):
    gen = torch.Generator().manual_seed(seed)
    q = randn(B, T, H, K, dtype=dtype, generator=gen)
    k, v = randn(B, T, H_kv, K, dtype=dtype, generator=gen), randn(B, T, H_kv, V, dtype=dtype, generator=gen)
    g = log_gate(B, T, H, dtype=dtype, generator=gen, low=low)
    ck, cv = randn(B, T0, H_kv, K, dtype=dtype, generator=gen), randn(B, T0, H_kv, V, dtype=dtype, generator=gen)
    cg = log_gate(B, T0, H, dtype=dtype, generator=gen, low=low)
    xs = [q, k, v, g] + ([ck, cv, cg] if T0 else [None, None, None])
    return [None if x is None else x.to(DEVICE) for x in xs]


def run(q, k, v, g, ck, cv, cg, backend, **opts):
    cache = None if ck is None else KVCache(ck, cv, {"g": cg})
    o, state = forgetting_attn(q, k, v, g, initial_state=cache, output_final_state=True, backend=backend, **opts)
    return o, state.k, state.v, state.extras["g"]


CASES = [  # B, T, H, H_kv, K, V, T0
    (1, 1, 2, 1, 16, 16, 0),
    (2, 37, 4, 2, 8, 12, 0),
    (1, 45, 2, 2, 16, 16, 21),
    (1, 3, 3, 1, 20, 10, 35),
]
OPTIONS = [{}, {"window_size": 3}, {"window_size": 20, "rope": {"theta": 500.0}}]


@pytest.mark.parametrize("blocks", [SMALL_BLOCKS, MIXED_BLOCKS], indirect=True, ids=["16", "mixed"])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_triton_matches_recurrent_fp32(case, opts, blocks):
    xs = make(*case)
    check_backends_agree(lambda *a, backend: run(*a, backend, **opts), xs, NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("T", [300, 5])
def test_default_blocks_long_cache_and_window(T):
    """The default LAUNCH block sizes (several query and key blocks with a 180-token cache; T = 5: the 16-row
    query blocks of decoding)."""
    xs = make(1, T, 2, 1, 32, 32, 180, seed=1, low=-0.1)
    for opts in ({}, {"window_size": 150}):
        check_backends_agree(lambda *a, backend, o=opts: run(*a, backend, **o), xs, NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("blocks", [SMALL_BLOCKS], indirect=True, ids=["16"])
def test_zero_gates_are_softmax_attention(blocks):
    q, k, v, g, ck, cv, _ = make(2, 29, 4, 2, 16, 8, 6, seed=2)
    for opts in ({}, {"window_size": 5}):
        o, _ = forgetting_attn(q, k, v, torch.zeros_like(g), initial_state=KVCache(ck, cv, {"g": torch.zeros(
            2, 6, 4, device=DEVICE)}), backend="triton", **opts)
        o_ref, _ = softmax_attn(q, k, v, initial_state=KVCache(ck, cv), backend="recurrent", **opts)
        assert_close(o, o_ref, 1e-5, f"g = 0 vs softmax_attn {opts}")


@pytest.mark.parametrize("blocks", [SMALL_BLOCKS], indirect=True, ids=["16"])
def test_strong_and_large_cumulative_gates(blocks):
    """g = -20: o_t = v_t. g in [-8, 0) over 400 tokens: |G| reaches ~1600, yet the float32 kernels agree with the
    float64 recurrence to 1e-5 (the bias is formed from float64 G per tile, not from float32 G)."""
    q, k, v, _, *_ = make(1, 50, 2, 2, 16, 16, 0, seed=3)
    o, _ = forgetting_attn(q, k, v, torch.full((1, 50, 2), -20.0, device=DEVICE), backend="triton")
    assert_close(o, v, 1e-5, "g = -20: o = v")
    # g in [-8, 0) over 400 tokens (|G| reaches ~1600), against the float64 recurrence
    xs = make(1, 400, 1, 1, 16, 16, 0, seed=4, low=-8.0)
    ref_out, ref_grad = grads(lambda *a: run(*a, "recurrent"), [None if x is None else x.double() for x in xs])
    out, grad = grads(lambda *a: run(*a, "triton"), xs)
    assert_close(out[0], ref_out[0], 1e-5, "output at |G| ~ 1600")
    for name, a, e in zip(NAMES[:4], grad, ref_grad):
        assert_close(a, e, 1e-5, f"grad of {name} at |G| ~ 1600")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_against_float32_recurrent(dtype, monkeypatch):
    from linattn.ops.forgetting_attn import triton as fox_triton

    for key, value in MIXED_BLOCKS.items():
        monkeypatch.setitem(fox_triton.LAUNCH, key, value)
    check_half_against_float32(run, make(2, 45, 2, 1, 16, 16, 6, dtype=dtype, seed=5), NAMES)


@pytest.mark.parametrize("blocks", [SMALL_BLOCKS], indirect=True, ids=["16"])
def test_split_and_decoding_steps_equal_full(blocks):
    """[0:t] then [t:T] with the cache carried, and single-token calls (what a CUDA decoding step runs), equal the
    recurrent call over everything."""
    from linattn.ops.forgetting_attn.api import SPEC

    q, k, v, g, ck, cv, cg = make(2, 21, 4, 2, 8, 8, 3, seed=6)
    opts = {"window_size": 9}
    o, s = forgetting_attn(q, k, v, g, initial_state=KVCache(ck, cv, {"g": cg}), output_final_state=True,
                           backend="recurrent", **opts)
    o1, s1 = forgetting_attn(q[:, :17], k[:, :17], v[:, :17], g[:, :17], initial_state=KVCache(ck, cv, {"g": cg}),
                             output_final_state=True, backend="triton", **opts)
    triton_step = SPEC.implementations["triton"]
    state, outs = s1, [o1]
    for t in range(17, 21):
        o_t, state = triton_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], scale=8 ** -0.5,
                                 initial_state=state, output_final_state=True, **opts)
        before = KVCache(state.k[:, :-1], state.v[:, :-1], {"g": state.extras["g"][:, :-1]})
        o_ref, _ = forgetting_attn_step(q[:, t], k[:, t], v[:, t], g[:, t], state=before, **opts)
        assert_close(o_t[:, 0], o_ref, 1e-5, f"step {t} vs the recurrent step")
        outs.append(o_t)
    assert_close(torch.cat(outs, 1), o, 1e-5, "split + steps vs full")
    assert_close(state.k, s.k, 1e-6, "cache k")
    assert_close(state.extras["g"], s.extras["g"], 1e-6, "cache g")


def test_float64_inputs_give_float64_outputs():
    xs = make(1, 9, 2, 1, 16, 16, 4, dtype=torch.float64, seed=7)
    o, k, _, g = run(*xs, "triton")
    assert o.dtype == torch.float64 and k.dtype == torch.float64 and g.dtype == torch.float64
    check_backends_agree(lambda *a, backend: run(*a, backend), xs, NAMES, ["triton"], tol=1e-5)


def test_head_dims_above_the_limit_are_refused():
    q, k, v, g, *_ = make(1, 4, 1, 1, 264, 8, 0)
    with pytest.raises(ValueError, match="K, V <= 256"):
        forgetting_attn(q, k, v, g, backend="triton")



@pytest.mark.parametrize("blocks", [SMALL_BLOCKS], indirect=True, ids=["16"])
@pytest.mark.parametrize("window", [0, 5])
def test_kernels_without_gates_equal_zero_gates(blocks, window):
    """fox_attention with G None (the kernels' HAS_GATE off: deltaformer's attention passes) equals the same call
    with G = 0 read from memory: output and the gradients of q, k, v (GQA, padding rows, both masked ranges)."""
    from linattn.ops.forgetting_attn.triton import fox_attention

    B, T, H, H_kv, D = 2, 37, 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(B, T, h, D, generator=gen).to(DEVICE) for h in (H, H_kv, H_kv))
    zeros = torch.zeros(B, H, T, dtype=torch.float64, device=DEVICE)

    def attend(q, k, v, G):
        return (fox_attention(q, k, v, G, 0.25, window),)

    (o_ref,), ref = grads(attend, [q, k, v, zeros])
    (o,), got = grads(attend, [q, k, v, None])
    assert got[3] is None and ref[3] is not None and torch.isfinite(ref[3]).all()
    assert_close(o, o_ref, 1e-6, "o")
    for name, a, b in zip("qkv", got[:3], ref[:3]):
        assert_close(a, b, 1e-6, "d" + name)
