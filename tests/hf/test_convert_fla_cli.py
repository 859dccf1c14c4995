"""`linattn convert-fla SRC OUT`: an FLA checkpoint to a transformers checkpoint of linattn."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("linattn.hf")

from linattn.cli import main  # noqa: E402
from linattn.models import CausalLM, ModelConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_convert_fla_writes_a_loadable_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    config = ModelConfig(mixer="gated_delta_rule", d_model=32, n_heads=2, n_layers=1, vocab_size=40, norm_eps=1e-6,
                         mixer_kwargs={"norm_eps": 1e-6})
    hf.save_fla(CausalLM(config), tmp_path / "fla")
    assert main(["convert-fla", str(tmp_path / "fla"), str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert loaded.config.eos_token_id == 2 and loaded.config.bos_token_id == 1  # FLA's token ids carried over
    ids = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, hf.from_fla(tmp_path / "fla")(ids)[0])


def test_convert_fla_reports_a_bad_source_in_one_line(tmp_path, capsys):
    assert main(["convert-fla", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "linattn: error:" in capsys.readouterr().err
