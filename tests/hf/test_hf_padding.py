"""Padded batches in LinAttnForCausalLM: each row's logits, cache and generated tokens equal those of the row
alone (left padding for generate, left or right for forward); unsupported masks raise before any compute."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("linattn.hf")

from linattn.hf.cache import map_tensors  # noqa: E402
from linattn.models import ModelConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 53
# gated_delta_rule and mamba2 have ShortConvs on q, k, v; softmax_attn has RoPE, and forgetting_attn gets it here
MIXERS = [("gated_delta_rule", {}), ("softmax_attn", {}), ("forgetting_attn", {"rope_theta": 10000.0}),
          ("mamba2", {})]


def model_of(mixer: str, mixer_kwargs: dict | None = None) -> "hf.LinAttnForCausalLM":
    torch.manual_seed(0)
    config = ModelConfig(mixer=mixer, d_model=32, n_heads=2, n_layers=2, vocab_size=VOCAB,
                         mixer_kwargs=mixer_kwargs or {})
    return hf.LinAttnForCausalLM(hf.LinAttnConfig.from_model_config(config)).eval()


def padded(prompts: list[torch.Tensor], side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of the prompts padded (with id 0) to the longest."""
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        cols = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        ids[i, cols], mask[i, cols] = p, 1
    return ids, mask


def prompts_of(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(("mixer", "kwargs"), MIXERS, ids=[m for m, _ in MIXERS])
@torch.no_grad()
def test_padded_rows_give_the_logits_and_cache_of_each_row_alone(mixer, kwargs, side):
    model = model_of(mixer, kwargs)
    prompts = prompts_of([3, 6, 6, 1])
    ids, mask = padded(prompts, side)
    out = model(ids, attention_mask=mask)
    uncached = model(ids, attention_mask=mask, use_cache=False)  # the packed path
    assert uncached.past_key_values is None
    assert bool((out.logits[mask == 0] == 0).all()) and bool((uncached.logits[mask == 0] == 0).all())
    # two more tokens per row through the cache, with transformers' mask grown by ones
    more = torch.randint(1, VOCAB, (len(prompts), 2))
    cache = out.past_key_values
    grown = torch.cat([mask, torch.ones_like(more)], dim=1)
    first = model(more[:, :1], attention_mask=grown[:, :-1], past_key_values=cache)
    second = model(more[:, 1:], attention_mask=grown, past_key_values=first.past_key_values)
    assert cache.get_seq_length() == ids.shape[1] + 2
    for i, p in enumerate(prompts):
        alone = model(torch.cat([p, more[i]])[None]).logits[0]
        real = mask[i] == 1
        torch.testing.assert_close(out.logits[i, real], alone[:len(p)], atol=1e-5, rtol=0)
        torch.testing.assert_close(uncached.logits[i, real], alone[:len(p)], atol=1e-5, rtol=0)
        torch.testing.assert_close(first.logits[i, 0], alone[len(p)], atol=1e-5, rtol=0)
        torch.testing.assert_close(second.logits[i, 0], alone[len(p) + 1], atol=1e-5, rtol=0)


def row_tensors(cache, row: int) -> list[torch.Tensor]:
    """Row ``row`` of every tensor in a LayerCache (ShortConv inputs, mixer state)."""
    found: list[torch.Tensor] = []
    map_tensors((cache.conv, cache.state), lambda t: found.append(t[row]) or t)
    return found


@torch.no_grad()
def test_each_rows_cache_state_is_that_of_the_row_alone():
    model = model_of("gated_delta_rule")
    prompts = prompts_of([2, 5, 4, 5])
    ids, mask = padded(prompts)
    cache = model(ids, attention_mask=mask).past_key_values
    assert len(cache.groups) == 3 and cache.batch_size == 4  # one group per real length
    with pytest.raises(ValueError, match="different positions"):
        _ = cache.layer_caches
    for rows, layers in cache.groups:
        for j, row in enumerate(rows.tolist()):
            alone = model(prompts[row][None]).past_key_values.layer_caches
            for ours, theirs in zip(layers, alone, strict=True):
                assert ours.offset == theirs.offset == len(prompts[row])
                for a, b in zip(row_tensors(ours, j), row_tensors(theirs, 0), strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("mixer", "kwargs"), MIXERS[:2] + MIXERS[3:], ids=["gated_delta_rule", "softmax_attn",
                                                                            "mamba2"])
def test_generate_on_left_padded_prompts_equals_ours_and_each_prompt_alone(mixer, kwargs):
    model = model_of(mixer, kwargs)
    prompts = prompts_of([3, 7, 1, 7], seed=2)
    ids, mask = padded(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (4, 7 + 8)
    assert out.tolist() == model.model.generate(ids, 8, attention_mask=mask).tolist()
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert alone[0, len(p):].tolist() == out[i, 7:].tolist()


def test_beam_search_on_left_padded_prompts_equals_each_prompt_alone():
    model = model_of("softmax_attn")
    prompts = prompts_of([3, 6, 2], seed=3)
    ids, mask = padded(prompts)
    args = {"max_new_tokens": 5, "num_beams": 3, "num_return_sequences": 2, "do_sample": False, "pad_token_id": 0}
    out = model.generate(ids, attention_mask=mask, **args)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], **args)
        assert alone[:, len(p):].tolist() == out[2 * i:2 * i + 2, 6:].tolist()


