"""The layers' fused kernels (norms_triton.py, gates_triton.py, read_keys_triton.py) equal PyTorch's F.normalize,
RMSNorm (times SiLU(gate)), the Mamba2 decay gate (with Gated DeltaNet's beta, or Mamba2's keys scaled by dt) and
Comba's read key, values and gradients, float32 and bf16; layers give the same outputs and gradients with either
backend."""

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.layers import fused, norms
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import rel_rmse

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _grads(fn, *xs):
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*leaves)
    gen = torch.Generator().manual_seed(1)
    out.backward(torch.randn(out.shape, generator=gen).to(out))
    return out.detach(), [x.grad for x in leaves]


def _assert_compiled_grads_equal_eager(loss, leaves):
    """loss(*leaves)'s gradients under torch.compile(fullgraph=True) equal the eager ones."""
    eager = torch.autograd.grad(loss(*leaves), leaves)
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves), leaves)
    for x, e in zip(compiled, eager):
        assert torch.allclose(x, e, rtol=1e-5, atol=1e-6)


def _reference_l2(x):
    return F.normalize(x.float(), p=2.0, dim=-1, eps=norms.L2_EPS).to(x.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("D", [24, 128])
def test_l2norm_equals_f_normalize(dtype, tol, D):
    from linattn.layers.norms_triton import l2norm_triton

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 2, D, generator=gen)
    x[0, 0, 0] = 0.0  # a zero row: the norm is clamped at eps, the gradient does not pass through it
    x[0, 1, 1] *= 1e-8
    x = x.to(DEVICE, dtype)
    out, grads = _grads(lambda t: l2norm_triton(t, norms.L2_EPS), x)
    ref, ref_grads = _grads(_reference_l2, x)
    assert out.dtype == dtype and torch.isfinite(grads[0]).all()
    assert rel_rmse(out.float(), ref.float()) <= tol
    assert rel_rmse(grads[0].float(), ref_grads[0].float()) <= (tol if dtype == torch.float32 else 2 * tol)


def _reference_rms(o, w, gate, eps):
    y = o.float() * torch.rsqrt(o.float().square().mean(-1, keepdim=True) + eps) * w.float()
    y = y if gate is None else y * F.silu(gate.float())
    return y.to(o.dtype if gate is None else gate.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("D", [24, 128])
def test_rms_norm_gated_equals_reference(dtype, tol, gated, D):
    from linattn.layers.norms_triton import rms_norm_gated_triton

    gen = torch.Generator().manual_seed(0)
    o, w = torch.randn(2, 41, 3, D, generator=gen), 1 + 0.1 * torch.randn(D, generator=gen)
    gate = torch.randn(2, 41, 3, D, generator=gen) if gated else None
    ts = [t.to(DEVICE, dtype) for t in (o, w) + ((gate,) if gated else ())]
    fused = lambda o, w, *g: rms_norm_gated_triton(o, w, g[0] if g else None, 1e-5)
    ref = lambda o, w, *g: _reference_rms(o, w, g[0] if g else None, 1e-5)
    out, grads = _grads(fused, *ts)
    ref_out, ref_grads = _grads(ref, *ts)
    assert rel_rmse(out.float(), ref_out.float()) <= tol
    for name, a, b in zip(["o", "weight", "gate"], grads, ref_grads):
        assert rel_rmse(a.float(), b.float()) <= (tol if dtype == torch.float32 else 2 * tol), name


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "delta_rule", "mamba2", "comba"])
def test_layer_is_the_same_with_either_norm_backend(mixer, monkeypatch):
    from linattn.layers.registry import build_mixer

    torch.manual_seed(0)
    layer = build_mixer(mixer, 32, 2, backend="chunk", chunk_size=16).to(DEVICE)
    x = torch.randn(2, 23, 32, device=DEVICE)
    outs = {}
    for backend in ("torch", "triton"):
        layer.zero_grad()
        # ShortConvs on the multiply-adds: "auto" picks conv1d on CUDA, whose float32 runs in TF32 there
        with linattn.settings(fused_backend=backend, shortconv_backend="muladd"):
            y, _ = layer(x, use_cache=False)
            y.square().mean().backward()
        outs[backend] = (y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()})
    assert rel_rmse(outs["triton"][0], outs["torch"][0]) <= 1e-5
    # float32 sums in another order: judged against the largest gradient of the layer, since a parameter's gradient
    # can be a sum that nearly cancels (mamba2's D: 7e-5 out of terms of size 1e-2)
    scale = max(float(g.abs().max()) for g in outs["torch"][1].values())
    for name, grad in outs["torch"][1].items():
        assert torch.allclose(outs["triton"][1][name], grad, rtol=1e-5, atol=1e-6 * scale), name


