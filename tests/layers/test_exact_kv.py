"""tie_kv="exact": the value fed to the op is the key fed to the op (after conv, feature map and norm), in the
full forward and in the cached steps."""

from __future__ import annotations

import pytest
import torch

from linattn.layers import build_mixer
from linattn.testing import assert_close

D, H, B, T = 32, 4, 2, 9
KV_MIXERS = ["softmax_attn", "forgetting_attn", "delta_rule", "gated_delta_rule", "gla", "mesa_net"]


def _capture(layer):
    seen = []
    run_op = layer.run_op

    def spy(q, k, v, *args, **kwargs):
        seen.append((k.clone(), v.clone()))
        return run_op(q, k, v, *args, **kwargs)

    layer.run_op = spy
    return seen


@pytest.mark.parametrize("name", KV_MIXERS)
def test_exact_kv_feeds_the_key_as_value(name):
    torch.manual_seed(0)
    layer = build_mixer(name, D, H, tie_kv="exact", short_conv="k")
    seen = _capture(layer)
    x = torch.randn(B, T, D)
    with torch.no_grad():
        y, _ = layer(x)
        # prefill then single-token steps agree with the full forward
        y1, cache = layer(x[:, :5])
        ys = [y1]
        for t in range(5, T):
            yt, cache = layer(x[:, t:t + 1], cache)
            ys.append(yt)
    assert seen and all(torch.equal(k, v) for k, v in seen)
    assert_close(torch.cat(ys, 1), y, 1e-5, f"{name}: exact K = V, prefill + steps vs full")
    # the shared projection (tie_kv=True) feeds k's projection before its conv: K and V differ
    shared = build_mixer(name, D, H, tie_kv=True, short_conv="k")
    seen_shared = _capture(shared)
    with torch.no_grad():
        shared(x)
    assert not torch.equal(*seen_shared[0])


def test_exact_kv_refuses_bad_settings():
    with pytest.raises(ValueError, match="ShortConv on v would be unused"):
        build_mixer("gla", D, H, tie_kv="exact", short_conv="kv")
    with pytest.raises(TypeError, match="tie_kv must be a bool or 'exact'"):
        build_mixer("gla", D, H, tie_kv="yes")
    with pytest.raises(ValueError, match="needs head_dim_v == head_dim"):
        build_mixer("gla", D, H, tie_kv="exact", head_dim_v=16)


@pytest.mark.parametrize("name", ["gated_delta_rule", "softmax_attn"])
def test_exact_kv_static_steps_equal_cached_steps(name):
    from linattn.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(mixer=name, d_model=D, n_layers=2, n_heads=2, vocab_size=40,
                                 mixer_kwargs={"tie_kv": "exact", "short_conv": "k"})).eval()
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model(ids[:, :6])
        static = model.allocate_static_cache(2, 12)
        static.load(model, cache, torch.arange(2), 6)
        for t in range(6, 10):
            expected, cache = model(ids[:, t:t + 1], cache)
            assert_close(model.static_step(ids[:, t], static), expected[:, 0], 1e-5, f"{name}: static step {t}")
