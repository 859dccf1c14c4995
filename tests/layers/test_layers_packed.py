"""Every op-backed mixer layer over packed sequences (cu_seqlens): the outputs and gradients of running each
sequence alone (positions and RoPE restarting, ShortConvs resetting), and bad packed calls refused by name."""

from __future__ import annotations

import pytest
import torch

from linattn.layers import build_mixer, list_mixers, mixer_class
from linattn.layers.base import MixerLayer
from linattn.layers.cache import LayerCache
from linattn.ops.common.positions import apply_rope
from linattn.testing import assert_same_gradients

D, H = 16, 2
LENGTHS = (3, 1, 18, 5)  # the layers' chunk_size 16: shorter and longer than a chunk, one token
CU = torch.tensor([0, 3, 4, 22, 27], dtype=torch.int32)
MIXERS = [name for name in list_mixers() if issubclass(mixer_class(name), MixerLayer)]


def _layer(name: str, **kwargs: object) -> MixerLayer:
    torch.manual_seed(0)
    letters = getattr(mixer_class(name), "conv_letters", "qkv")
    return build_mixer(name, D, H, short_conv=letters, chunk_size=16, **kwargs)


@pytest.mark.parametrize("name", MIXERS)
def test_packed_layer_equals_separate(name: str) -> None:
    layer = _layer(name)
    x = torch.randn(1, sum(LENGTHS), D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y, cache = layer(x, cu_seqlens=CU)
    assert cache is None
    y_ref = torch.cat([layer(x[:, s:e], use_cache=False)[0]
                       for s, e in zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True)], dim=1)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)

    w = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    assert_same_gradients((y * w).sum(), (y_ref * w).sum(), [x, *layer.parameters()], rtol=1e-5, atol=1e-5)


def test_positions_restart_in_every_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """mix_inputs (where RoPE is applied) sees every token's position inside its own sequence."""
    layer = _layer("retention")
    seen = []
    original = type(layer).mix_inputs

    def spy(self, x, q, k, v, offset, streams):
        seen.append(offset)
        return original(self, x, q, k, v, offset, streams)

    monkeypatch.setattr(type(layer), "mix_inputs", spy)
    layer(torch.randn(1, 27, D), cu_seqlens=CU)
    expected = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    assert torch.equal(seen[0], expected)


def test_rope_at_packed_positions_equals_rope_per_sequence() -> None:
    x = torch.randn(1, 27, H, 8)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    expected = torch.cat([apply_rope(x[:, s:e]) for s, e in zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True)],
                         dim=1)
    torch.testing.assert_close(apply_rope(x, positions), expected, rtol=0, atol=0)
    assert not torch.equal(apply_rope(x), expected), "the positions matter"


def test_bad_packed_calls_are_named() -> None:
    layer = _layer("gated_delta_rule")
    with pytest.raises(ValueError, match=r"x must have batch size B = 1 with cu_seqlens"):
        layer(torch.randn(2, 27, D), cu_seqlens=CU)
    with pytest.raises(ValueError, match=r"cu_seqlens must end at the packed length T = 26, got 27"):
        layer(torch.randn(1, 26, D), cu_seqlens=CU)
    with pytest.raises(TypeError, match=r"cu_seqlens must have dtype int32 or int64"):
        layer(torch.randn(1, 27, D), cu_seqlens=CU.double())
    _, cache = layer(torch.randn(1, 3, D))
    assert isinstance(cache, LayerCache)
    with pytest.raises(ValueError, match=r"cache must be None with cu_seqlens"):
        layer(torch.randn(1, 27, D), cache, cu_seqlens=CU)


TRITON_NATIVE = ["gated_delta_rule", "gla", "mamba2", "comba"]


@pytest.mark.triton
@pytest.mark.parametrize("conv", ["conv1d", "triton"])
@pytest.mark.parametrize("name", TRITON_NATIVE)
def test_packed_layer_on_the_triton_kernels_equals_separate(name: str, conv: str, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The ops' Triton kernels run the packed sequences in one call (the chunk-aligned layout), the ShortConvs in
    one conv1d call (a gap before every sequence) or one Triton op over the joint projection (every tap kept inside
    its token's sequence): the outputs and gradients of separate calls."""
    import linattn
    from linattn.ops.common.triton_compat import triton_available

    if not triton_available():
        pytest.skip("triton not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: under the interpreter (tests/conftest.py)
    layer = _layer(name).to(device)
    x = torch.randn(1, sum(LENGTHS), D, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    calls = []
    if conv == "triton":  # the layer's ShortConvs run as one op over the joint projection, packed too
        from linattn.layers import shortconv_joint

        def counted(*args, **kwargs):
            calls.append(kwargs.get("pos", args[6] if len(args) > 6 else None))
            return conv_streams(*args, **kwargs)

        conv_streams = shortconv_joint.conv_streams
        monkeypatch.setattr(shortconv_joint, "conv_streams", counted)
    with linattn.settings(op_backend="triton", shortconv_backend=conv):
        y, _ = layer(x, cu_seqlens=CU)
        if conv == "triton":
            assert len(calls) == 1 and calls[0] is not None, "the packed call did not convolve jointly"
        y_ref = torch.cat([layer(x[:, s:e], use_cache=False)[0]
                           for s, e in zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True)], dim=1)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        w = torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape)
        assert_same_gradients((y * w).sum(), (y_ref * w).sum(), [x, *layer.parameters()], rtol=1e-5, atol=1e-5)
