"""transformers' generate runs on linattn's recurrent state (LinAttnCache) and equals our own greedy decoding
token for token; the causal LM's loss, cache and unsupported inputs."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("linattn.hf")

from linattn.models import ModelConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def model_of(mixer: str) -> "hf.LinAttnForCausalLM":
    torch.manual_seed(0)
    config = ModelConfig(mixer=mixer, d_model=32, n_heads=2, n_layers=2, vocab_size=53)
    return hf.LinAttnForCausalLM(hf.LinAttnConfig.from_model_config(config)).eval()


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "softmax_attn", "mamba2"])
def test_generate_equals_our_greedy_decoding(mixer):
    model = model_of(mixer)
    prompt = torch.randint(0, 53, (2, 6))
    out = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    ours = model.model.generate(prompt, 10, static=False)
    assert out.shape == (2, 16)
    assert out.tolist() == ours.tolist()


def test_generate_returns_the_recurrent_cache():
    model = model_of("gated_delta_rule")
    prompt = torch.randint(0, 53, (1, 5))
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    assert isinstance(cache, hf.LinAttnCache) and len(cache) == 2
    # the state of a recurrent mixer does not grow: one [B, H, K, V] matrix per layer
    assert cache.layer_caches[0].state.shape == (1, 2, 16, 16)
    # generate ran the last token without a forward: the cache has seen all tokens but the final one
    assert cache.get_seq_length() == out.sequences.shape[1] - 1


def test_cache_continues_a_sequence_and_reorders_rows():
    model = model_of("mamba2")
    ids = torch.randint(0, 53, (2, 9))
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :6], use_cache=True)
        rest = model(ids[:, 6:], past_key_values=first.past_key_values)
        assert torch.allclose(torch.cat([first.logits, rest.logits], 1), full, atol=1e-5)
        cache = rest.past_key_values
        cache.reorder_cache(torch.tensor([1, 0]))  # row 0 is now the second sequence
        second = hf.LinAttnCache([type(c)({k: v[:1] for k, v in c.conv.items()}, c.state[:1], c.offset)
                                  for c in cache.layer_caches])
        token = ids[:1, :1]
        step = model(token.repeat(2, 1), past_key_values=cache).logits
        alone = model(token, past_key_values=second)
    assert torch.allclose(step[:1], alone.logits, atol=1e-6)


def test_loss_is_next_token_cross_entropy():
    model = model_of("gla")
    ids = torch.randint(0, 53, (2, 7))
    labels = ids.clone()
    labels[0, 3] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 53), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, expected)
    assert model(ids, logits_to_keep=1).logits.shape == (2, 1, 53)


def test_unsupported_inputs_are_refused():
    model = model_of("gated_delta_rule")
    ids = torch.randint(0, 53, (2, 5))
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(ids, inputs_embeds=torch.zeros(2, 5, 32))
    with pytest.raises(ValueError, match="output_hidden_states"):
        model(ids, output_hidden_states=True)
    with pytest.raises(TypeError, match="past_key_values must be None or a LinAttnCache"):
        model(ids, past_key_values=[1, 2])
