"""path_attn backend="triton" == recurrent: outputs, final cache and the gradients of q, k, v, w, beta, g and the
cache's tensors; odd T, K != V, a cache, gate on and off, chunk sizes, splits of chunks crossed whole, bf16, FLA's
reference (where importable), a sequence split in two calls. Runs on CUDA when present, else on the CPU through
Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.ops.common.kv_cache import KVCache
from linattn.ops.common.triton_compat import triton_available
from linattn.ops.path_attn import path_attn
from linattn.testing import (
    assert_close,
    check_backends_agree,
    check_half_against_float32,
    l2norm,
    log_gate,
    randn,
)

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "w", "beta", "g", "k0", "v0", "d0"]
# "16" and "32" step chunk by chunk ("32" with one chunk per forward program, the others two: T = 37 leaves the last
# program's second chunk past the end); "split2" crosses earlier splits of two 16-position chunks whole (splits.py;
# T = 37: a last split of one chunk), at any length
SETTINGS = {"16": {"C": 16, "BN": 16, "programs": 2, "split": 1},
            "32": {"C": 32, "BN": 16, "programs": 3, "split": 1, "fwd_chunks": 1},
            "split2": {"C": 16, "BN": 16, "programs": 2, "split": 2, "split_from": 1},
            "split4": {"C": 16, "BN": 16, "programs": 2, "split": 4, "split_from": 1}}


@pytest.fixture
def blocks(request, monkeypatch):
    """The flash pass's chunk and the number of backward programs (LAUNCH is read at every call)."""
    from linattn.ops.path_attn import triton as path_triton

    for key, value in SETTINGS[request.param].items():
        monkeypatch.setitem(path_triton.LAUNCH, key, value)
    return request.param


def make(B, T, H, K, V, T0=0, gate=True, dtype=torch.float32, seed=0):
    """q, k, v, unit-norm w, beta in (0, 2), log gates g (or None), a cache of T0 positions (or Nones)."""
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
    return [None if x is None else x.to(DEVICE) for x in (q, k, v, w, beta, g, k0, v0, d0)]


def run(q, k, v, w, beta, g, k0, v0, d0, backend):
    cache = None if k0 is None else KVCache(k0, v0, {"log_decay": d0})
    o, state = path_attn(q, k, v, w, beta, g, initial_state=cache, output_final_state=True, backend=backend)
    return o, state.k, state.v, state.extras["log_decay"]


