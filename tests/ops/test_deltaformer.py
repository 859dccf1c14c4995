"""deltaformer: recurrent == parallel == chunk (outputs, caches, every gradient), bf16, splitting, stepping,
the beta = 0 identity with softmax attention, long sequences, bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.common.kv_cache import KVCache
from linattn.ops.common.registry import get_op
from linattn.ops.deltaformer import deltaformer, deltaformer_step
from linattn.testing import assert_close, check_backends_agree, l2norm, randn

NAMES = ["q", "k", "v", "beta", "k0", "u0"]


def make(B, T, H, K, V, T0=0, dtype=torch.float64, seed=0):
    """q, k (unit-norm, as the layer makes them), v, beta in (0, 1), and a cache of T0 positions (or None)."""
    gen = torch.Generator().manual_seed(seed)
    q = randn(B, T, H, K, dtype=dtype, generator=gen)
    k = l2norm(randn(B, T, H, K, generator=gen, dtype=torch.float64)).to(dtype)
    v = randn(B, T, H, V, dtype=dtype, generator=gen)
    beta = torch.rand(B, T, H, dtype=torch.float64, generator=gen).to(dtype)
    k0 = l2norm(randn(B, T0, H, K, generator=gen, dtype=torch.float64)).to(dtype) if T0 else None
    u0 = randn(B, T0, H, V, dtype=dtype, generator=gen) if T0 else None
    return [q, k, v, beta, k0, u0]


def run(q, k, v, beta, k0, u0, backend, chunk_size=16):
    cache = None if k0 is None else KVCache(k0, u0)
    o, state = deltaformer(q, k, v, beta, initial_state=cache, output_final_state=True, backend=backend,
                           chunk_size=chunk_size)
    return o, state.k, state.v


@pytest.mark.parametrize("shape", [(1, 1, 1, 4, 4), (2, 7, 3, 5, 6), (1, 37, 2, 8, 3)])  # B, T, H, K, V
@pytest.mark.parametrize("T0", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backends_agree(shape, T0, dtype):
    check_backends_agree(run, make(*shape, T0=T0, dtype=dtype), NAMES, ["parallel", "chunk"], tol=1e-5)


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


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_split_equals_full(backend):
    q, k, v, beta, _, _ = make(2, 41, 2, 5, 4, seed=3)
    o, state = deltaformer(q, k, v, beta, output_final_state=True, backend="recurrent")
    o1, s1 = deltaformer(q[:, :18], k[:, :18], v[:, :18], beta[:, :18], output_final_state=True, backend=backend,
                         chunk_size=16)
    o2, s2 = deltaformer(q[:, 18:], k[:, 18:], v[:, 18:], beta[:, 18:], initial_state=s1, output_final_state=True,
                         backend=backend, chunk_size=16)
    assert_close(torch.cat([o1, o2], 1), o, 1e-12, "split o")
    assert_close(s2.k, state.k, 1e-12, "split cache k")
    assert_close(s2.v, state.v, 1e-12, "split cache u")


def test_step_equals_chunk():
    q, k, v, beta, k0, u0 = make(2, 19, 3, 4, 5, T0=2, seed=4)
    o, state = deltaformer(q, k, v, beta, initial_state=KVCache(k0, u0), output_final_state=True, backend="chunk",
                           chunk_size=16)
    cache = KVCache(k0, u0)
    for t in range(q.shape[1]):
        o_t, cache = deltaformer_step(q[:, t], k[:, t], v[:, t], beta[:, t], state=cache)
        assert_close(o_t, o[:, t], 1e-12, f"step {t}")
    assert_close(cache.v, state.v, 1e-12, "step cache u")
    o_0, first = deltaformer_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0])  # no cache: u_0 = v_0, o_0 = v_0
    assert_close(o_0, v[:, 0], 1e-12, "first step")
    assert first.length == 1


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_beta_zero_is_softmax_attention(backend):
    q, k, v, beta, _, _ = make(2, 40, 3, 8, 6, seed=5)
    o, _ = deltaformer(q, k, v, torch.zeros_like(beta), backend=backend, chunk_size=16)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    assert_close(o, ref.transpose(1, 2), 1e-12, "beta=0 vs SDPA")


def test_first_row_of_kernel_uses_one_past_key():
    """u_1 = v_1 - b_1 u_0 exactly: with one past key the softmax kernel is 1 whatever the keys."""
    q, k, v, beta, _, _ = make(1, 2, 1, 3, 2, seed=6)
    _, state = deltaformer(q, k, v, beta, output_final_state=True, backend="chunk")
    assert_close(state.v[:, 1], v[:, 1] - beta[:, 1, :, None] * v[:, 0], 1e-12, "u_1")


def test_long_sequence_finite():
    q, k, v, beta, _, _ = make(1, 2048, 1, 16, 16, dtype=torch.float32, seed=7)
    with torch.no_grad():
        o, _ = deltaformer(q, k, v, beta, backend="chunk", chunk_size=128)
    assert torch.isfinite(o).all()


def saved_bytes(T):
    """Bytes of the distinct storages autograd keeps for the chunk backend's backward at length T."""
    q, k, v, beta, _, _ = make(1, T, 2, 16, 16, dtype=torch.float32, seed=9)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    leaves = [x.requires_grad_() for x in (q, k, v, beta)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        deltaformer(*leaves, backend="chunk", chunk_size=64)
    return sum(storages.values())


def test_training_memory_is_linear():
    assert saved_bytes(2048) / saved_bytes(512) < 4.5


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_very_long_sequence_finite(backend):
    q, k, v, beta, _, _ = make(1, 65536, 1, 16, 16, dtype=torch.float32, seed=8)
    with torch.no_grad():
        o, _ = deltaformer(q, k, v, beta, backend=backend, chunk_size=128)
    assert torch.isfinite(o).all()


def test_registry_entry():
    spec = get_op("deltaformer")
    assert spec.backends[:3] == ("recurrent", "parallel", "chunk")  # and "triton" where Triton imports
    x = spec.example_inputs(1, 20, 2, 8, 8, dtype=torch.float64)
    o_ref, _ = spec.fn(**x, backend="recurrent")
    o, _ = spec.fn(**x)  # auto = chunk on CPU
    assert_close(o, o_ref, 1e-12, "example inputs")


def test_bad_inputs():
    q, k, v, beta, k0, u0 = make(1, 5, 2, 4, 3, T0=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="q must have shape"):
        deltaformer(q[0], k, v, beta)
    with pytest.raises(ValueError, match="k must have the shape of q"):
        deltaformer(q, k[:, :4], v, beta)
    with pytest.raises(ValueError, match="v must have shape"):
        deltaformer(q, k, v[:, :, :1], beta)
    with pytest.raises(TypeError, match="v must be a floating tensor"):
        deltaformer(q, k, v.long(), beta)
    with pytest.raises(ValueError, match="beta must have shape"):
        deltaformer(q, k, v, beta[..., None])
    with pytest.raises(TypeError, match="beta must be a floating tensor"):
        deltaformer(q, k, v, beta.int())
    with pytest.raises(ValueError, match="backend"):
        deltaformer(q, k, v, beta, backend="fast")
    with pytest.raises(ValueError, match="chunk_size"):
        deltaformer(q, k, v, beta, chunk_size=0)
    with pytest.raises(TypeError, match="output_final_state"):
        deltaformer(q, k, v, beta, output_final_state="yes")
    with pytest.raises(TypeError, match="initial_state must be a linattn KVCache"):
        deltaformer(q, k, v, beta, initial_state=torch.zeros(1, 2, 4, 3))
    with pytest.raises(ValueError, match=r"initial_state.v must have shape"):
        deltaformer(q, k, v, beta, initial_state=KVCache(k0, u0[..., :2]))
    with pytest.raises(ValueError, match=r"initial_state.k must have shape"):
        deltaformer(q, k, v, beta, initial_state=KVCache(k0[:, :, :1], u0))
    with pytest.raises(ValueError, match="^beta must have shape"):
        deltaformer_step(q[:, 0], k[:, 0], v[:, 0], beta)
    with pytest.raises(ValueError, match="^k must have the shape of q "):
        deltaformer_step(q[:, 0], k[:, 0, :1], v[:, 0], beta[:, 0])
