"""Models: config YAML round trip and checks, CausalLM cached decoding and generate, SequenceClassifier
pooling with padding, bidirectional = sum of the two directions, dual encoder, decode_bench."""

import pytest
import torch

from linattn.models import CausalLM, ModelConfig, SequenceClassifier, list_mixers
from linattn.models.blocks import Bidirectional, reverse_within
from linattn.models.decode_bench import decode_cost_ratio
from linattn.testing import assert_close

V = 40


def cfg(mixer="mamba2", **kw):
    base = dict(mixer=mixer, d_model=32, n_layers=2, n_heads=4, vocab_size=V)
    return ModelConfig(**{**base, **kw})


def test_config_yaml_round_trip(tmp_path):
    c = cfg("gated_delta_rule", mlp=False, mixer_kwargs={"short_conv": "k", "conv_mode": "shift", "tie_kv": True})
    assert ModelConfig.from_yaml(c.to_yaml()) == c
    path = tmp_path / "model.yaml"
    c.to_yaml(path)
    assert ModelConfig.from_yaml(path) == c and ModelConfig.from_yaml(str(path)) == c


def test_config_errors_list_the_choices():
    with pytest.raises(ValueError, match="unknown mixer 'gdn'; valid mixers: .*mamba2"):
        cfg("gdn")
    with pytest.raises(ValueError, match=r"n_heads=3 must divide d_model=32 \(valid n_heads: \[1, 2, 4, 8, 16, 32\]"):
        cfg(n_heads=3)
    with pytest.raises(ValueError, match="unknown ModelConfig field.*n_layer.*valid: mixer"):
        ModelConfig.from_dict({"mixer": "gla", "n_layer": 2})
    with pytest.raises(ValueError, match="short_conv must be a subset of 'qkv'"):
        CausalLM(cfg(mixer_kwargs={"short_conv": "kz"}))
    with pytest.raises(ValueError, match="mixer_kwargs of mixer 'mamba2' has unknown key.*conv; valid: .*conv_mode"):
        cfg(mixer_kwargs={"conv": "k"})


@pytest.mark.parametrize("mixer", ["mamba2", "softmax_attn", "ttt_linear", "mamba"])
def test_lm_prefill_then_steps_equals_full(mixer):
    torch.manual_seed(0)
    model = CausalLM(cfg(mixer, mixer_kwargs={"short_conv": "v"} if mixer == "mamba" else {"short_conv": "qkv"}))
    ids = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        full, _ = model(ids)
        logits, cache = model(ids[:, :6])
        steps = [logits]
        for t in range(6, 11):
            logits, cache = model(ids[:, t:t + 1], cache)
            steps.append(logits)
    assert_close(torch.cat(steps, 1), full, 1e-5, f"{mixer}: cached decoding vs full forward")


def test_generate_greedy_matches_uncached_argmax_and_sampling_is_seeded():
    torch.manual_seed(1)
    model = CausalLM(cfg("gated_delta_rule")).eval()
    prompt = torch.randint(0, V, (2, 5))
    out = model.generate(prompt, 6)
    ids = prompt
    with torch.no_grad():
        for _ in range(6):
            logits, _ = model(ids, use_cache=False)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)
    assert torch.equal(model.generate(prompt, 6, temperature=0.7, top_k=1), out)
    a = model.generate(prompt, 6, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 6, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (2, 11) and torch.equal(a[:, :5], prompt)
    with pytest.raises(ValueError, match="top_k must be None or an int in"):
        model.generate(prompt, 2, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match=r"input_ids values must lie in \[0, vocab_size=40\)"):
        model(torch.full((1, 3), V))


def test_gradients_reach_every_parameter_and_embeddings_tie():
    torch.manual_seed(2)
    model = CausalLM(cfg("gla"))
    assert model.lm_head.weight is model.embed.weight
    assert CausalLM(cfg("gla", tie_embeddings=False)).lm_head.weight is not None
    logits, _ = model(torch.randint(0, V, (2, 9)), use_cache=False)
    logits.logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient for {missing}"


def test_reverse_within_lengths():
    x = torch.arange(10.0).view(2, 5, 1)
    y = reverse_within(x, torch.tensor([5, 3]))
    assert y[:, :, 0].tolist() == [[4, 3, 2, 1, 0], [7, 6, 5, 8, 9]]
    assert torch.equal(reverse_within(y, torch.tensor([5, 3])), x)


def test_bidirectional_is_the_sum_of_both_directions():
    torch.manual_seed(3)
    c = cfg("gated_delta_rule")
    bi = Bidirectional(c.build_mixer(), c.build_mixer())
    x = torch.randn(2, 7, 32)
    expected = bi.fwd(x)[0] + bi.bwd(x.flip(1))[0].flip(1)
    assert_close(bi(x), expected, 1e-6, "bidirectional vs the two directions")
    # with padding, the backward direction starts at each sequence's last real token
    lengths = torch.tensor([7, 4])
    y = bi(x, lengths)
    y1 = bi.fwd(x[1:, :4])[0] + bi.bwd(x[1:, :4].flip(1))[0].flip(1)
    assert_close(y[1:, :4], y1, 1e-6, "bidirectional with padding")


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_classifier_padding_does_not_change_the_logits(pooling, bidirectional):
    torch.manual_seed(4)
    model = SequenceClassifier(cfg("mamba2"), 3, pooling=pooling, bidirectional=bidirectional).eval()
    ids = torch.randint(0, V, (2, 8))
    padded = torch.cat([ids[:, :5], torch.zeros(2, 3, dtype=torch.long)], 1)
    mask = torch.arange(8)[None].expand(2, 8) < 5
    with torch.no_grad():
        assert_close(model(padded, mask=mask), model(ids[:, :5]), 1e-5, "padded vs unpadded logits")
        assert model(ids).shape == (2, 3)


def test_dual_encoder_and_classifier_errors():
    torch.manual_seed(5)
    model = SequenceClassifier(cfg("gla"), 2, dual=True, bidirectional=True)
    a, b = torch.randint(0, V, (3, 6)), torch.randint(0, V, (3, 9))
    logits = model(a, b)
    assert logits.shape == (3, 2)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        e1, e2 = model.encode(a), model.encode(b)
        assert_close(model(a, b), model.head(torch.cat([e1, e2, e1 * e2, e1 - e2], -1)), 1e-6, "dual head")
    with pytest.raises(ValueError, match="dual=True needs input_ids2"):
        model(a)
    with pytest.raises(ValueError, match="pooling must be one of 'mean', 'last'"):
        SequenceClassifier(cfg(), 2, pooling="max")
    with pytest.raises(ValueError, match="mask must mark a non-empty prefix"):
        SequenceClassifier(cfg(), 2)(a, mask=torch.tensor([[False, True] * 3] * 3))


def test_decode_bench_runs_at_tiny_sizes():
    r = decode_cost_ratio("mamba2", short_context=4, long_context=12, new_tokens=2, d_model=16, n_layers=1,
                          n_heads=2, vocab_size=20)
    assert r["ratio"] > 0 and r["ms_per_token_short"] > 0 and r["long_context"] == 12


def test_list_mixers_has_every_family():
    expected = {"linear_attn", "retention", "mamba2", "gla", "delta_rule", "gated_delta_rule", "comba",
                "gated_delta_product", "mesa_net", "ttt_linear", "titans", "softmax_attn", "forgetting_attn",
                "deltaformer", "path_attn", "lru", "mamba"}
    assert expected <= set(list_mixers())
