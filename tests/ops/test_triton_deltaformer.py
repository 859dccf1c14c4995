"""deltaformer backend="triton" == recurrent: outputs, final cache (keys and u's) and the gradients of q, k, v, beta
and the cache's tensors; odd T, K != V, a cache, several chunk / block sizes, bf16, beta = 0 (softmax attention), a
split sequence. Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.common.kv_cache import KVCache
from linattn.ops.common.triton_compat import triton_available
from linattn.ops.deltaformer import deltaformer
from linattn.testing import assert_close, check_backends_agree, check_half_against_float32, l2norm, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "beta", "k0", "u0"]
FOX_SMALL = {"fwd_BM": 16, "fwd_BN": 16, "dkv_BM": 16, "dkv_BN": 16, "dq_BM": 16, "dq_BN": 16, "delta_BM": 16}
SETTINGS = {
    "16": ({"C": 16, "BN": 16, "BV": 16, "panel": 0}, FOX_SMALL),  # one pass over the sequence
    "mixed": ({"C": 32, "BN": 16, "BV": 16}, {**FOX_SMALL, "fwd_BM": 32, "dkv_BN": 32}),
    # the blocked solve: panels of one and of two 16-row chunks (a partial last panel at T = 37 and 50); the
    # updates in value blocks of their own (32: one block at V = 20, where the solve's 16 make two)
    "panel1": ({"C": 16, "BN": 16, "BV": 16, "update_BV": 16, "panel": 1}, FOX_SMALL),
    "panel2": ({"C": 16, "BN": 16, "BV": 16, "update_BV": 32, "panel": 2}, FOX_SMALL),
}


@pytest.fixture
def blocks(request, monkeypatch):
    """Block sizes of the solve and of the flash kernels (both LAUNCH dicts are read at every launch)."""
    from linattn.ops.deltaformer import triton as df_triton
    from linattn.ops.forgetting_attn import triton as fox_triton

    solve, fox = SETTINGS[request.param]
    for key, value in solve.items():
        monkeypatch.setitem(df_triton.LAUNCH, key, value)
    for key, value in fox.items():
        monkeypatch.setitem(fox_triton.LAUNCH, key, value)
    return request.param


def make(B, T, H, K, V, T0=0, dtype=torch.float32, seed=0):
    """q, k (unit-norm, as the layer makes them), v, beta in (0, 1), and a cache of T0 positions (or None)."""
    gen = torch.Generator().manual_seed(seed)
    q = randn(B, T, H, K, dtype=dtype, generator=gen)
    k = l2norm(randn(B, T, H, K, generator=gen, dtype=torch.float64)).to(dtype)
    v = randn(B, T, H, V, dtype=dtype, generator=gen)
    beta = torch.rand(B, T, H, dtype=torch.float64, generator=gen).to(dtype)
    k0 = l2norm(randn(B, T0, H, K, generator=gen, dtype=torch.float64)).to(dtype) if T0 else None
    u0 = randn(B, T0, H, V, dtype=dtype, generator=gen) if T0 else None
    return [None if x is None else x.to(DEVICE) for x in (q, k, v, beta, k0, u0)]


def run(q, k, v, beta, k0, u0, backend):
    cache = None if k0 is None else KVCache(k0, u0)
    o, state = deltaformer(q, k, v, beta, initial_state=cache, output_final_state=True, backend=backend)
    return o, state.k, state.v


@pytest.mark.parametrize("blocks", list(SETTINGS), indirect=True)
@pytest.mark.parametrize("T0", [0, 21])
@pytest.mark.parametrize("shape", [(1, 1, 1, 16, 16), (2, 37, 2, 8, 20), (1, 50, 2, 16, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_triton_matches_recurrent_fp32(shape, T0, blocks):
    check_backends_agree(run, make(*shape, T0=T0), NAMES, ["triton"], tol=1e-5)


def test_default_blocks():
    """The default LAUNCH settings (64-row chunks in panels, 128-row flash blocks) over several chunks, two panels
    (the second partial) and a cache."""
    from linattn.ops.deltaformer import triton as df_triton

    rows = df_triton.LAUNCH["panel"] * df_triton.LAUNCH["C"] + 59  # cache and sequence: a panel and a partial one
    check_backends_agree(run, make(1, rows - 70, 1, 32, 32, T0=70, seed=1), NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("blocks", ["mixed", "panel2"], indirect=True)
def test_bf16_against_float32_recurrent(blocks):
    check_half_against_float32(run, make(2, 45, 2, 16, 16, T0=6, dtype=torch.bfloat16, seed=2), NAMES)


@pytest.mark.parametrize("blocks", ["16"], indirect=True)
def test_beta_zero_is_softmax_attention_and_split_equals_full(blocks):
    q, k, v, beta, _, _ = make(2, 40, 3, 16, 8, seed=3)
    o, _ = deltaformer(q, k, v, torch.zeros_like(beta), backend="triton")
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
    assert_close(o, ref, 1e-5, "beta = 0 vs SDPA")
    o, state = deltaformer(q, k, v, beta, output_final_state=True, backend="recurrent")
    o1, s1 = deltaformer(q[:, :23], k[:, :23], v[:, :23], beta[:, :23], output_final_state=True, backend="triton")
    o2, s2 = deltaformer(q[:, 23:], k[:, 23:], v[:, 23:], beta[:, 23:], initial_state=s1, output_final_state=True,
                         backend="triton")
    assert_close(torch.cat([o1, o2], 1), o, 1e-5, "split outputs")
    assert_close(s2.v, state.v, 1e-5, "split cache u's")


@pytest.mark.parametrize("panel", [-1, 1.5, True])
def test_a_bad_panel_setting_is_named(panel, monkeypatch):
    from linattn.ops.deltaformer import triton as df_triton

    monkeypatch.setitem(df_triton.LAUNCH, "panel", panel)
    with pytest.raises(ValueError, match="panel must be an int >= 0"):
        run(*make(1, 20, 1, 8, 8), "triton")


@pytest.fixture
def sdpa_passes(monkeypatch):
    """The plain attention passes through SDPA (sdpa_passes.py) wherever there is no cache, on any device: on the
    CPU SDPA's math kernel, on CUDA its fused kernels (there the route is the default for bf16 / fp16)."""
    from linattn.ops.deltaformer import triton as df_triton

    monkeypatch.setattr(df_triton, "sdpa_passes_apply", lambda k, v_dim, cached: cached == 0)


@pytest.mark.parametrize("shape", [(1, 1, 1, 16, 16), (2, 37, 2, 8, 20), (1, 70, 2, 16, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_sdpa_passes_match_recurrent_fp32(shape, sdpa_passes):
    check_backends_agree(run, make(*shape), NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("route", ["default", "sdpa"])
def test_bf16_without_cache_against_float32_recurrent(route, request):
    """bf16 with no cache: on CUDA the SDPA passes by default; "sdpa" forces them on the CPU as well."""
    if route == "sdpa":
        request.getfixturevalue("sdpa_passes")
    check_half_against_float32(run, make(2, 45, 2, 16, 16, dtype=torch.bfloat16, seed=4), NAMES)
