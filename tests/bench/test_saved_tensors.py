"""bench/saved_tensors: what one forward keeps for the backward pass, per module, storages counted once."""

import pytest
import torch
from torch import nn

from linattn.bench import saved_tensors as st

pytestmark = pytest.mark.usefixtures("one_thread")

# The audit runs on the CPU. Without a GPU, Triton's interpreter is on (tests/conftest.py) and the backends a CUDA run
# picks are forced, as the bench does by default; with one, the interpreter stays off for the other tests' CUDA kernels
# (kernels so defined take no CPU tensors), and the CPU's PyTorch paths run instead.
BACKEND = "auto" if torch.cuda.is_available() else "triton"
TINY = dict(d_model=32, n_layers=2, n_heads=2, vocab=64, batch=2, seq=32, backend=BACKEND)


class Twice(nn.Module):
    """Saves its input twice (two muls) and a view of it once: one storage."""

    def forward(self, x):
        return x * x + x[:, :2].sin().sum()


def test_storages_counted_once_per_module_and_weights_apart():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), Twice())
    x = torch.randn(3, 4, requires_grad=True)
    saved = st.record_saved(model, lambda: model(x))
    acts = [s for s in saved if not s.weight]
    by_module = {s.module: s for s in acts}
    # Linear saves its input x (3 x 4 float32); Twice saves the Linear's output once, though three ops keep it
    assert by_module["0"].nbytes == 3 * 4 * 4
    assert [s.nbytes for s in acts if s.module == "1"] == [3 * 6 * 4]
    assert any(s.weight for s in saved)  # the Linear's weight, kept by its matmul
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = st.record_saved(model, lambda: model(x))
    weights = [s for s in saved if s.weight]
    assert weights and all(s.dtype == torch.bfloat16 for s in weights)  # autocast's copy of the weight


def test_audit_breaks_a_layer_down_and_compares_with_the_transformer(capsys):
    audits = [st.audit(m, **TINY) for m in ("softmax_attn", "gated_delta_rule")]
    ref, gdr = audits
    assert (ref.backend, gdr.backend) == (("parallel", "triton") if BACKEND == "triton" else ("auto", "auto"))
    rows = gdr.per_layer()
    if BACKEND == "triton":  # the layer runs its ShortConvs as one op, which keeps the joint projection's output
        assert ("mixer", "bfloat16") in rows and not any(m.startswith("mixer.convs") for m, _ in rows)
    else:  # each ShortConv keeps its input, a slice of the joint projection's output
        assert ("mixer.convs.q", "bfloat16") in rows
    assert gdr.block_bytes() == pytest.approx(sum(rows.values()) * TINY["n_layers"])
    assert gdr.activation_bytes == gdr.block_bytes() + gdr.outside_blocks()
    text = st.report(audits, top=3, detail=True)
    assert "gated_delta_rule" in text and "ratio" in text and "storages of block 0" in text
    assert st.main(["--mixers", "softmax_attn,delta_rule", "--d-model", "32", "--heads", "2", "--vocab", "64",
                    "--seq", "32", "--backend", BACKEND, "--json"]) == 0
    assert '"mixer": "delta_rule"' in capsys.readouterr().out


def test_step_peak_counts_what_is_alive_at_once():
    """The tracker's count: a tensor made and dropped leaves nothing; two alive at once peak at their sum; the
    parameters are not counted."""
    mode = st.LiveBytes(set(), [])
    with mode:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2
        del b
        c = a[:10] + 1  # a new 40-byte storage next to a
        del a, c
    assert mode.peak == 8000 and mode.now == 0
    peak, at = st.step_peak("gated_delta_rule", **TINY)
    saved = st.audit("gated_delta_rule", **TINY)
    assert peak > saved.activation_bytes and at.split()[0] in ("forward", "backward")


def test_compiled_saved_counts_activations_only():
    """What the compiled forward graph keeps grows with the batch exactly, so no weight (nor autocast's copy of one)
    is counted."""
    shape = {**TINY, "batch": 1}
    one = st.compiled_saved("gated_delta_rule", **shape)
    two = st.compiled_saved("gated_delta_rule", **{**shape, "batch": 2})
    assert one > 0 and two == 2 * one, (one, two)
