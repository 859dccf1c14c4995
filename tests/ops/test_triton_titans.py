"""titans backend="triton" == recurrent (and chunk): outputs, final (M, S) and every gradient (q, k, v, theta, alpha,
eta, the initial M and S); the gate coefficients' kernels == their PyTorch reference; float32 and bf16; lengths that
are not multiples of the mini-batch or of 64, shorter than one mini-batch; gates at the ends of [0, 1]; mini-batches
of 16 and 32; V split into blocks with a partial last block; splitting at a mini-batch boundary; long sequences
finite; torch.compile without graph breaks.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

from linattn.ops import get_op
from linattn.ops.common.triton_compat import triton_available
from linattn.ops.ttt import titans, titans_step
from linattn.testing import check_backends_agree, l2norm, randn

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["q", "k", "v", "theta", "alpha", "eta", "M0", "S0"]


def make(B, T, H, K, V, seed=0, with_state=True):
    """q, k (L2-normalised), v, theta in (0, 0.5), alpha in (0, 0.2), eta in (0, 1), M0, S0 (or None)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(randn(B, T, H, K, generator=gen)) for _ in range(2))
    v = randn(B, T, H, V, generator=gen)
    theta, alpha, eta = (torch.rand(B, T, H, generator=gen, dtype=torch.float64).float() for _ in range(3))
    M0, S0 = (0.1 * randn(B, H, K, V, generator=gen) for _ in range(2))
    xs = [q, k, v, 0.5 * theta, 0.2 * alpha, eta, M0, S0]
    if not with_state:
        xs[6:] = [None, None]
    return [None if x is None else x.to(DEVICE) for x in xs]


def runner(mini_batch_size=16, final=True):
    def run(q, k, v, theta, alpha, eta, M0, S0, backend):
        o, state = titans(q, k, v, theta, alpha, eta, initial_state=None if M0 is None else (M0, S0),
                          output_final_state=final, backend=backend, mini_batch_size=mini_batch_size)
        return (o, *state) if final else (o,)
    return run


@pytest.fixture
def small_value_blocks(monkeypatch):
    """V blocks of 16 in every kernel, so small test shapes run several programs per head."""
    from linattn.ops.ttt import triton as kernels

    monkeypatch.setitem(kernels.TITANS_LAUNCH, "fwd_BV", 16)
    monkeypatch.setitem(kernels.TITANS_LAUNCH, "bwd_BV", 16)
    monkeypatch.setitem(kernels.TITANS_LAUNCH, "scan_BV", 16)


