"""FLA checkpoints to linattn: our writer (save_fla, FLA's layout) then from_fla gives identical logits for every
family and option mapped; unsupported options and mismatched checkpoints fail naming what is wrong. With FLA
importable, its own models' checkpoints convert and round-trip parameter for parameter."""

import json

import pytest
import torch

pytest.importorskip("transformers")
hf = pytest.importorskip("linattn.hf")

from linattn.errors import CheckpointError  # noqa: E402
from linattn.hf.fla_config import FLA_DEFAULTS, UnsupportedFLAConfig  # noqa: E402
from linattn.models import CausalLM, ModelConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def lm(mixer: str, mixer_kwargs: dict, **kw) -> ModelConfig:
    fields = dict(d_model=32, n_heads=2, n_layers=2, vocab_size=50, norm_eps=1e-6)
    fields.update(kw)
    if fields.get("mlp", True):
        mixer_kwargs = {"norm_eps": fields["norm_eps"], **mixer_kwargs}
    return ModelConfig(mixer=mixer, mixer_kwargs=mixer_kwargs, **fields)


CASES = {
    "delta_net": lm("delta_rule", {}, tie_embeddings=False, mlp_hidden=40),
    "delta_net_gate_no_conv": lm("delta_rule", {"output_gate": True, "conv_mode": "identity",
                                                "allow_neg_eigval": True}),
    "gated_deltanet": lm("gated_delta_rule", {"head_dim": 8, "head_dim_v": 16}),
    "gated_deltanet_no_gate": lm("gated_delta_rule", {"output_gate": False, "conv_kernel": 3}),
    "gla": lm("gla", {"head_dim": 8}),
    "gla_conv_no_gate": lm("gla", {"short_conv": "qkv", "output_gate": False}),
    "mamba2": lm("mamba2", {"head_dim": 8, "head_dim_v": 16, "norm_groups": 4, "conv_bias": True}, n_heads=4,
                 mlp=False, norm_eps=1e-5),
    "mamba2_no_norm": lm("mamba2", {"head_dim": 8, "head_dim_v": 16, "output_norm": False}, n_heads=4, mlp=False,
                         norm_eps=1e-5),
}


def random_model(config: ModelConfig) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():  # away from the initial values (norm weights of one) where a swap would not show
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def assert_same_logits(a: CausalLM, b: CausalLM) -> None:
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(a(ids)[0], b(ids)[0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_fla_layout_round_trip_gives_identical_logits(tmp_path, name):
    model = random_model(CASES[name])
    hf.save_fla(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == name.split("_no")[0].split("_gate")[0].split("_conv")[0]
    assert_same_logits(model, hf.from_fla(tmp_path))


def test_mamba2_groups_share_b_and_c(tmp_path):
    """FLA's Mamba2 shares B, C within each of n_groups groups; linattn repeats them per head."""
    model = random_model(lm("mamba2", {"head_dim": 8, "head_dim_v": 16, "norm_groups": 1}, n_heads=4, mlp=False,
                            norm_eps=1e-5))
    with pytest.raises(ValueError, match="groups"):
        hf.save_fla(model, tmp_path / "differs")  # random per-head B, C: not expressible with one group
    with torch.no_grad():
        for block in model.blocks:
            for p in (block.mixer.k_proj.weight, block.mixer.q_proj.weight, block.mixer.convs["k"].weight,
                      block.mixer.convs["q"].weight):
                p.copy_(p[:8].repeat(4, *([1] * (p.dim() - 1))))
    hf.save_fla(model, tmp_path)
    in_proj = hf.fla.read_fla_checkpoint(tmp_path)[1]["backbone.layers.0.mixer.in_proj.weight"]
    assert in_proj.shape[0] == 2 * 64 + 2 * 8 + 4  # z, x, one B and one C, dt
    assert_same_logits(model, hf.from_fla(tmp_path))


def test_config_json_without_default_values(tmp_path):
    """transformers leaves FLA's default values out of config.json: they are filled in from FLA's defaults."""
    model = random_model(CASES["gla"])
    hf.save_fla(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    defaults = FLA_DEFAULTS["gla"]
    trimmed = {k: v for k, v in config.items() if k not in defaults or defaults[k] != v}
    assert len(trimmed) < len(config)
    (tmp_path / "config.json").write_text(json.dumps(trimmed))
    assert_same_logits(model, hf.from_fla(tmp_path))


@pytest.mark.parametrize("change, field", [
    ({"num_v_heads": 4}, "num_v_heads"),
    ({"attn": {"layers": [1], "num_heads": 2}}, "attn"),
    ({"qk_activation": "relu"}, "qk_activation"),
    ({"model_type": "rwkv7"}, "model_type"),
])
def test_unsupported_options_name_the_field(tmp_path, change, field):
    hf.save_fla(random_model(CASES["gated_deltanet"]), tmp_path)
    config = {**json.loads((tmp_path / "config.json").read_text()), **change}
    if field == "qk_activation":
        config["model_type"] = "delta_net"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedFLAConfig, match=field):
        hf.from_fla(tmp_path)


def test_mismatched_checkpoints_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf.save_fla(random_model(CASES["delta_net"]), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({**state, "model.layers.0.attn.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not map.*extra"):
        hf.from_fla(tmp_path)
    state.pop("model.layers.1.attn.b_proj.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="b_proj"):
        hf.from_fla(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.from_fla(tmp_path / "nowhere")


def test_checkpoints_of_fla_models_round_trip(tmp_path):
    """FLA's own models (built on the CPU; their forward needs a GPU): every tensor of their checkpoint is mapped,
    and writing the linattn model back gives FLA's state dict exactly, loadable by FLA with no key missing."""
    fm = pytest.importorskip("fla.models")
    from linattn.hf.check_fla import perturb

    common = dict(hidden_size=64, num_hidden_layers=2, vocab_size=100)
    cases = [(fm.DeltaNetForCausalLM, fm.DeltaNetConfig(**common, num_heads=2, use_gate=True)),
             (fm.GatedDeltaNetForCausalLM, fm.GatedDeltaNetConfig(**common, num_heads=2, head_dim=16)),
             (fm.GLAForCausalLM, fm.GLAConfig(**common, num_heads=2, tie_word_embeddings=True)),
             (fm.Mamba2ForCausalLM, fm.Mamba2Config(**common, head_dim=16, state_size=8, n_groups=2))]
    for i, (cls, config) in enumerate(cases):
        model = cls(config)
        perturb(model, seed=i)
        model.save_pretrained(tmp_path / f"fla{i}")
        ours = hf.from_fla(tmp_path / f"fla{i}")
        hf.save_fla(ours, tmp_path / f"back{i}", n_groups=getattr(config, "n_groups", None))
        back, info = cls.from_pretrained(tmp_path / f"back{i}", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        for k, v in model.state_dict().items():
            assert torch.equal(v, back.state_dict()[k]), k
