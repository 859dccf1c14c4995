"""Run configs: `linattn train CONFIG.yaml` builds the task, model and Trainer, trains, resumes."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from linattn.experiments.runs import cli_train
from linattn.train.build import build_run, check_run_config

CONFIG = {
    "task": {"name": "mqar", "vocab": 16, "seq_len": 16, "num_kv_pairs": 2},
    "model": {"mixer": "gla", "d_model": 16, "n_layers": 1, "n_heads": 1, "mlp": False,
              "mixer_kwargs": {"short_conv": "k"}},
    "train": {"max_steps": 4, "batch_size": 8, "warmup_steps": 1, "eval_every": 2, "progress": False},
    "seed": 1,
    "eval_examples": 16,
}


pytestmark = pytest.mark.usefixtures("one_thread")


def test_cli_train_writes_results_and_resumes(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "out_dir": str(tmp_path / "run")}))
    assert cli_train(path, device="cpu") == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["status"] == "completed" and first["step"] == 4
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["metrics"]["accuracy"] == first["accuracy"] and result["num_params"] > 0
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["seed"] == 1
    assert cli_train(path, device="cpu") == 0, "a finished run resumes to the same result"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == first


def test_build_run_uses_task_vocab_and_seed():
    a, b = build_run(CONFIG, device="cpu"), build_run(CONFIG, device="cpu")
    assert a.trainer.model.config.vocab_size == 16
    for pa, pb in zip(a.trainer.model.parameters(), b.trainer.model.parameters()):
        assert torch.equal(pa, pb)
    c = build_run({**CONFIG, "seed": 2}, device="cpu")
    assert not torch.equal(next(a.trainer.model.parameters()), next(c.trainer.model.parameters()))


@pytest.mark.parametrize("config, exc, match", [
    ({**CONFIG, "modle": {}}, ValueError, "unknown run config key"),
    ({"task": {"name": "mqar"}}, ValueError, "'model' mapping"),
    ({**CONFIG, "task": {"vocab": 16}}, ValueError, "needs a 'name'"),
    ([1, 2], TypeError, "mapping"),
])
def test_bad_run_configs(config, exc, match):
    with pytest.raises(exc, match=match):
        check_run_config(config)


def test_model_vocab_too_small():
    with pytest.raises(ValueError, match="vocab_size"):
        build_run({**CONFIG, "model": {**CONFIG["model"], "vocab_size": 8}}, device="cpu")