@pytest.mark.parametrize("blocks", ["16", "32", "split2"], indirect=True)
@pytest.mark.parametrize("T0", [0, 21])
@pytest.mark.parametrize("shape", [(1, 1, 1, 16, 16), (2, 37, 2, 8, 12), (1, 50, 2, 16, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_triton_matches_recurrent_fp32(shape, T0, blocks):
    check_backends_agree(run, make(*shape, T0=T0), NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("blocks", ["16", "split2"], indirect=True)
def test_training_call_keeps_no_ut_intermediates(blocks):
    """A training call (no final state) keeps for the backward pass the op's inputs, the flash pass's inputs and
    outputs and the UT transform's Tw and chunked w: nothing else (the transform's backward recomputes its
    factors, the flash pass's backward the keys at their split's end). A tensor kept twice counts once."""
    def output_only(q, k, v, w, beta, g, k0, v0, d0, backend):
        return (path_attn(q, k, v, w, beta, g, backend=backend)[0],)

    xs = make(2, 37, 2, 16, 12)
    check_backends_agree(output_only, xs[:6] + [None] * 3, NAMES, ["triton"], tol=1e-5)

    saved = {}

    def keep(t):
        saved[t.data_ptr(), t.shape] = t.numel()
        return t

    leaves = [x.detach().requires_grad_() for x in xs[:6]]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        path_attn(*leaves, backend="triton")[0].sum().backward()
    B, T, H, K, V, C = 2, 37, 2, 16, 12, 16
    N = -(-T // C)
    rows = B * H * N * C  # positions padded to whole chunks, every head
    allowed = (2 * B * T * H * K + B * T * H  # q, k, beta: what the transform's backward reads
               + 4 * rows * K  # and Tw and w by chunks; Q^, K^
               + rows * C + rows // C * K * K  # intra, E
               + 2 * rows * V + 2 * rows)  # values and o, G and the log-sum-exp
    assert 0 < sum(saved.values()) <= allowed, (sum(saved.values()), allowed)


@pytest.mark.parametrize("blocks", ["16"], indirect=True)
def test_float64_inputs(blocks):
    """float64 inputs take the PyTorch UT transform (in float64; the flash pass in float32): a final state with a
    cache, and a training call (the transform under a checkpoint)."""
    xs = make(1, 40, 2, 16, 12, T0=5, dtype=torch.float64, seed=8)
    check_backends_agree(run, xs, NAMES, ["triton"], tol=1e-5)

    def output_only(q, k, v, w, beta, g, k0, v0, d0, backend):
        return (path_attn(q, k, v, w, beta, g, backend=backend)[0],)

    check_backends_agree(output_only, xs[:6] + [None] * 3, NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ut_kernels_match_the_pytorch_transform(dtype):
    """The UT transform's kernels against chunk.ut_transform in float64, forward and backward: K = 40 in two
    column blocks (the second part masked), a partial last chunk, 16-position chunks."""
    from linattn.ops.path_attn.chunk import ut_transform
    from linattn.ops.path_attn.ut_triton import ut_transform_triton

    B, T, H, K, C = 2, 37, 2, 40, 16
    q, k, v, w, beta, g, _, _, _ = make(B, T, H, K, 4, dtype=dtype, seed=6)
    xs = [x.detach().requires_grad_() for x in (q, k, w, beta, g)]
    out = ut_transform_triton(*xs, 0.3, C)
    ref64 = [x.detach().double().requires_grad_() for x in xs]
    ut = ut_transform(ref64[0], ref64[1], v.double(), *ref64[2:], 0.3, C)
    N = ut.intra.shape[2]
    ref = [ut.Qhat.reshape(B, H, N * C, K), ut.intra, ut.E, ut.Khat.reshape(B, H, N * C, K)]
    tol, metric = (1e-5, "rel") if dtype == torch.float32 else (1e-2, "rmse")
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(DEVICE) for r in ref]
    finite = lambda x: torch.where(torch.isfinite(x), x, 0.0)  # intra's -inf above the diagonal
    for name, a, e in zip(["Q^", "intra", "E", "K^"], out, ref):
        assert torch.equal(torch.isfinite(a), torch.isfinite(e)), name
        assert_close(finite(a.double()), finite(e), tol, f"{dtype} {name}", metric=metric)
    got = torch.autograd.grad(sum((finite(a.double()) * wt).sum() for a, wt in zip(out, weights)), xs)
    expected = torch.autograd.grad(sum((finite(e) * wt).sum() for e, wt in zip(ref, weights)), ref64)
    for name, a, e in zip(["q", "k", "w", "beta", "g"], got, expected):
        assert a.dtype == dtype
        assert_close(a.double(), e, tol, f"{dtype} grad of {name}", metric=metric)


@pytest.mark.parametrize("blocks", ["16", "split2"], indirect=True)
def test_without_gate(blocks):
    check_backends_agree(run, make(2, 41, 2, 16, 8, T0=3, gate=False, seed=1), NAMES, ["triton"], tol=1e-5)


def test_default_blocks():
    """The default LAUNCH settings (64-token chunks) over several chunks and a cache."""
    check_backends_agree(run, make(1, 150, 1, 32, 32, T0=70, seed=2), NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("blocks", ["32", "split2"], indirect=True)
def test_bf16_against_float32_recurrent(blocks):
    check_half_against_float32(run, make(2, 45, 2, 16, 16, T0=6, dtype=torch.bfloat16, seed=3), NAMES)


@pytest.mark.parametrize("blocks", ["16"], indirect=True)
def test_split_equals_full_and_fla_reference(blocks):
    q, k, v, w, beta, g, _, _, _ = make(2, 45, 2, 16, 16, seed=4)
    o, state = path_attn(q, k, v, w, beta, g, output_final_state=True, backend="recurrent", scale=0.2)
    first = [x[:, :18] for x in (q, k, v, w, beta, g)]
    rest = [x[:, 18:] for x in (q, k, v, w, beta, g)]
    o1, s1 = path_attn(*first, output_final_state=True, backend="triton", scale=0.2)
    o2, s2 = path_attn(*rest, initial_state=s1, output_final_state=True, backend="triton", scale=0.2)
    assert_close(torch.cat([o1, o2], 1), o, 1e-5, "split o")
    assert_close(s2.k, state.k, 1e-5, "split cache k")
    try:
        from fla.ops.path_attn.naive import naive_path_attn
    except Exception:  # FLA is optional: the split half of the test still ran
        return
    expected = naive_path_attn(*(x.cpu() for x in (q, k, v, w, beta, g)), 0.2, chunk_size=16)
    assert_close(torch.cat([o1, o2], 1).cpu(), expected, 2e-4, "triton vs FLA's naive_path_attn")


@pytest.mark.parametrize("blocks", ["16", "split4"], indirect=True)
def test_bf16_long_query_chain(blocks):
    """T = 320 in 16-token chunks: the last queries are moved back through 19 chunk products with bf16 operands
    (with splits of 4: 3 chunk products and 4 split products, the keys moved on with float32 products and rounded
    once); the
    output stays within the bf16 bound of the float32 recurrence (measured 2.3e-3 either way; the chunk backend,
    float32 math on the same bf16 inputs: 1.6e-3)."""
    xs = make(1, 320, 2, 32, 32, dtype=torch.bfloat16, seed=5)
    ref = run(*[None if x is None else x.float() for x in xs], "recurrent")
    with torch.no_grad():
        out = run(*xs, "triton")
    assert_close(out[0], ref[0], 5e-3, "bf16 output after a long chain", metric="rmse")


@pytest.mark.parametrize("blocks", ["split2"], indirect=True)
def test_splits_compile_without_graph_breaks(blocks):
    """The flash ops with the splits' key transform inside trace: torch.compile(fullgraph=True) gives the eager loss
    and gradients over three splits."""
    torch._dynamo.reset()
    xs = [x.detach().requires_grad_() for x in make(1, 90, 2, 16, 16, seed=6)[:6]]

    def loss(*xs):
        return path_attn(*xs, backend="triton")[0].square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    value = compiled(*xs)
    assert torch.allclose(value, loss(*xs), rtol=1e-6)
    for a, b in zip(torch.autograd.grad(value, xs), torch.autograd.grad(loss(*xs), xs)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_split_size_follows_the_length():
    from linattn.ops.path_attn.splits import split_size

    assert [split_size(8, n, 128) for n in (1, 127, 128, 500)] == [1, 1, 8, 8]
    assert [split_size(8, n) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 8]  # no longer than the chunks need
    assert [split_size("sqrt", n, 64) for n in (63, 64, 127, 128, 511, 512)] == [1, 8, 8, 16, 16, 32]


@pytest.mark.parametrize("split", [0, 3, True, "2", "root"])
def test_a_bad_split_setting_is_named(split, monkeypatch):
    from linattn.ops.path_attn import triton as path_triton

    monkeypatch.setitem(path_triton.LAUNCH, "split", split)
    with pytest.raises(ValueError, match="split must be a power of two"):
        run(*make(1, 20, 1, 8, 8), "triton")
