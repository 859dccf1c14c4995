"""ShortConv: causal depthwise conv, cache continuation, the fixed shift and identity controls, checks."""

import pytest
import torch
import torch.nn.functional as F

from linattn.layers import ShortConv
from linattn.testing import assert_close


def test_learned_matches_explicit_sum_and_is_causal():
    torch.manual_seed(0)
    conv = ShortConv(3, kernel_size=4)
    x = torch.randn(2, 9, 3, dtype=torch.float64)
    y, _ = conv.double()(x)
    w = conv.weight[:, 0]  # [D, W]
    xp = F.pad(x, (0, 0, 3, 0))
    expected = F.silu(sum(w[:, i] * xp[:, i:i + 9] for i in range(4)))
    assert_close(y, expected, 1e-12, "conv")
    x2 = x.clone()
    x2[:, 5:] += 1.0
    assert torch.equal(conv(x2)[0][:, :5], y[:, :5]), "output before t=5 changed with inputs after it"


@pytest.mark.parametrize("mode", ["learned", "shift", "identity"])
@pytest.mark.parametrize("activation", ["silu", None])
def test_cache_continuation_equals_full(mode, activation):
    torch.manual_seed(1)
    conv = ShortConv(5, kernel_size=4, activation=activation, mode=mode)
    x = torch.randn(2, 10, 5)
    y, last = conv(x)
    y1, cache = conv(x[:, :2])  # prefill shorter than the kernel
    ys = [y1]
    for t in range(2, 10):
        yt, cache = conv(x[:, t:t + 1], cache)
        ys.append(yt)
    assert_close(torch.cat(ys, 1), y, 1e-6, f"{mode} steps")
    assert torch.equal(cache, last) and torch.equal(last, x[:, -3:])


def test_shift_outputs_previous_input_and_identity_only_activates():
    x = torch.randn(2, 7, 4)
    y, _ = ShortConv(4, mode="shift")(x)
    assert torch.equal(y[:, 1:], x[:, :-1]) and torch.equal(y[:, 0], torch.zeros(2, 4))
    y, _ = ShortConv(4, mode="identity")(x)
    assert torch.equal(y, F.silu(x))
    y, _ = ShortConv(4, mode="identity", activation=None)(x)
    assert torch.equal(y, x)
    assert len(list(ShortConv(4, mode="shift").parameters())) == 0
    assert len(list(ShortConv(4, mode="learned", bias=True).parameters())) == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="conv_mode must be one of 'learned', 'shift', 'identity'"):
        ShortConv(4, mode="shifted")
    with pytest.raises(ValueError, match="activation must be one of"):
        ShortConv(4, activation="gelu")
    with pytest.raises(ValueError, match="kernel_size"):
        ShortConv(4, kernel_size=0)
    conv = ShortConv(4)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, D\] with D = 4"):
        conv(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="cache must have shape"):
        conv(torch.randn(2, 3, 4), torch.zeros(2, 2, 4))


@pytest.mark.skipif("LINATTN_SHORTCONV_BACKEND" in __import__("os").environ,
                    reason="LINATTN_SHORTCONV_BACKEND sets another default")
def test_auto_is_the_default_and_uses_the_multiply_adds_on_cpu(monkeypatch):
    import linattn

    assert ShortConv(4).backend is None and linattn.current().shortconv_backend == "auto", "follows the setting"
    reference = ShortConv(4)
    reference.backend = "muladd"
    x = torch.randn(2, 6, 4)
    want, want_cache = reference(x)

    def other_backend(self, x, cache, backend):
        raise AssertionError(f"the {backend!r} backend ran")

    monkeypatch.setattr(ShortConv, "_forward_backend", other_backend)
    conv = ShortConv(4)
    conv.load_state_dict(reference.state_dict())
    y, cache = conv(x)
    assert torch.equal(y, want) and torch.equal(cache, want_cache)
    conv.backend = "conv1d"  # the patched method is the one a non-muladd backend goes through
    with pytest.raises(AssertionError, match="the 'conv1d' backend ran"):
        conv(x)


def test_invalid_backend_name_raises():
    from linattn.layers import set_shortconv_backend

    conv = ShortConv(4)
    conv.backend = "fft"
    with pytest.raises(ValueError, match="ShortConv.backend must be one of 'auto', 'muladd', 'conv1d', 'triton'; "
                                         "got 'fft'"):
        conv(torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="backend must be one of .* got 'fft'"):
        set_shortconv_backend(torch.nn.Sequential(ShortConv(4)), "fft")