def test_loss_of_a_padded_batch_counts_the_predictions_within_each_row():
    model = model_of("gla")
    prompts = prompts_of([4, 7, 2])
    ids, mask = padded(prompts)
    loss = model(ids, attention_mask=mask, labels=ids).loss  # labels at padding need not be -100
    logits = [model(p[None]).logits[0, :-1] for p in prompts]
    expected = F.cross_entropy(torch.cat(logits), torch.cat([p[1:] for p in prompts]))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_unsupported_masks_raise_before_any_compute():
    model = model_of("gated_delta_rule")
    prompts = prompts_of([3, 5])
    ids, mask = padded(prompts)
    cache = model(ids, attention_mask=mask).past_key_values

    def no_compute(*_):
        raise AssertionError("the model ran")

    hook = model.model.register_forward_pre_hook(no_compute)
    try:
        middle = mask.clone()
        middle[1, 2] = 0
        with pytest.raises(ValueError, match="attention_mask must mark each row's tokens as one run"):
            model(ids, attention_mask=middle)
        empty = mask.clone()
        empty[0] = 0
        with pytest.raises(ValueError, match=r"attention_mask must mark at least one token .* rows \[0\]"):
            model(ids, attention_mask=empty)
        with pytest.raises(ValueError, match="attention_mask values must be 0"):
            model(ids, attention_mask=mask * 2)
        with pytest.raises(ValueError, match="attention_mask must be a bool or 0/1 integer tensor"):
            model(ids, attention_mask=mask.float())
        with pytest.raises(ValueError, match=r"attention_mask must have shape \[2, 5\]"):
            model(ids, attention_mask=mask[:, 1:])
        step = torch.ones(2, 1, dtype=torch.long)
        with pytest.raises(ValueError, match="attention_mask marks padding among new tokens after the cache"):
            model(step, attention_mask=torch.cat([mask, torch.tensor([[1], [0]])], 1), past_key_values=cache)
        with pytest.raises(ValueError, match="attention_mask's first 5 columns must repeat the padding"):
            model(step, attention_mask=torch.ones(2, 6, dtype=torch.long), past_key_values=cache)
        with pytest.raises(ValueError, match=r"attention_mask must have shape \[2, 6\] .* or \[2, 1\]"):
            model(step, attention_mask=mask, past_key_values=cache)
    finally:
        hook.remove()
    assert cache.get_seq_length() == 5  # the refused calls left the cache as it was
