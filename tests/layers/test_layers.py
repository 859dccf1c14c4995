"""Every mixer layer: prefill + single-token steps == one full forward (every conv mode), gradients reach
every parameter, tie_kv really feeds v = k, and bad arguments raise ValueError listing the choices."""

import pytest
import torch

from linattn.layers import build_mixer, list_mixers, mixer_class
from linattn.testing import assert_close

D, H, B, T1, T2 = 32, 4, 2, 7, 5


def conv_letters(name):
    return getattr(mixer_class(name), "conv_letters", "qkv")


def run_prefill_then_steps(layer, x, t1):
    y1, cache = layer(x[:, :t1])
    ys = [y1]
    for t in range(t1, x.shape[1]):
        yt, cache = layer(x[:, t:t + 1], cache)
        ys.append(yt)
    return torch.cat(ys, 1), cache


@pytest.mark.parametrize("name", list_mixers())
@pytest.mark.parametrize("conv_mode", ["learned", "shift", "identity"])
def test_prefill_then_steps_equals_full(name, conv_mode):
    torch.manual_seed(0)
    layer = build_mixer(name, D, H, short_conv=conv_letters(name), conv_mode=conv_mode)
    x = torch.randn(B, T1 + T2, D)
    with torch.no_grad():
        y, full_cache = layer(x)
        y_steps, cache = run_prefill_then_steps(layer, x, T1)
        assert_close(y_steps, y, 1e-5, f"{name} {conv_mode}: prefill {T1} + {T2} steps vs full")
        # a second prefill continuing from a cache (T > 1 with a cache) also agrees
        y_a, c = layer(x[:, :3])
        y_b, _ = layer(x[:, 3:], c)
        assert_close(torch.cat([y_a, y_b], 1), y, 1e-5, f"{name} {conv_mode}: two prefills vs full")
    assert cache.offset == full_cache.offset == T1 + T2


@pytest.mark.parametrize("name", list_mixers())
def test_default_layer_steps_and_gradients(name):
    torch.manual_seed(1)
    layer = build_mixer(name, D, H)
    x = torch.randn(B, T1 + T2, D, requires_grad=True)
    y, _ = layer(x)
    with torch.no_grad():
        y_steps, _ = run_prefill_then_steps(layer, x, 1)
    assert_close(y_steps, y, 1e-5, f"{name}: 1 + {T1 + T2 - 1} steps vs full")
    (y * torch.randn_like(y)).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for pname, p in layer.named_parameters():
        assert p.grad is not None, f"{name}: no gradient reaches {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"
        assert p.grad.abs().sum() > 0, f"{name}: zero gradient for {pname}"


@pytest.mark.parametrize("name", [n for n in list_mixers() if "k" in conv_letters(n)])
def test_tie_kv_feeds_v_equal_k(name):
    torch.manual_seed(2)
    kw = dict(head_dim=D // H, head_dim_v=D // H, short_conv="k")
    tied = build_mixer(name, D, H, tie_kv=True, **kw)
    untied = build_mixer(name, D, H, **kw)
    state = tied.state_dict()
    state["v_proj.weight"] = state["k_proj.weight"].clone()
    untied.load_state_dict(state)
    assert not any(n.startswith("v_proj") for n, _ in tied.named_parameters())
    x = torch.randn(B, 9, D)
    with torch.no_grad():
        s, _ = tied.streams(x, None)
        assert torch.equal(s["v"], tied.k_proj(x)), "tie_kv: v is not k's projection"
        assert_close(tied(x)[0], untied(x)[0], 1e-6, f"{name}: tied vs untied with W_v = W_k")


def test_bad_arguments_list_the_choices():
    with pytest.raises(ValueError, match="valid mixers: .*gated_delta_rule"):
        build_mixer("gdn2", D, H)
    with pytest.raises(ValueError, match=r"n_heads=5 must divide d_model=32 \(valid n_heads: \[1, 2, 4, 8, 16, 32\]"):
        build_mixer("gated_delta_rule", D, 5)
    with pytest.raises(ValueError, match="short_conv must be a subset of 'qkv'"):
        build_mixer("gated_delta_rule", D, H, short_conv="qx")
    with pytest.raises(ValueError, match="conv_mode must be one of 'learned', 'shift', 'identity'"):
        build_mixer("gated_delta_rule", D, H, conv_mode="none")
    with pytest.raises(ValueError, match="unknown argument.*valid: .*short_conv"):
        build_mixer("gated_delta_rule", D, H, shortconv="k")
    with pytest.raises(ValueError, match="tie_kv=True needs head_dim_v == head_dim"):
        build_mixer("gla", D, H, tie_kv=True, head_dim_v=16)
    layer = build_mixer("gla", D, H)
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, d_model\] with d_model = 32"):
        layer(torch.randn(2, 3, 16))
    with pytest.raises(TypeError, match="cache must be None or a LayerCache"):
        layer(torch.randn(2, 1, D), cache={"state": None})


def _numel(state):
    if isinstance(state, torch.Tensor):
        return state.numel()
    if isinstance(state, (tuple, list)):
        return sum(_numel(s) for s in state)
    if hasattr(state, "current"):  # MiniBatchState
        return _numel(state.current) + _numel(state.start)
    return sum(_numel(getattr(state, f)) for f in ("k", "v"))  # KVCache


@pytest.mark.parametrize("name", list_mixers())
def test_recurrent_state_size_does_not_grow_with_context(name):
    """The cache of a recurrent mixer has a fixed size (decoding is O(1) per token); the softmax family's
    KV cache grows by one position per token."""
    torch.manual_seed(3)
    layer = build_mixer(name, D, H)
    with torch.no_grad():
        _, short = layer(torch.randn(1, 4, D))
        _, long = layer(torch.randn(1, 19, D))
        _, long = layer(torch.randn(1, 1, D), long)
    grows = name in ("softmax_attn", "forgetting_attn", "deltaformer", "path_attn")
    assert (_numel(long.state) > _numel(short.state)) == grows, f"{name}: state size vs context"
    assert all(long.conv[c].shape == short.conv[c].shape for c in short.conv)
