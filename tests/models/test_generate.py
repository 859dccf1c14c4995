"""CausalLM.generate: static path == eager path (greedy for every mixer, seeded sampling), ragged prompts ==
each prompt alone (list and left-padded attention_mask), top-k=1 and tiny top-p == greedy, seeded samples
reproducible, sampled frequencies follow the filtered softmax, stop tokens stop and pad rows, and argument
errors name the argument before any compute."""

import math

import pytest
import torch

from linattn.layers import list_mixers
from linattn.models import CausalLM, ModelConfig
from linattn.models.decode import StaticDecoder
from linattn.models.sampling import filter_logits, sample_next

pytestmark = pytest.mark.usefixtures("one_thread")
V = 50


def model_of(mixer="gated_delta_rule", seed=0, **mixer_kwargs):
    torch.manual_seed(seed)
    cfg = ModelConfig(mixer=mixer, d_model=32, n_layers=2, n_heads=2, vocab_size=V, mixer_kwargs=mixer_kwargs)
    return CausalLM(cfg).eval()


def prompts_of(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=gen) for n in lengths]


def left_padded(prompts, pad=0):
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, True
    return ids, mask


@pytest.mark.parametrize("mixer", list_mixers())
def test_greedy_static_equals_eager_and_ragged_rows_equal_each_prompt_alone(mixer):
    model = model_of(mixer, mini_batch_size=4) if mixer in ("ttt_linear", "titans") else model_of(mixer)
    prompts = prompts_of([5, 2, 9])
    static = model.generate(prompts, 8)
    assert [len(s) for s in static] == [13, 10, 17]
    eager = model.generate(prompts, 8, static=False)
    alone = [model.generate([p], 8, static=False)[0] for p in prompts]
    for i in range(3):
        assert torch.equal(static[i][:len(prompts[i])], prompts[i])
        assert torch.equal(static[i], eager[i]), f"{mixer}: static vs eager path, row {i}"
        assert torch.equal(static[i], alone[i]), f"{mixer}: row {i} in a ragged batch vs alone"


def test_attention_mask_left_padding_equals_the_list():
    model = model_of("softmax_attn")
    prompts = prompts_of([3, 6, 1])
    ids, mask = left_padded(prompts, pad=7)
    out = model.generate(ids, 5, attention_mask=mask)
    listed = model.generate(prompts, 5)
    assert out.shape == (3, 6 + 5) and torch.equal(out[:, :6], ids)
    for i in range(3):
        assert torch.equal(out[i, 6:], listed[i][len(prompts[i]):])
    full = model.generate(ids, 5)  # no mask: every row 6 tokens, padding included
    assert torch.equal(full, model.generate(ids, 5, attention_mask=torch.ones_like(mask)))
    with pytest.raises(ValueError, match="attention_mask must mark each row's prompt at its end"):
        model.generate(ids, 5, attention_mask=mask.flip(1))
    with pytest.raises(ValueError, match="attention_mask must mark each row's prompt at its end"):
        model.generate(ids, 5, attention_mask=torch.zeros_like(mask))
    with pytest.raises(ValueError, match="attention_mask goes with input_ids"):
        model.generate(prompts, 5, attention_mask=mask)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    model = model_of("mamba2")
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    greedy = model.generate(ids, 7)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(ids, 7, temperature=0.9, top_k=1, generator=gen), greedy)
    assert torch.equal(model.generate(ids, 7, temperature=2.0, top_p=1e-6, generator=gen), greedy)
    assert torch.equal(model.generate(ids, 7, temperature=0.0, top_k=3, top_p=0.5), greedy)  # greedy ignores both


def test_seeded_sampling_is_reproducible_and_equal_on_both_paths():
    model = model_of("forgetting_attn")
    prompts = prompts_of([4, 7])

    def sample(**kw):
        return model.generate(prompts, 12, temperature=1.3, top_k=20, top_p=0.95,
                              generator=torch.Generator().manual_seed(5), **kw)

    a, b, c = sample(), sample(), sample(static=False)
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))
    other = model.generate(prompts, 12, temperature=1.3, generator=torch.Generator().manual_seed(6))
    assert not all(torch.equal(x, y) for x, y in zip(a, other))


