"""A NaN or inf in any per-token input at position t stays where causality puts it, on every backend of every op:
outputs before t are finite and equal (to the float32 tolerance) to the recurrent backend's outputs on the clean
input, and some output at or after t is not finite (the bad value is not hidden either). Position t is taken in
the middle of a chunk and at a chunk start. Range checks are off (as in the layers, and on CUDA by default): with
them on, a NaN gate or beta is refused before any compute instead."""

from __future__ import annotations

import math

import pytest
import torch

from linattn.ops import get_op, list_ops
from linattn.ops.common.masking import sees_nonfinite, tril_matmul
from linattn.ops.common.values import value_checks
from linattn.testing import assert_close

B, T, H, K, V = 1, 40, 2, 8, 8
CHUNK = 16
POSITIONS = (21, 32)  # inside the second chunk; the first token of the third
BAD = (math.nan, math.inf)
TOL = 1e-5
OPS = list_ops()
pytestmark = pytest.mark.usefixtures("one_thread")
TORCH_CASES = [(name, b) for name in OPS for b in get_op(name).backends if b != "triton"]
TRITON_CASES = [(name, "triton") for name in OPS if "triton" in get_op(name).backends]
# options that take other code paths than the defaults
VARIANTS = {
    "ttt_linear": [{}, {"mini_batch_size": 8}, {"mini_batch_size": 8, "inner_norm": True}],
    "titans": [{}, {"mini_batch_size": 8}],
    "softmax_attn": [{}, {"window_size": 8}, {"alibi": True}],
}


def _inputs(name: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    x = get_op(name).example_inputs(B, T, H, K, V, seed=0)
    return {a: t.to(device) if isinstance(t, torch.Tensor) else t for a, t in x.items()}


def _per_token(x: dict[str, object]) -> list[str]:
    """The arguments with a time axis: [B, T, ...], or [B, n T, ...] for sub-steps (gated_delta_product)."""
    return [a for a, t in x.items() if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] % T == 0]


