"""Helpers for testing ops against each other (used by the test suite; handy for users' own ops)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|: the relative error used for float32/float64 agreement.

    Where the reference is identically zero (e.g. the gradient of a gate that has nothing to decay)
    the error is absolute, since the inputs of the tests are of order one."""
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    scale = e.abs().max()
    return float((a - e).abs().max() / (scale if scale > 0 else 1.0))


def rel_rmse(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e||_2 / ||e||_2: the relative RMSE used for bf16/fp16 agreement."""
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str, metric: str = "rel") -> None:
    """Assert ``metric`` ("rel" or "rmse") of actual vs expected is <= tol, naming ``what`` on failure."""
    err = rel_err(actual, expected) if metric == "rel" else rel_rmse(actual, expected)
    assert err <= tol, f"{what}: {metric} error {err:.3e} > {tol:.1e}"


def randn(*shape: int, dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard normal tensor made in float64 then cast (the same numbers for every dtype)."""
    return torch.randn(*shape, dtype=torch.float64, generator=generator).to(dtype)


def log_gate(*shape: int, dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None,
             low: float = -0.5) -> torch.Tensor:
    """Log decays g in [low, 0) (decays exp(g) in [exp(low), 1))."""
    u = torch.rand(*shape, dtype=torch.float64, generator=generator)
    return (low * u).to(dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """Normalise the last dim to unit length (delta-rule keys)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def grads(fn: Callable[..., Sequence[torch.Tensor | None]], inputs: Sequence[torch.Tensor | None],
          seed: int = 0) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Run ``fn(*leaves)`` on fresh leaf copies of ``inputs``; backprop a fixed random cotangent
    through every tensor output; return (outputs, gradients of every input (None for None inputs))."""
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in inputs]
    outs = [o for o in fn(*leaves) if o is not None]
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, dtype=torch.float64, generator=gen).to(o.device)).sum()
               for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [None if x is None else x.grad for x in leaves]


def check_backends_agree(
    fn: Callable[..., Sequence[torch.Tensor | None]],
    inputs: Sequence[torch.Tensor | None],
    names: Sequence[str],
    backends: Sequence[str],
    reference: str = "recurrent",
    tol: float = 1e-5,
    grad_tol: float | None = None,
    metric: str = "rel",
) -> None:
    """Compare ``fn(*inputs, backend=b)`` for every b in ``backends`` with the ``reference`` backend:
    every output and the gradient of every input named in ``names`` (None inputs skipped).
    Float32 agreement uses metric "rel" (max error / max value); bf16/fp16 use "rmse"."""
    grad_tol = tol if grad_tol is None else grad_tol
    ref_out, ref_grad = grads(lambda *xs: fn(*xs, backend=reference), inputs)
    for b in backends:
        if b == reference:
            continue
        out, grad = grads(lambda *xs, b=b: fn(*xs, backend=b), inputs)
        assert len(out) == len(ref_out), f"{b}: {len(out)} outputs vs {len(ref_out)} for {reference}"
        for i, (a, e) in enumerate(zip(out, ref_out)):
            assert_close(a, e, tol, f"{b} vs {reference}: output {i}", metric)
        for name, a, e in zip(names, grad, ref_grad):
            if e is not None:
                assert a is not None, f"{b}: no gradient for {name}"
                assert_close(a, e, grad_tol, f"{b} vs {reference}: grad of {name}", metric)


def check_half_against_float32(
    fn: Callable[..., Sequence[torch.Tensor | None]],
    inputs: Sequence[torch.Tensor | None],
    names: Sequence[str],
    backend: str = "triton",
    reference: str = "recurrent",
    tol: float = 5e-3,
    grad_tol: float = 1e-2,
) -> None:
    """``fn(*inputs, backend=backend)`` on half-precision ``inputs`` against ``reference`` on their float32 copies:
    the first output keeps the inputs' dtype; every output within ``tol`` and the gradient of every input named in
    ``names`` within ``grad_tol`` (relative RMSE; None inputs skipped)."""
    ref_out, ref_grad = grads(lambda *xs: fn(*xs, backend=reference),
                              [None if x is None else x.float() for x in inputs])
    out, grad = grads(lambda *xs: fn(*xs, backend=backend), inputs)
    dtype = next(x.dtype for x in inputs if x is not None)
    assert out[0].dtype == dtype, f"{backend}: output in {out[0].dtype}, inputs in {dtype}"
    for i, (a, e) in enumerate(zip(out, ref_out)):
        assert_close(a, e, tol, f"{dtype} output {i}", metric="rmse")
    for name, a, e in zip(names, grad, ref_grad):
        if e is not None:
            assert_close(a, e, grad_tol, f"{dtype} grad of {name}", metric="rmse")


def step_inputs(name: str, B: int, H: int, K: int, V: int) -> dict[str, torch.Tensor]:
    """Tensors for op ``name``'s step function by parameter name (the op's names), from the op's ``example_inputs``
    at T = 1: a per-token input [B, 1, ...] is cut to its token [B, ...] (sub-step inputs such as
    gated_delta_product's k [B, n, H, K] keep their n); constants (mesa_net's lamb [H, K]) are passed whole;
    ``state`` is left out."""
    import inspect

    from linattn.ops import get_op

    spec = get_op(name)
    x = spec.example_inputs(B, 1, H, K, V)
    out = {}
    for p in inspect.signature(spec.step).parameters:
        if p != "state" and p in x:
            t = x[p]
            out[p] = t[:, 0] if t.dim() >= 3 and t.shape[1] == 1 else t
    return out


def assert_same_gradients(loss: torch.Tensor, reference_loss: torch.Tensor, leaves: Sequence[torch.Tensor],
                          rtol: float, atol: float) -> None:
    """The gradients of ``loss`` and ``reference_loss`` with respect to ``leaves`` agree (both None where a leaf is
    not used), within ``torch.testing.assert_close``'s rtol and atol."""
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    want = torch.autograd.grad(reference_loss, leaves, allow_unused=True)
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (r is None), f"leaf {i}: gradient {'missing' if g is None else 'unexpected'}"
        if g is not None:
            torch.testing.assert_close(g, r, rtol=rtol, atol=atol, msg=lambda m, i=i: f"leaf {i}: {m}")
