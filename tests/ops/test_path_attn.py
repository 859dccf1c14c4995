"""path_attn: recurrent == parallel == chunk (outputs, caches, gradients of q, k, v, w, beta, g and the cache),
bf16, splitting, stepping, the chunk backend's hand-written backward by finite differences, its linear
training memory, the definition by explicit Householder products, the beta = 0 identities with softmax
attention and FoX, long sequences with extreme gates, bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from linattn.bench.memprobe import probe
from linattn.ops.common.kv_cache import KVCache
from linattn.ops.common.registry import get_op
from linattn.ops.path_attn import path_attn, path_attn_step
from linattn.ops.path_attn.blockwise import PathBlockwise
from linattn.testing import assert_close, check_backends_agree, l2norm, log_gate, randn

NAMES = ["q", "k", "v", "w", "beta", "g", "k0", "v0", "d0"]


def make(B, T, H, K, V, T0=0, gate=True, dtype=torch.float64, seed=0):
    """q, k, v, unit-norm w, beta in (0, 2), log gates g (or None), and a cache of T0 positions (or Nones)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (randn(B, T, H, K, dtype=dtype, generator=gen) for _ in range(2))
    v = randn(B, T, H, V, dtype=dtype, generator=gen)
    w = l2norm(randn(B, T, H, K, generator=gen, dtype=torch.float64)).to(dtype)
    beta = (2 * torch.rand(B, T, H, dtype=torch.float64, generator=gen)).to(dtype)
    g = log_gate(B, T, H, dtype=dtype, generator=gen) if gate else None
    k0, v0, d0 = None, None, None
    if T0:
        k0, v0 = randn(B, T0, H, K, dtype=dtype, generator=gen), randn(B, T0, H, V, dtype=dtype, generator=gen)
        d0 = torch.cumsum(log_gate(B, T0, H, generator=gen, dtype=torch.float64), 1).flip(1).to(dtype)
    return [q, k, v, w, beta, g, k0, v0, d0]


def cache_of(k0, v0, d0):
    return None if k0 is None else KVCache(k0, v0, {"log_decay": d0})


def run(q, k, v, w, beta, g, k0, v0, d0, backend, chunk_size=16):
    o, state = path_attn(q, k, v, w, beta, g, initial_state=cache_of(k0, v0, d0), output_final_state=True,
                         backend=backend, chunk_size=chunk_size)
    return o, state.k, state.v, state.extras["log_decay"]


@pytest.mark.parametrize("shape", [(1, 1, 1, 4, 4), (2, 7, 3, 5, 6), (1, 37, 2, 8, 3)])  # B, T, H, K, V
@pytest.mark.parametrize("T0", [0, 5])
@pytest.mark.parametrize("gate, dtype", [(True, torch.float64), (False, torch.float64), (True, torch.float32)])
def test_backends_agree(shape, T0, gate, dtype):
    inputs = make(*shape, T0=T0, gate=gate, dtype=dtype)
    check_backends_agree(run, inputs, NAMES, ["parallel", "chunk"], tol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_chunk_sizes(chunk_size):
    inputs = make(1, 131, 2, 6, 5, T0=3, dtype=torch.float32, seed=1)
    fn = lambda *xs, backend: run(*xs, backend=backend, chunk_size=chunk_size)
    check_backends_agree(fn, inputs, NAMES, ["chunk"], reference="parallel", tol=1e-5)


@pytest.mark.parametrize("T0", [0, 4])
def test_bf16_chunk_vs_float32_recurrent(T0):
    inputs = make(2, 33, 2, 16, 16, T0=T0, dtype=torch.bfloat16, seed=2)

    def fn(*xs, backend):
        if backend == "recurrent":  # the float32 reference on the same bf16-rounded numbers
            xs = [None if x is None else x.float() for x in xs]
        return run(*xs, backend=backend)

    check_backends_agree(fn, inputs, NAMES, ["chunk", "parallel"], tol=5e-3, grad_tol=1e-2, metric="rmse")


def test_definition_by_explicit_products():
    """logit_ts = scale (q_t^T H_t ... H_{s+1} k_s + G_t - G_s), with the K x K products multiplied out: the gate
    bias inside the scale, as in FLA's path_attn."""
    q, k, v, w, beta, g, _, _, _ = make(1, 9, 1, 3, 2, seed=3)
    T, K = q.shape[1], q.shape[3]
    eye = torch.eye(K, dtype=q.dtype)
    Hs = [eye - beta[0, r, 0] * torch.outer(w[0, r, 0], w[0, r, 0]) for r in range(T)]
    G = torch.cumsum(g[0, :, 0], 0)
    logits = torch.full((T, T), float("-inf"), dtype=q.dtype)
    for t in range(T):
        prod = eye
        for s in range(t, -1, -1):  # prod = H_t ... H_{s+1}
            logits[t, s] = K ** -0.5 * (q[0, t, 0] @ prod @ k[0, s, 0] + G[t] - G[s])
            prod = prod @ Hs[s]
    expected = torch.softmax(logits, -1) @ v[0, :, 0]
    for backend in ("recurrent", "parallel", "chunk"):
        o, _ = path_attn(q, k, v, w, beta, g, backend=backend)
        assert_close(o[0, :, 0], expected, 1e-12, f"{backend} vs explicit products")


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_beta_zero_is_softmax_attention_and_fox(backend):
    q, k, v, w, beta, g, _, _, _ = make(2, 40, 3, 8, 6, seed=4)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    o, _ = path_attn(q, k, v, w, torch.zeros_like(beta), backend=backend, chunk_size=16)
    ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    assert_close(o, ref.transpose(1, 2), 1e-12, "beta=0 vs SDPA")
    G = torch.cumsum(g, 1).transpose(1, 2)  # [B, H, T]
    bias = (G[..., :, None] - G[..., None, :]).masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(),
                                                            float("-inf"))
    o, _ = path_attn(q, k, v, w, torch.zeros_like(beta), g, backend=backend, chunk_size=16)
    ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=8 ** -0.5 * bias)  # the bias is scaled too
    assert_close(o, ref.transpose(1, 2), 1e-12, "beta=0 with g vs FoX bias times scale")