@pytest.mark.parametrize("shape,mini_batch_size", [
    ((1, 5, 1, 16, 16), 16),  # shorter than one mini-batch
    ((2, 37, 2, 16, 20), 16),  # a partial last mini-batch, V != K
    ((1, 150, 2, 16, 16), 16),  # three chunks of 64 tokens, the last one partial
    ((1, 90, 1, 20, 16), 32),  # K not a power of two, mini-batches of 32
])
@pytest.mark.parametrize("with_state", [False, True])
def test_triton_matches_recurrent_fp32(shape, mini_batch_size, with_state):
    xs = make(*shape, with_state=with_state)
    check_backends_agree(runner(mini_batch_size), xs, NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("V,mini_batch_size", [(40, 16), (24, 32)])
def test_triton_value_blocks_with_a_partial_last_block(small_value_blocks, V, mini_batch_size):
    xs = make(2, 70, 2, 16, V, seed=1)
    check_backends_agree(runner(mini_batch_size), xs, NAMES, ["triton", "chunk"], tol=1e-5)


def test_triton_gradient_scan_with_other_value_blocks(monkeypatch):
    """The gradient scan of (M, S) and the per-chunk gradients split V differently: the scan's chunk-exit
    gradients are whole [K, V] tiles, so any pair of blocks gives the same gradients."""
    from linattn.ops.ttt import triton as kernels

    monkeypatch.setitem(kernels.TITANS_LAUNCH, "scan_BV", 16)
    monkeypatch.setitem(kernels.TITANS_LAUNCH, "bwd_BV", 32)
    xs = make(1, 150, 2, 16, 40, seed=3)
    check_backends_agree(runner(16), xs, NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("B,T,H,b", [(1, 5, 1, 16), (2, 37, 2, 16), (1, 90, 3, 32)])
def test_gate_coefficient_kernels_match_the_reference(B, T, H, b):
    """The coefficients' kernels (values and gate gradients) == autograd of the PyTorch reference, with gates at
    exactly 0 and 1 and a partial last mini-batch; bfloat16 gates get bfloat16 gradients."""
    from linattn.ops.ttt.triton_gates import titans_coefficients_triton, titans_gate_coefficients

    gen = torch.Generator().manual_seed(T)
    gates = [torch.rand(B, T, H, generator=gen, dtype=torch.float64).float().to(DEVICE) for _ in range(3)]
    gates[1][..., :3] = 1.0  # alpha = 1: the memory forgets at once
    gates[2][..., 3:5] = 0.0  # eta = 0: no momentum
    gates = [g.requires_grad_() for g in gates]
    ref = titans_gate_coefficients(*gates, b)
    out = titans_coefficients_triton(*gates, b)
    weights = [torch.randn(r.shape, generator=gen).to(DEVICE) for r in ref]
    grads = [torch.autograd.grad(sum((w * r).sum() for w, r in zip(weights, rs)), gates) for rs in (ref, out)]
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
    for r, o in zip(*grads):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    half = [g.detach().bfloat16().requires_grad_() for g in gates]
    G, cv, cx = titans_coefficients_triton(*half, b)
    assert G.dtype == torch.float32
    dtheta, dalpha, deta = torch.autograd.grad(G.sum() + cv.sum() + cx.sum(), half)
    assert dtheta.dtype == dalpha.dtype == deta.dtype == torch.bfloat16


def test_triton_without_final_state():
    xs = make(1, 50, 2, 16, 16, seed=2)
    check_backends_agree(runner(final=False), xs, NAMES, ["triton"], tol=1e-5)


@pytest.mark.parametrize("alpha_value,eta_value", [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)])
def test_triton_gates_at_the_edges(alpha_value, eta_value):
    """alpha, eta at 0 and 1 (exact zero products), with some tokens in between; gate gradients included."""
    xs = make(1, 45, 2, 16, 16, seed=3)
    xs[4], xs[5] = torch.full_like(xs[4], alpha_value), torch.full_like(xs[5], eta_value)
    xs[4][:, ::3] = 0.5
    xs[5][:, 1::4] = 0.5
    check_backends_agree(runner(16), xs, NAMES, ["triton"], tol=1e-5)


def test_triton_bf16():
    xs = make(1, 80, 2, 32, 32, seed=4)
    xs[:3] = [x.bfloat16() for x in xs[:3]]
    run = runner(16)

    def both(q, k, v, *rest, backend):
        if backend == "recurrent":  # float32 reference on the same bf16-rounded inputs
            q, k, v = q.float(), k.float(), v.float()
        o, M, S = run(q, k, v, *rest, backend=backend)
        assert o.dtype == q.dtype and M.dtype == S.dtype == torch.float32
        return o, M, S

    check_backends_agree(both, xs, NAMES, ["triton"], tol=5e-3, grad_tol=1e-2, metric="rmse")


def test_triton_float64_inputs_keep_their_dtypes():
    """float64 inputs run in float32 on the kernels; o and the state come back in float64, as from the other
    backends, with float32 accuracy."""
    xs = [x.double() for x in make(1, 40, 2, 16, 16, seed=9)]
    o, M, S = runner()(*xs, backend="triton")
    o_ref, M_ref, S_ref = runner()(*xs, backend="recurrent")
    assert o.dtype == M.dtype == S.dtype == torch.float64
    for a, e in ((o, o_ref), (M, M_ref), (S, S_ref)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_triton_split_at_mini_batch_boundary_and_long_sequence_finite():
    q, k, v, theta, alpha, eta, M0, S0 = make(1, 640, 1, 16, 16, seed=5)
    theta = 2 * theta  # learning rates up to 1
    kw = dict(output_final_state=True, backend="triton")
    o, (M, S) = titans(q, k, v, theta, alpha, eta, initial_state=(M0, S0), **kw)
    cut = 320
    first = [x[:, :cut] for x in (q, k, v, theta, alpha, eta)]
    rest = [x[:, cut:] for x in (q, k, v, theta, alpha, eta)]
    o1, state = titans(*first, initial_state=(M0, S0), **kw)
    o2, (M2, S2) = titans(*rest, initial_state=state, **kw)
    assert torch.allclose(torch.cat([o1, o2], 1), o, rtol=1e-5, atol=1e-5)
    assert torch.allclose(M2, M, rtol=1e-5, atol=1e-5) and torch.allclose(S2, S, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(o).all() and torch.isfinite(M).all() and torch.isfinite(S).all()
    o_chunk, (M_chunk, _) = titans(q, k, v, theta, alpha, eta, initial_state=(M0, S0), output_final_state=True,
                                   backend="chunk")
    assert torch.allclose(o, o_chunk, rtol=1e-4, atol=1e-4) and torch.allclose(M, M_chunk, rtol=1e-4, atol=1e-4)


def test_triton_after_steps_inside_a_mini_batch():
    """Steps that stop inside a mini-batch, then the op on the triton backend from their MiniBatchState, equal one
    run (the op completes the step's mini-batch token by token, the rest runs on the kernels)."""
    xs = make(1, 60, 2, 16, 16, seed=7)
    q, k, v, theta, alpha, eta, M0, S0 = xs
    o_ref, (M_ref, S_ref) = titans(q, k, v, theta, alpha, eta, initial_state=(M0, S0), output_final_state=True,
                                   backend="recurrent")
    state = (M0, S0)
    outputs = []
    for t in range(5):
        o_t, state = titans_step(*(x[:, t] for x in (q, k, v, theta, alpha, eta)), state=state)
        outputs.append(o_t)
    o, (M, S) = titans(*(x[:, 5:] for x in (q, k, v, theta, alpha, eta)), initial_state=state,
                       output_final_state=True, backend="triton")
    torch.testing.assert_close(torch.cat([torch.stack(outputs, 1), o], 1), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(M, M_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mini_batch_size", [16, 32])
def test_triton_long_with_value_blocks_slow(mini_batch_size):
    """Many chunks, several heads and V blocks (one partial): outputs, states and every gradient."""
    xs = make(2, 600, 3, 32, 80, seed=8)
    check_backends_agree(runner(mini_batch_size), xs, NAMES, ["triton"], tol=1e-5)


def test_triton_limits_and_auto_fallback():
    q, k, v, theta, alpha, eta, _, _ = make(1, 20, 1, 16, 16)
    with pytest.raises(ValueError, match="mini_batch_size"):
        titans(q, k, v, theta, alpha, eta, mini_batch_size=8, backend="triton")
    spec = get_op("titans")
    assert spec.resolve("auto", torch.device("cuda")) is spec.implementations["triton"]
    o_auto, _ = titans(q, k, v, theta, alpha, eta, mini_batch_size=8)  # auto: chunk (on the CPU, and here on CUDA)
    o_chunk, _ = titans(q, k, v, theta, alpha, eta, mini_batch_size=8, backend="chunk")
    assert torch.equal(o_auto, o_chunk)


def test_triton_docs_list_the_backend():
    """The op states its equation, and the documentation's backend tables list titans' triton backend."""
    from pathlib import Path

    doc = titans.__doc__
    assert "S_t = eta_t S_{t-1} - theta_t k_t (M_0^T k_t - v_t)^T" in doc and "M_t = (1 - alpha_t) M_{t-1} + S_t" in doc
    root = Path(__file__).resolve().parents[2]
    lines = (root / "README.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| op |"))
    row = next(line for line in lines if line.startswith("| titans |"))
    cells = dict(zip((c.strip() for c in header.strip("|").split("|")), (c.strip() for c in row.strip("|").split("|"))))
    assert cells["triton"].startswith("yes"), row
    intro = (root / "docs" / "triton.md").read_text().split("Ops with kernels:", 1)[1].split("Besides", 1)[0]
    assert "titans" in intro
    assert "## titans" in (root / "docs" / "triton.md").read_text()


def test_triton_compiles_without_graph_breaks():
    torch._dynamo.reset()
    xs = make(1, 40, 2, 16, 16, seed=6)
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    run = runner(16)

    def loss(*ts):
        o, M, S = run(*ts, backend="triton")
        return o.square().sum() + M.sum() + S.sum()

    eager_grads = torch.autograd.grad(loss(*leaves), leaves)
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    for a, b in zip(torch.autograd.grad(value, leaves), eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert torch.allclose(value, loss(*leaves), rtol=1e-6)