def _spoil(x: dict[str, torch.Tensor], arg: str, t: int, value: float) -> dict[str, torch.Tensor]:
    """``x`` with ``arg`` at token t set to ``value`` (the first sub-step of token t for sub-step inputs)."""
    bad = x[arg].clone()
    bad[:, t * (bad.shape[1] // T)] = value
    return {**x, arg: bad}


def _run(name: str, backend: str, x: dict[str, torch.Tensor], options: dict) -> torch.Tensor:
    with value_checks("off"):
        return get_op(name).fn(**x, **options, backend=backend, chunk_size=CHUNK)[0]


def _check(name: str, backend: str, options: dict, positions=POSITIONS, bad_values=BAD) -> None:
    # Triton kernels run on the GPU where there is one (else under the interpreter, tests/conftest.py)
    x = _inputs(name, "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    reference = _run(name, "recurrent", x, options)
    for arg in _per_token(x):
        for t in positions:
            for value in bad_values:
                o = _run(name, backend, _spoil(x, arg, t, value), options)
                what = f"{name} {backend} {options}: {arg}[{t}] = {value}"
                assert torch.isfinite(o[:, :t]).all(), f"{what}: an output before {t} is not finite"
                assert_close(o[:, :t], reference[:, :t], TOL, f"{what}: outputs before {t}")
                assert not torch.isfinite(o[:, t:]).all(), f"{what}: no output at or after {t} shows it"


@pytest.mark.parametrize("name,backend", TORCH_CASES)
def test_nonfinite_input_stays_after_its_position(name: str, backend: str) -> None:
    # the token loops of "recurrent" read no later token by construction: one case each keeps them checked
    cases = {"positions": (21,), "bad_values": (math.nan,)} if backend == "recurrent" else {}
    for options in VARIANTS.get(name, [{}]):
        _check(name, backend, options, **cases)


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NumPy on NaN
@pytest.mark.parametrize("name,backend", TRITON_CASES)
def test_nonfinite_input_stays_after_its_position_triton(name: str, backend: str) -> None:
    pytest.importorskip("triton")
    _check(name, backend, {}, positions=(21,), bad_values=(math.nan,))
    _check(name, backend, {}, positions=(32,), bad_values=(math.inf,))


@pytest.mark.parametrize("backend", get_op("softmax_attn").backends)
def test_a_window_forgets_a_nonfinite_value(backend: str) -> None:
    """With a sliding window of w, the queries at t + w and later no longer see position t: finite again."""
    x = _inputs("softmax_attn")
    w, t = 8, 21
    reference = _run("softmax_attn", "recurrent", x, {"window_size": w})
    for arg in ("k", "v"):
        o = _run("softmax_attn", backend, _spoil(x, arg, t, math.nan), {"window_size": w})
        assert not torch.isfinite(o[:, t: t + w]).all(dim=-1).any(), f"{backend}: {arg} inside the window"
        assert_close(o[:, t + w:], reference[:, t + w:], TOL, f"{backend}: {arg}: after the window")


def test_tril_matmul_reads_only_earlier_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(3, 12, 12, generator=gen).tril()
    X = torch.randn(3, 12, 5, generator=gen)
    assert torch.equal(tril_matmul(A, X), A @ X)
    X[:, 7, 2], X[:, 9, 4] = math.nan, -math.inf
    out = tril_matmul(A, X)
    # the product of the leading block alone may round differently (another BLAS blocking): 1e-6, not bit-equal
    torch.testing.assert_close(out[:, :7], A[:, :7, :7] @ X[:, :7], rtol=1e-6, atol=1e-6)
    assert torch.isnan(out[:, 7:, 2]).all() and not torch.isfinite(out[:, 9:, 4]).any()
    assert torch.isfinite(out[:, :, [0, 1, 3]]).all()  # other columns untouched


def test_sees_nonfinite_follows_the_visibility_mask() -> None:
    from linattn.ops.common.positions import visibility_mask

    bad = torch.zeros(2, 30, dtype=torch.bool)
    bad[0, 11], bad[1, 3] = True, True
    for Tq in (30, 7):
        for causal in (True, False):
            for window in (None, 1, 5):
                visible = visibility_mask(torch.arange(30 - Tq, 30), torch.arange(30), causal=causal,
                                          window_size=window)
                expected = (visible[None] & bad[:, None, :]).any(-1)
                got = sees_nonfinite(bad, Tq, causal=causal, window_size=window)
                assert torch.equal(got, expected), (Tq, causal, window)


@pytest.mark.parametrize("name,backend", [(n, b) for n, b in TORCH_CASES if b != "recurrent"])
def test_branch_free_forms_equal_the_plain_products(name: str, backend: str, monkeypatch) -> None:
    """On CUDA (and under torch.compile) the guarded products always take their branch-free form; on finite inputs
    it must give the plain products' result. Forced here on the CPU."""
    import sys

    x = _inputs(name)
    plain = _run(name, backend, x, {})
    for module in [m for key, m in sys.modules.items() if key.startswith("linattn.ops")]:
        if hasattr(module, "all_finite_here"):
            monkeypatch.setattr(module, "all_finite_here", lambda *xs: False)
    assert_close(_run(name, backend, x, {}), plain, 1e-6, f"{name} {backend}: branch-free vs plain")


def _fused_guard_on_cpu(monkeypatch) -> None:
    """Route softmax attention's guard to the fused Triton kernels on the CPU (interpreter), as on eager CUDA."""
    import importlib

    core = importlib.import_module("linattn.ops.softmax_attn.core")
    monkeypatch.setattr(core, "attention_guard_skipped", lambda *xs: False)
    monkeypatch.setattr(core, "fused_guard_applies", lambda keys, window_size: window_size is None)


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", [b for b in get_op("softmax_attn").backends if b != "recurrent"])
def test_fused_attention_guard_confines(backend: str, monkeypatch) -> None:
    """The guard of eager CUDA (two fused kernels around SDPA) confines like the PyTorch guard: causal and not,
    grouped kv heads, and queries after a cache of earlier keys."""
    pytest.importorskip("triton")
    _fused_guard_on_cpu(monkeypatch)
    _check("softmax_attn", backend, {}, positions=(21, 32), bad_values=(math.nan, math.inf))
    x = _inputs("softmax_attn")
    grouped = {**x, "k": x["k"][:, :, :1], "v": x["v"][:, :, :1]}  # 2 query heads read 1 kv head
    reference = _run("softmax_attn", "recurrent", grouped, {})
    for arg in ("k", "v"):
        o = _run("softmax_attn", backend, _spoil(grouped, arg, 21, math.nan), {})
        assert_close(o[:, :21], reference[:, :21], TOL, f"grouped {arg}: before 21")
        assert not torch.isfinite(o[:, 21:]).all(dim=-1).any(), f"grouped {arg}: every query head at and after 21"
        o = _run("softmax_attn", backend, _spoil(x, arg, 21, math.nan), {"causal": False})
        assert torch.isnan(o).all(), f"not causal, {arg}: every query sees position 21"
    # continued from a cache of the first 16 tokens: the bad key at 21 is the 6th query's own
    spoiled = _spoil(x, "k", 21, math.nan)
    first = {a: t[:, :16] for a, t in spoiled.items()}
    rest = {a: t[:, 16:] for a, t in spoiled.items()}
    with value_checks("off"):
        _, cache = get_op("softmax_attn").fn(**first, backend=backend, chunk_size=CHUNK, output_final_state=True)
        o = get_op("softmax_attn").fn(**rest, backend=backend, chunk_size=CHUNK, initial_state=cache)[0]
    assert_close(o[:, :5], reference_cached := _run("softmax_attn", "recurrent", x, {})[:, 16:21], TOL, "cached")
    assert reference_cached.shape[1] == 5 and not torch.isfinite(o[:, 5:]).all(dim=-1).any()


@pytest.mark.triton
def test_fused_attention_guard_is_exact_on_finite_input(monkeypatch) -> None:
    """On finite inputs the fused guard changes nothing: outputs and gradients equal the plain call's."""
    pytest.importorskip("triton")
    x = {a: t.requires_grad_() if t.is_floating_point() else t for a, t in _inputs("softmax_attn").items()}
    plain = _run("softmax_attn", "parallel", x, {})
    grads = torch.autograd.grad(plain.square().sum(), [x["q"], x["k"], x["v"]])
    _fused_guard_on_cpu(monkeypatch)
    guarded = _run("softmax_attn", "parallel", x, {})
    assert torch.equal(guarded, plain)
    for a, b in zip(torch.autograd.grad(guarded.square().sum(), [x["q"], x["k"], x["v"]]), grads):
        assert torch.equal(a, b)