def test_backend_switch_checks_its_argument():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'torch', 'triton'"):
        fused.set_fused_backend("cuda")


def test_compiled_equals_eager():
    """Custom ops under torch.compile, autograd Functions eagerly: same numbers."""
    from linattn.layers.gates_triton import mamba_gate_triton
    from linattn.layers.norms_triton import l2norm_pair_triton, l2norm_triton, rms_norm_gated_triton

    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((2, 9, 2, 16), (16,), (2, 9, 2, 16)))
    leaves = [t.requires_grad_(True) for t in (x, w, g)]

    shapes = ((2, 9, 3), (3,), (3,))
    a, a_log, dt_bias = (torch.randn(*s, generator=gen).to(DEVICE).requires_grad_(True) for s in shapes)
    leaves += [a, a_log, dt_bias]

    def loss(x, w, g, a, a_log, dt_bias):
        gate, dt = mamba_gate_triton(a, a_log, dt_bias)
        qn, kn = l2norm_pair_triton(x, g, 1e-6)
        return (rms_norm_gated_triton(l2norm_triton(x, 1e-6), w, g, 1e-5).square().sum() + (gate * dt).sum()
                + (qn * kn.square()).sum())

    eager = loss(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    for a, b in zip(torch.autograd.grad(value, leaves), eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_gate_with_beta_equals_reference(dtype):
    """g and beta = sigmoid(b) from one launch, in the activation dtype: as PyTorch's decay cast to that dtype and
    its sigmoid, values and every gradient (A_log and dt_bias summed over tokens)."""
    from linattn.layers.gates_triton import mamba_gate_beta_triton

    gen = torch.Generator().manual_seed(0)
    a, b = 4 * torch.randn(3, 29, 5, generator=gen), 3 * torch.randn(3, 29, 5, generator=gen)
    a[0, 0] = 30.0  # past softplus's linear threshold
    a_log, dt_bias = torch.randn(5, generator=gen), torch.randn(5, generator=gen)

    def reference(a, b, a_log, dt_bias):
        g = -torch.exp(a_log.float()) * F.softplus(a.float() + dt_bias.float())
        return g.to(dtype), torch.sigmoid(b).to(dtype)

    def loss_of(fn):
        def run(*ts):
            g, beta = fn(*ts)
            assert g.dtype == beta.dtype == dtype
            return (g.float().square().sum() + (beta.float() * torch.arange(5.0, device=beta.device)).sum()).reshape(1)
        return run

    ts = [a.to(DEVICE, dtype), b.to(DEVICE, dtype), a_log.to(DEVICE), dt_bias.to(DEVICE)]
    out, grads = _grads(loss_of(lambda a, b, a_log, dt_bias: mamba_gate_beta_triton(a, a_log, dt_bias, b, dtype)),
                        *ts)
    ref, ref_grads = _grads(loss_of(reference), *ts)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_rmse(out, ref) <= tol
    for name, x, y in zip(["a", "b", "A_log", "dt_bias"], grads, ref_grads):
        assert rel_rmse(x.float(), y.float()) <= tol, name


@pytest.mark.parametrize("with_dt_grad", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_mamba_gate_equals_reference(with_dt_grad, dtype, tol):
    from linattn.layers.gates_triton import mamba_gate_triton

    gen = torch.Generator().manual_seed(0)
    a = 4 * torch.randn(3, 29, 5, generator=gen)
    a[0, 0] = 30.0  # past softplus's linear threshold
    a_log, dt_bias = torch.randn(5, generator=gen), torch.randn(5, generator=gen)

    def reference(a, a_log, dt_bias):
        dt = F.softplus(a.float() + dt_bias.float())
        return -torch.exp(a_log.float()) * dt, dt

    def loss_of(fn):
        def run(*ts):
            g, dt = fn(*ts)
            return g.square().sum() + (dt.sin().sum() if with_dt_grad else 0)
        return run

    ts = [a.to(DEVICE, dtype), a_log.to(DEVICE), dt_bias.to(DEVICE)]
    out, grads = _grads(lambda *t: loss_of(mamba_gate_triton)(*t).reshape(1), *ts)
    ref, ref_grads = _grads(lambda *t: loss_of(reference)(*t).reshape(1), *ts)
    assert rel_rmse(out, ref) <= 1e-5
    for name, x, y in zip(["a", "A_log", "dt_bias"], grads, ref_grads):
        assert rel_rmse(x.float(), y.float()) <= tol, name


@pytest.mark.parametrize("fused_backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_gate", [True, False])
def test_norm_gate_project_equals_the_composition(fused_backend, dtype, with_gate):
    """norm_gate_project recomputes the norm's output in the backward pass: the same output and gradients
    (o, gate, the norm and projection weights) as proj(rms_norm_gated(...)) with autograd keeping it, under
    autocast too; the norm's output is not among the tensors kept."""
    torch.manual_seed(0)
    B, T, H, V, D = 2, 19, 2, 16, 24
    norm, proj = torch.nn.RMSNorm(V, eps=1e-5), torch.nn.Linear(H * V, D, bias=False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    o = torch.randn(B, T, H, V, device=DEVICE)
    gate = torch.randn(B, T, H, V, device=DEVICE) if with_gate else None
    norm, proj = norm.to(DEVICE), proj.to(DEVICE)
    autocast = torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    results = []
    for fn in (lambda o, g: proj(norms.rms_norm_gated(o, norm, g).reshape(B, T, -1)),
               lambda o, g: norms.norm_gate_project(o, norm, g, proj, (B, T, H * V))):
        leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in (o, gate)]
        norm.zero_grad(), proj.zero_grad()
        saved = []
        with linattn.settings(fused_backend=fused_backend), autocast, \
                torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            out = fn(*leaves)
        out.float().square().sum().backward()
        results.append((out, *[x.grad for x in leaves if x is not None], norm.weight.grad, proj.weight.grad,
                        len(saved)))
    (*plain, n_plain), (*fused_, n_fused) = results
    for a, b in zip(plain, fused_):
        assert a.dtype == b.dtype
        # bit for bit in PyTorch; the Triton norm's weight gradient sums its partials in another order
        assert torch.equal(a, b) or rel_rmse(b, a) < 1e-5
    assert n_fused < n_plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_gate", [True, False])
def test_rms_norm_gated_backward_gives_the_forward_output(dtype, with_gate):
    """The backward kernel's copy of y (what norm_gate_project reads for the projection's weight gradient) is the
    forward kernel's y bit for bit, and asking for it changes no gradient."""
    from linattn.layers.norms_triton import rms_norm_gated_backward, rms_norm_gated_forward

    gen = torch.Generator().manual_seed(0)
    o, dy = (torch.randn(3, 37, 2, 24, generator=gen).to(DEVICE, dtype) for _ in range(2))
    gate = torch.randn(3, 37, 2, 24, generator=gen).to(DEVICE, dtype) if with_gate else None
    weight = torch.rand(24, generator=gen).add(0.5).to(DEVICE)
    y, rstd = rms_norm_gated_forward(o, weight, gate, 1e-5)
    with_y = rms_norm_gated_backward(o, weight, gate, rstd, dy, output=True)
    without_y = rms_norm_gated_backward(o, weight, gate, rstd, dy)
    assert without_y[3] is None and torch.equal(with_y[3], y)
    for a, b in zip(with_y[:3], without_y[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_pair_equals_two_calls(dtype):
    """q and k normalised in one launch each way: bit for bit what two l2norm calls give, values and gradients
    (a zero row and a tiny one included, where the norm is clamped)."""
    from linattn.layers.norms_triton import l2norm_pair_triton, l2norm_triton

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 21, 3, 24, generator=gen) for _ in range(2))
    q[0, 0, 0], k[1, 2, 1] = 0.0, 1e-9
    q, k = q.to(DEVICE, dtype), k.to(DEVICE, dtype)
    pair, pair_grads = _grads(lambda a, b: torch.stack(l2norm_pair_triton(a, b, norms.L2_EPS)), q, k)
    two, two_grads = _grads(lambda a, b: torch.stack([l2norm_triton(a, norms.L2_EPS), l2norm_triton(b, norms.L2_EPS)]),
                            q, k)
    assert torch.equal(pair, two)
    for a, b in zip(pair_grads, two_grads):
        assert torch.equal(a, b)


def test_gate_with_beta_compiled_equals_eager():
    """Compiled autograd hands the empty dt output a gradient of zeros; the backward must not read it (it would
    read past it: an illegal address on a GPU)."""
    from linattn.layers.gates_triton import mamba_gate_beta_triton

    gen = torch.Generator().manual_seed(4)
    shapes = ((2, 9, 3), (2, 9, 3), (3,), (3,))
    leaves = [torch.randn(*s, generator=gen).to(DEVICE).requires_grad_(True) for s in shapes]

    def loss(a, b, a_log, dt_bias):
        g, beta = mamba_gate_beta_triton(a, a_log, dt_bias, b, torch.float32)
        return (g.square() * beta).sum()

    _assert_compiled_grads_equal_eager(loss, leaves)


@pytest.mark.parametrize("K", [16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_gate_keys_equals_reference(dtype, K):
    """g (in the activation dtype) and the keys scaled by dt from one launch: as PyTorch's decay and k dt, values
    and every gradient (A_log and dt_bias summed over tokens), with both outputs' gradients or only one."""
    from linattn.layers.gates_triton import mamba_gate_keys_triton

    gen = torch.Generator().manual_seed(0)
    a, k = 4 * torch.randn(3, 29, 5, generator=gen), torch.randn(3, 29, 5, K, generator=gen)
    a[0, 0] = 30.0  # past softplus's linear threshold
    a_log, dt_bias = torch.randn(5, generator=gen), torch.randn(5, generator=gen)

    def reference(a, k, a_log, dt_bias):
        dt = F.softplus(a.float() + dt_bias.float())
        return (-torch.exp(a_log.float()) * dt).to(dtype), (k.float() * dt[..., None]).to(dtype)

    def loss_of(fn, parts):
        def run(*ts):
            g, kd = fn(*ts)
            assert g.dtype == kd.dtype == dtype and kd.shape == k.shape
            weights = torch.linspace(-1, 1, K, device=kd.device)
            terms = {"g": g.float().square().sum(), "k": (kd.float() * weights).sum()}
            return sum(terms[p] for p in parts).reshape(1)
        return run

    ts = [a.to(DEVICE, dtype), k.to(DEVICE, dtype), a_log.to(DEVICE), dt_bias.to(DEVICE)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for parts in (("g", "k"), ("g",), ("k",)):
        out, grads = _grads(loss_of(lambda a, k, a_log, dt_bias: mamba_gate_keys_triton(a, a_log, dt_bias, k, dtype),
                                    parts), *ts)
        ref, ref_grads = _grads(loss_of(reference, parts), *ts)
        assert rel_rmse(out, ref) <= tol
        for name, x, y in zip(["a", "k", "A_log", "dt_bias"], grads, ref_grads):
            if y is None or not y.abs().max() > 0:  # k gets no gradient from g alone: the kernel writes zeros
                assert x is None or not x.abs().max() > 0, (parts, name)
                continue
            assert rel_rmse(x.float(), y.float()) <= tol, (parts, name)


def test_mamba_gate_keys_checks_shapes_and_compiles():
    """k must be a's shape plus a key dim (named error before any launch); compiled equals eager."""
    from linattn.layers.gates_triton import mamba_gate_keys_triton

    gen = torch.Generator().manual_seed(4)
    a, k = torch.randn(2, 9, 3, generator=gen).to(DEVICE), torch.randn(2, 9, 3, 8, generator=gen).to(DEVICE)
    a_log, dt_bias = torch.randn(3, generator=gen).to(DEVICE), torch.randn(3, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match=r"k must be shaped like a with a trailing key dim"):
        mamba_gate_keys_triton(a, a_log, dt_bias, k[:, :, :2], torch.float32)
    leaves = [t.requires_grad_(True) for t in (a, k, a_log, dt_bias)]

    def loss(a, k, a_log, dt_bias):
        g, kd = mamba_gate_keys_triton(a, a_log, dt_bias, k, torch.float32)
        return (g.square()[..., None] * kd).sum()

    _assert_compiled_grads_equal_eager(loss, leaves)


@pytest.mark.parametrize("K", [16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_keys_equals_reference(dtype, K):
    """Comba's read key sigmoid(d) ⊙ k from one launch: as PyTorch's, value and the gradients of k and d (d's summed
    over every token)."""
    from linattn.layers.read_keys_triton import read_keys_triton

    gen = torch.Generator().manual_seed(0)
    k, d = torch.randn(2, 37, 3, K, generator=gen), 2 * torch.randn(3, K, generator=gen)
    ts = [k.to(DEVICE, dtype), d.to(DEVICE)]
    out, grads = _grads(read_keys_triton, *ts)
    ref, ref_grads = _grads(lambda k, d: (torch.sigmoid(d.float()) * k.float()).to(dtype), *ts)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and rel_rmse(out.float(), ref.float()) <= tol
    for name, x, y in zip(["k", "d"], grads, ref_grads):
        assert rel_rmse(x.float(), y.float()) <= tol, name


def test_read_keys_checks_shapes_and_compiles():
    """k must end in d's [H, K] (named error before any launch); compiled equals eager."""
    from linattn.layers.read_keys_triton import read_keys_triton

    gen = torch.Generator().manual_seed(5)
    k, d = torch.randn(2, 9, 3, 8, generator=gen).to(DEVICE), torch.randn(3, 8, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match=r"k must be \[\.\.\., H, K\] with d \[H, K\] = \[3, 8\]"):
        read_keys_triton(k[..., :4], d)
    leaves = [t.requires_grad_(True) for t in (k, d)]

    def loss(k, d):
        return (read_keys_triton(k, d) * k).sum()

    _assert_compiled_grads_equal_eager(loss, leaves)


@pytest.mark.parametrize("mixer, module, name", [("mamba2", "gates_triton", "mamba_gate_keys_triton"),
                                                 ("comba", "read_keys_triton", "read_keys_triton")])
def test_layers_take_their_fused_kernels(mixer, module, name, monkeypatch):
    """On the fused backend Mamba2's layer makes its decay and keys, and Comba's its read key, with the fused kernels
    (the layer tests above would pass on the PyTorch path too)."""
    import importlib

    from linattn.layers.registry import build_mixer

    kernels = importlib.import_module(f"linattn.layers.{module}")
    real, calls = getattr(kernels, name), []
    monkeypatch.setattr(kernels, name, lambda *args: calls.append(name) or real(*args))
    layer = build_mixer(mixer, 32, 2, backend="chunk", chunk_size=16).to(DEVICE)
    with linattn.settings(fused_backend="triton", shortconv_backend="muladd"):
        layer(torch.randn(1, 5, 32, device=DEVICE), use_cache=False)
    assert calls == [name]