def test_sampled_frequencies_follow_the_filtered_softmax():
    """20000 draws from fixed logits: top-k and top-p restrict the support; frequencies within 0.02 of the
    renormalised probabilities."""
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    gen = torch.Generator().manual_seed(7)
    for kw, support in (({}, 6), ({"top_k": 3}, 3), ({"top_p": 0.6}, 2), ({"top_k": 4, "top_p": 0.9}, 4)):
        filtered = filter_logits(base[None], kw.get("top_k"), kw.get("top_p"))[0]
        assert int(torch.isfinite(filtered).sum()) == support, kw
        probs = torch.softmax(filtered, -1)
        draws = sample_next(base.expand(n, -1), temperature=1.0, generator=gen, **kw)
        freq = torch.bincount(draws, minlength=6).double() / n
        assert (freq[support:] == 0).all(), f"{kw}: tokens outside the support were drawn"
        assert (freq - probs).abs().max() < 0.02, f"{kw}: frequencies {freq.tolist()} vs {probs.tolist()}"
    hot = torch.bincount(sample_next(base.expand(n, -1), temperature=100.0, generator=gen), minlength=6) / n
    assert (hot - 1 / 6).abs().max() < 0.02  # a high temperature flattens the distribution


@pytest.mark.parametrize("static", [True, False])
def test_stop_tokens_stop_rows_and_pad(static):
    model = model_of("gla")
    prompts = prompts_of([3, 5, 4])
    free = model.generate(prompts, 30, static=static)
    gen_tokens = [f[len(p):] for f, p in zip(free, prompts)]
    stop = int(gen_tokens[0][2])  # row 0 emits it at step 2; other rows may emit it or not
    first = [int((g == stop).nonzero()[0]) if (g == stop).any() else None for g in gen_tokens]
    unused = sorted(set(range(V)) - set(torch.cat(gen_tokens).tolist()))
    other, pad = unused[:2]  # a second stop id that no row emits, and the pad id
    ids, mask = left_padded(prompts)
    out = model.generate(ids, 30, attention_mask=mask, eos_token_id=[stop, other], pad_token_id=pad,
                         static=static, stop_check_interval=4)
    new = out[:, ids.shape[1]:]
    expected_len = 30 if None in first else max(first) + 1
    assert new.shape[1] == expected_len
    for i, f in enumerate(first):
        if f is None:
            assert torch.equal(new[i], gen_tokens[i][:expected_len])
        else:
            assert torch.equal(new[i, :f + 1], gen_tokens[i][:f + 1]) and (new[i, f + 1:] == pad).all()
    # the interval of the host check does not change the result
    again = model.generate(ids, 30, attention_mask=mask, eos_token_id=[stop, other], pad_token_id=pad,
                           static=static, stop_check_interval=1)
    assert torch.equal(again, out)
    listed = model.generate(prompts, 30, eos_token_id=stop, static=static)
    for i, f in enumerate(first):
        n = 30 if f is None else f + 1
        assert torch.equal(listed[i], torch.cat([prompts[i], gen_tokens[i][:n]]))


def test_all_rows_stopping_early_ends_generation():
    model = model_of("retention")
    prompt = prompts_of([4])
    first = int(model.generate(prompt, 1)[0][-1])
    out = model.generate(torch.stack(prompt), 40, eos_token_id=first)
    assert out.shape == (1, 5)  # stopped at the first token, not 40 (nor the next multiple of 16)
    # two rows stopping at different steps: cut after the later one
    ids = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(3))
    free = model.generate(ids, 20)[:, 3:]
    stops = [int(free[0, 3]), int(free[1, 6])]
    hit = [[t for t in range(20) if int(free[r, t]) in stops][0] for r in range(2)]
    out = model.generate(ids, 20, eos_token_id=stops, pad_token_id=0)[:, 3:]
    assert out.shape[1] == max(hit) + 1
    for r in range(2):
        assert torch.equal(out[r, :hit[r] + 1], free[r, :hit[r] + 1]) and (out[r, hit[r] + 1:] == 0).all()


