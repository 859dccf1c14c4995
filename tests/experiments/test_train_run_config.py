"""``linattn train <run>/config.yaml`` reruns a study's run from the config.yaml the study wrote, whatever
its kind, and ends with the study's numbers (CPU, fixed seed): a shortconv, an lra and an lm run, tiny presets."""

from __future__ import annotations

import json

import pytest
import yaml
from test_lra_budget import TINY_SMOKE  # the lra smoke preset shrunk to seconds

from linattn.cli import main
from linattn.experiments import lm, lra, runner, shortconv
from linattn.experiments.runs import RUN_KINDS, check_config, run_kind

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_SHORTCONV = {
    "base": shortconv._base(vocab=16, seq_len=16, pairs=2, steps=6, batch=8, eval_every=3, eval_examples=32),
    "axes": shortconv._axes(["gla"], ["k"], ["no"], [16], [1]),
    "seeds": [0],
    "lrs": [3e-3],
}
TINY_LRA = {**TINY_SMOKE, "task": {**TINY_SMOKE["task"], "pretrain_steps": 3},
            "train": {**TINY_SMOKE["train"], "max_steps": 6, "warmup_steps": 2, "eval_every": 3, "log_every": 3}}


def _rerun(study: str, tmp_path, capsys, flags: list[str]) -> tuple[dict, dict, dict]:
    """Run the study through ``linattn run``; then ``linattn train`` its first run's config.yaml into a new
    folder. Returns (the run's config.yaml, the study's result.json, the metrics ``linattn train`` printed)."""
    assert main(["run", study, "--preset", "smoke", "--workers", "1", "--out", str(tmp_path / "runs"), *flags]) == 0
    run_dir = sorted((tmp_path / "runs" / study).glob("*/runs/*"))[0]
    capsys.readouterr()
    assert main(["train", str(run_dir / "config.yaml"), "--out", str(tmp_path / "again")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return config, json.loads((run_dir / runner.RESULT_NAME).read_text()), printed


def test_train_reruns_a_shortconv_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(shortconv.PRESETS, "smoke", TINY_SHORTCONV)
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 1)  # one torch thread in the study, as in linattn train
    config, study_result, printed = _rerun("shortconv", tmp_path, capsys, [])
    assert config["kind"] == "synthetic", "the run's config.yaml says what it is"
    assert printed["status"] == "completed" and printed["step"] == study_result["step"] == 6
    for key in ("loss", "accuracy", "seq_accuracy"):
        assert printed[key] == study_result[key], key


def test_train_reruns_an_lra_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(lra.PRESETS, "smoke", TINY_LRA)
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 1)
    config, study_result, printed = _rerun("lra", tmp_path, capsys, ["--spt", "causal"])
    assert config["kind"] == "lra" and config["task"]["name"] == "listops" and config["task"]["spt"] == "causal"
    assert printed["step"] == study_result["step"] == 6 and printed["pretrain_steps"] == 3
    assert (tmp_path / "again" / "pretrain" / "checkpoint.pt").is_file(), "pretrained, then fine-tuned"
    for key in ("loss", "accuracy", "test_loss", "test_accuracy", "pretrain_loss"):
        assert printed[key] == study_result[key], key


def test_train_reruns_an_lm_run(tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "corpus"
    for i in range(30):
        (corpus / f"d{i:02d}.txt").parent.mkdir(parents=True, exist_ok=True)
        (corpus / f"d{i:02d}.txt").write_text(f"text file {i}: " + "the quick brown fox " * (3 + i % 5))
    smoke = lm.PRESETS["smoke"]
    tiny = {**smoke, "mixers": ["gated_delta_rule"], "convs": ["k"], "exclude": [], "seeds": [0],
            "base": {**smoke["base"],
                     "task": {**smoke["base"]["task"], "root": str(corpus), "val_fraction": 0.2, "test_fraction": 0.2,
                              "seq_len": 16, "eval_windows": 4, "test_windows": 4},
                     "model": {**smoke["base"]["model"], "d_model": 16, "n_layers": 1},
                     "train": {**smoke["base"]["train"], "max_steps": 4, "batch_size": 4, "eval_every": 2,
                               "warmup_steps": 1}}}
    monkeypatch.setitem(lm.PRESETS, "smoke", tiny)
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 1)
    config, study_result, printed = _rerun("lm", tmp_path, capsys, [])
    assert config["kind"] == "lm" and config["task"]["root"] == str(corpus)
    assert printed["step"] == study_result["step"] == 4
    for key in ("val_bpb", "test_bpb", "unigram_bpb"):
        assert printed[key] == study_result[key], key


def test_run_kinds_check_their_own_configs():
    assert set(RUN_KINDS) == {"synthetic", "lra", "lm"}
    assert run_kind({"task": {"name": "mqar"}, "model": {"mixer": "gla"}}).name == "synthetic", "the default kind"
    with pytest.raises(ValueError, match=r"kind: must be one of \['lm', 'lra', 'synthetic'\], got 'chess'"):
        check_config({"kind": "chess", "task": {"name": "mqar"}, "model": {"mixer": "gla"}})
    with pytest.raises(ValueError, match="unknown LRA task key"):
        check_config({"kind": "lra", "task": {"name": "listops", "vocab": 3}, "model": {"mixer": "gla"}})


def test_build_run_refuses_another_kind():
    from linattn.train.build import build_run

    with pytest.raises(ValueError, match="kind: build_run builds runs of kind 'synthetic', got 'lra'"):
        build_run({"kind": "lra", "task": {"name": "listops"}, "model": {"mixer": "gla"}})


@pytest.mark.parametrize("argv, message", [
    (["run", "shortconv", "--preset", "h100"], "--preset: study 'shortconv' has presets smoke, full, v2; got 'h100'"),
    (["run", "shortconv", "--tasks", "listops"], "--tasks: is an option of study 'lra', not of 'shortconv'"),
    (["run", "lra", "--preset", "huge"],
     "--preset: study 'lra' has presets smoke, full, h100, paper, budget; got 'huge'"),
    (["run", "lra", "--mixers", "gated_deltanet"], "mixers must be a non-empty list from"),
    (["run", "shortconv", "--seeds", "0,x"], "--seeds: expected a comma list of integers >= 0, got '0,x'"),
])
def test_run_offers_each_study_only_its_own_presets_and_flags(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "refused before any run started"