def test_gate_equals_fox_with_scaled_gate():
    """With beta = 0 the PaTH gate is FoX's gate times scale: path_attn(g) = forgetting_attn(scale * g)."""
    from linattn.ops.forgetting_attn import forgetting_attn

    q, k, v, w, beta, g, _, _, _ = make(1, 23, 2, 6, 5, seed=11)
    for scale in (None, 0.3):
        s = 6 ** -0.5 if scale is None else scale
        o, _ = path_attn(q, k, v, w, torch.zeros_like(beta), g, scale=scale, backend="recurrent")
        o_fox, _ = forgetting_attn(q, k, v, s * g, scale=scale, backend="recurrent")
        assert_close(o, o_fox, 1e-12, f"scale {scale}: path_attn(g) vs forgetting_attn(scale g)")


@pytest.mark.parametrize("T0", [0, 3])
@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_equals_fla_reference(backend, T0):
    """FLA's PyTorch reference naive_path_attn on the same arguments (float32, 2e-4), gate on. FLA's reference has
    no cache: a call continuing a cache of T0 tokens is compared with FLA's output on the whole sequence."""
    naive = pytest.importorskip("fla.ops.path_attn.naive").naive_path_attn
    q, k, v, w, beta, g, _, _, _ = make(2, 45, 2, 16, 16, dtype=torch.float32, seed=12)
    scale = 0.2
    expected = naive(q, k, v, w, beta, g, scale, chunk_size=16)
    state = None
    if T0:
        _, state = path_attn(*(x[:, :T0] for x in (q, k, v, w, beta, g)), scale=scale, output_final_state=True,
                             backend=backend, chunk_size=16)
    o, _ = path_attn(*(x[:, T0:] for x in (q, k, v, w, beta, g)), scale=scale, initial_state=state,
                     backend=backend, chunk_size=16)
    assert_close(o, expected[:, T0:], 2e-4, f"{backend} vs FLA's naive_path_attn")


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_split_equals_full(backend):
    q, k, v, w, beta, g, _, _, _ = make(2, 41, 2, 5, 4, seed=5)
    o, state = path_attn(q, k, v, w, beta, g, output_final_state=True, backend="recurrent")
    first = [x[:, :18] for x in (q, k, v, w, beta, g)]
    rest = [x[:, 18:] for x in (q, k, v, w, beta, g)]
    o1, s1 = path_attn(*first, output_final_state=True, backend=backend, chunk_size=16)
    o2, s2 = path_attn(*rest, initial_state=s1, output_final_state=True, backend=backend, chunk_size=16)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split o")
    assert_close(s2.k, state.k, 1e-12, "split cache k")
    assert_close(s2.extras["log_decay"], state.extras["log_decay"], 1e-12, "split cache log_decay")


def test_step_equals_chunk():
    q, k, v, w, beta, g, k0, v0, d0 = make(2, 19, 3, 4, 5, T0=2, seed=6)
    o, state = path_attn(q, k, v, w, beta, g, initial_state=cache_of(k0, v0, d0), output_final_state=True,
                         backend="chunk", chunk_size=16)
    cache = cache_of(k0, v0, d0)
    for t in range(q.shape[1]):
        o_t, cache = path_attn_step(q[:, t], k[:, t], v[:, t], w[:, t], beta[:, t], g[:, t], state=cache)
        assert_close(o_t, o[:, t], 1e-12, f"step {t}")
    assert_close(cache.k, state.k, 1e-12, "step cache k")
    assert_close(cache.extras["log_decay"], state.extras["log_decay"], 1e-12, "step cache log_decay")
    o_0, _ = path_attn_step(q[:, 0], k[:, 0], v[:, 0], w[:, 0], beta[:, 0])
    assert_close(o_0, v[:, 0], 1e-12, "first step without cache attends to itself")