def test_decoder_reuse_and_eager_cache_path_agree():
    model = model_of("deltaformer")
    prompts = prompts_of([2, 6])
    decoder = StaticDecoder(model, 2, 20)
    a = model.generate(prompts, 6, decoder=decoder)
    b = model.generate(prompts, 6, decoder=decoder)
    c = model.generate(prompts, 6)
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))
    with pytest.raises(ValueError, match="decoder must be a StaticDecoder of this model with batch_size 2 and "
                                         "max_length >= 21"):
        model.generate(prompts, 16, decoder=decoder)
    with pytest.raises(ValueError, match="decoder must be a StaticDecoder"):
        model.generate(prompts, 6, decoder=decoder, static=False)


def test_zero_new_tokens_returns_the_prompts():
    model = model_of()
    ids = torch.randint(0, V, (2, 3))
    assert model.generate(ids, 0) is ids


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 0"),
    ({"max_new_tokens": 2.0}, "max_new_tokens must be an int >= 0"),
    ({"max_new_tokens": True}, "max_new_tokens must be an int >= 0"),
    ({"temperature": -0.5}, "temperature must be a finite float >= 0"),
    ({"temperature": math.nan}, "temperature must be a finite float >= 0"),
    ({"temperature": math.inf}, "temperature must be a finite float >= 0"),
    ({"temperature": True}, "temperature must be a finite float >= 0"),
    ({"temperature": "1"}, "temperature must be a finite float >= 0"),
    ({"top_k": 0}, r"top_k must be None or an int in \[1, vocab_size=50\]"),
    ({"top_k": 51}, r"top_k must be None or an int in \[1, vocab_size=50\]"),
    ({"top_k": True}, "top_k must be None or an int"),
    ({"top_k": 2.0}, "top_k must be None or an int"),
    ({"top_p": 0.0}, r"top_p must be None or a float in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be None or a float in \(0, 1\]"),
    ({"top_p": math.nan}, r"top_p must be None or a float in \(0, 1\]"),
    ({"top_p": True}, "top_p must be None or a float"),
    ({"top_p": "0.5"}, "top_p must be None or a float"),
    ({"eos_token_id": 50}, r"eos_token_id must be None, an int or a non-empty list of ints in \[0, vocab_size=50\)"),
    ({"eos_token_id": [3, -1]}, "eos_token_id must be None, an int or a non-empty list"),
    ({"eos_token_id": []}, "eos_token_id must be None, an int or a non-empty list"),
    ({"eos_token_id": True}, "eos_token_id must be None, an int or a non-empty list"),
    ({"eos_token_id": "2"}, "eos_token_id must be None, an int or a non-empty list"),
    ({"eos_token_id": 3, "pad_token_id": 50}, r"pad_token_id must be None or an int in \[0, vocab_size=50\)"),
    ({"generator": 3}, "generator must be a torch.Generator on the model's device type"),
    ({"stop_check_interval": 0}, "stop_check_interval must be a positive int"),
    ({"static": 1}, "static must be a bool"),
])
def test_argument_errors_before_any_compute(kwargs, match, monkeypatch):
    model = model_of()
    calls = []
    monkeypatch.setattr(CausalLM, "forward", lambda *a, **k: calls.append(1))
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        model.generate(torch.randint(0, V, (2, 3)), kwargs.pop("max_new_tokens"), **kwargs)
    assert calls == []


def test_prompt_errors():
    model = model_of()
    with pytest.raises(ValueError, match=r"input_ids values must lie in \[0, vocab_size=50\)"):
        model.generate(torch.full((1, 3), V), 2)
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty 1-D integer tensor"):
        model.generate([torch.tensor([1, 2]), torch.tensor([[1]])], 2)
    with pytest.raises(ValueError, match=r"prompts\[0\] values must lie in \[0, vocab_size=50\)"):
        model.generate([torch.tensor([-1, 2])], 2)
    with pytest.raises(ValueError, match="prompts must hold at least one prompt"):
        model.generate([], 2)
