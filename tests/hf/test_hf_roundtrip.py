"""save_pretrained then the Auto classes give back the same model: identical logits, for causal LMs (tied and
untied heads, fixed ShortConv kernels, which are not saved) and sequence classifiers."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("linattn.hf")

from linattn.models import CausalLM, ModelConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(mixer: str, **kw) -> ModelConfig:
    fields = dict(d_model=32, n_heads=2, n_layers=2, vocab_size=61)
    fields.update(kw)
    return ModelConfig(mixer=mixer, **fields)


@pytest.mark.parametrize("config", [
    tiny("gated_delta_rule"),
    tiny("softmax_attn", tie_embeddings=False),
    tiny("mamba2", mixer_kwargs={"conv_mode": "shift"}),
], ids=["gated_delta_rule", "softmax_attn_untied", "mamba2_shift_conv"])
def test_causal_lm_round_trip(tmp_path, config):
    torch.manual_seed(0)
    model = hf.LinAttnForCausalLM(hf.LinAttnConfig.from_model_config(config)).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is hf.LinAttnForCausalLM
    assert loaded.model.config == model.model.config
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    tied = loaded.model.lm_head.weight is loaded.model.embed.weight
    assert tied == config.tie_embeddings


def test_wrapping_a_causal_lm_shares_its_parameters(tmp_path):
    torch.manual_seed(0)
    lm = CausalLM(tiny("delta_rule")).eval()
    wrapper = hf.LinAttnForCausalLM.from_causal_lm(lm, eos_token_id=3)
    assert wrapper.model is lm and wrapper.config.eos_token_id == 3
    wrapper.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 61, (1, 7))
    with torch.no_grad():
        assert torch.equal(lm(ids)[0], loaded(ids).logits)


def test_sequence_classifier_round_trip(tmp_path):
    torch.manual_seed(0)
    config = hf.LinAttnConfig.from_model_config(tiny("gla"), num_labels=3, pooling="last", bidirectional=True)
    model = hf.LinAttnForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 61, (2, 8))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with torch.no_grad():
        out = loaded(ids, attention_mask=mask, labels=torch.tensor([0, 2]))
        assert torch.equal(model(ids, attention_mask=mask).logits, out.logits)
        # the padded row equals the same row unpadded
        assert torch.allclose(loaded(ids[1:, :5]).logits, out.logits[1:], atol=1e-6)
    assert out.logits.shape == (2, 3) and out.loss.ndim == 0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="mixer"):
        hf.LinAttnConfig(mixer="no_such_mixer")
    with pytest.raises(ValueError, match="mixer_kwargs"):
        hf.LinAttnConfig(mixer="gla", mixer_kwargs={"typo": 1})