@pytest.mark.parametrize("g_value", [-80.0, 0.0])  # -80: -20 per token after the scale 16^-1/2
def test_long_sequence_finite(g_value):
    q, k, v, w, beta, _, _, _, _ = make(1, 2048, 1, 16, 16, gate=False, dtype=torch.float32, seed=7)
    g = torch.full_like(beta, g_value)
    with torch.no_grad():
        o, state = path_attn(q, k, v, w, beta, g, backend="chunk", output_final_state=True, chunk_size=128)
    assert torch.isfinite(o).all() and torch.isfinite(state.k).all()
    if g_value == -80.0:  # every token sees (almost) only itself
        assert_close(o, v, 1e-4, "g=-20 attends to itself")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("g_value", [-20.0, 0.0])
def test_very_long_sequence_finite(backend, g_value):
    q, k, v, w, beta, _, _, _, _ = make(1, 65536, 1, 16, 16, gate=False, dtype=torch.float32, seed=8)
    with torch.no_grad():
        o, _ = path_attn(q, k, v, w, beta, torch.full_like(beta, g_value), backend=backend, chunk_size=128)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("T0", [0, 2])
def test_blockwise_backward_gradcheck(T0):
    """The hand-written backward of the cross-chunk attention against finite differences, every input
    (arbitrary K x K products, not only Householder ones; masked intra logits included)."""
    gen = torch.Generator().manual_seed(9)
    B, H, N, C, K, V = 1, 2, 3, 3, 2, 2
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    intra = r(B, H, N, C, C).masked_fill(~torch.ones(C, C, dtype=torch.bool).tril(), float("-inf"))
    inputs = [r(B, H, N, C, K), intra, r(B, H, N, K, K), r(B, H, N, C, K), -r(B, H, N).abs(),
              -r(B, H, N, C).abs(), r(B, H, N, C, V), r(B, H, T0, K), r(B, H, T0, V), -r(B, H, T0).abs()]
    inputs = [x.requires_grad_() for x in inputs]
    assert torch.autograd.gradcheck(lambda *xs: PathBlockwise.apply(*xs, 0.7), inputs)


def test_chunk_training_memory_linear(monkeypatch):
    """Peak RSS growth of forward + backward (fresh processes, example inputs, C = 64) grows about linearly
    in T: at most 5x for 4x the length, and below the size of one T x T float32 matrix at T = 4096 (the
    earlier sqrt-checkpointed loop needed 162 MiB there, the T x T parallel form far more). One thread per
    probe: many small ops on a busy machine are otherwise slowed down many times by thread contention."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    small, large = (probe("path_attn", "chunk", 1, T, 1, 16, 16) for T in (1024, 4096))
    assert small > 0
    assert large / small <= 5.0, f"peak memory {small:.1f} MiB at T=1024 but {large:.1f} MiB at T=4096"
    assert large < 4096 * 4096 * 4 / 2**20, f"{large:.1f} MiB at T=4096: a T x T matrix was held"


def test_registry_entry():
    spec = get_op("path_attn")
    assert spec.backends[:3] == ("recurrent", "parallel", "chunk")  # and "triton" where Triton imports
    x = spec.example_inputs(1, 20, 2, 8, 8, dtype=torch.float64)
    o_ref, _ = spec.fn(**x, backend="recurrent")
    o, _ = spec.fn(**x)  # auto = chunk on CPU
    assert_close(o, o_ref, 1e-12, "example inputs")


def test_bad_inputs():
    q, k, v, w, beta, g, k0, v0, d0 = make(1, 5, 2, 4, 3, T0=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="q must have shape"):
        path_attn(q[0], k, v, w, beta)
    with pytest.raises(ValueError, match="v must have shape"):
        path_attn(q, k, v[:, :4], w, beta)
    with pytest.raises(TypeError, match="k must be a floating tensor"):
        path_attn(q, k.long(), v, w, beta)
    with pytest.raises(ValueError, match="w must have shape"):
        path_attn(q, k, v, w[..., :3], beta)
    with pytest.raises(ValueError, match="beta must have shape"):
        path_attn(q, k, v, w, beta[:, :, :1])
    with pytest.raises(ValueError, match="g must have shape"):
        path_attn(q, k, v, w, beta, g[:, :4])
    with pytest.raises(TypeError, match="g must be a floating tensor"):
        path_attn(q, k, v, w, beta, g.int())
    with pytest.raises(ValueError, match="backend"):
        path_attn(q, k, v, w, beta, backend="flash")
    with pytest.raises(ValueError, match="chunk_size"):
        path_attn(q, k, v, w, beta, chunk_size=-16)
    with pytest.raises(ValueError, match="must carry extras"):
        path_attn(q, k, v, w, beta, initial_state=KVCache(k0, v0))
    with pytest.raises(ValueError, match="log_decay"):
        path_attn(q, k, v, w, beta, initial_state=cache_of(k0, v0, d0[:, :1]))
    with pytest.raises(ValueError, match="^w must have shape"):
        path_attn_step(q[:, 0], k[:, 0], v[:, 0], w[:, 0, :, :2], beta[:, 0])
    with pytest.raises(ValueError, match="^g must have shape"):
        path_attn_step(q[:, 0], k[:, 0], v[:, 0], w[:, 0], beta[:, 0], g)
