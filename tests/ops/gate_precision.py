"""The gates' gradient of a gated op in bf16 against the float32 reference, beside its other gradients (shared by
the Triton ops' tests; use with the ``gpu_dot_rounding`` fixture so that the CPU multiplies as a GPU does)."""

import torch

from linattn.bench.accuracy import measure


def gates_gradient_ratio(op: str, gate: str = "g", T: int = 1024, K: int = 32, launch: dict | None = None) -> float:
    """bf16 inputs, B = H = 1, K = V: the relative RMS error of ``gate``'s gradient over the largest of the other
    gradients' and the output's, for the triton backend (under the ``triton_launch`` setting ``launch``)."""
    errors = measure(op, [] if launch else ["triton"], B=1, T=T, H=1, K=K, V=K, dtype=torch.bfloat16,
                     device="cuda" if torch.cuda.is_available() else "cpu",
                     launches=[launch] if launch else None)["rows"][0]["errors"]
    return errors[gate] / max(e for name, e in errors.items() if name != gate)


def assert_gates_gradient_like_the_others(op: str, gate: str = "g", factor: float = 1.5, **kwargs) -> None:
    """The gates' gradient within ``factor`` times the other errors (:func:`gates_gradient_ratio`). A gates' gradient
    summed over the whole sequence (one reverse sum of q . dq - k . dk, whose terms cancel) drifts far past them with
    tf32 products; summed within chunks with the chunk ends' state terms it stays with them."""
    ratio = gates_gradient_ratio(op, gate, **kwargs)
    assert ratio <= factor, f"{op}: {gate}'s gradient {ratio:.2f}x the other errors"
