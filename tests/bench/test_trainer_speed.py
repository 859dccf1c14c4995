"""``python -m linattn.bench.trainer_speed`` at a tiny size on the CPU (function, not timing)."""

import json

import pytest

from linattn.bench import trainer_speed
from linattn.models import ModelConfig
from linattn.train import Trainer


def test_both_checks_train_and_report(tmp_path, monkeypatch):
    seen = []
    original = Trainer._checks_on_device
    monkeypatch.setattr(Trainer, "_checks_on_device", lambda self: seen.append(original(self)) or seen[-1])
    out = tmp_path / "speed.json"
    trainer_speed.main(["--mixers", "gla", "--shape", "2x16", "--steps", "15", "--device", "cpu", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mixer"], r["checks"]) for r in rows] == [("gla", "late"), ("gla", "at-once")]
    assert all(r["tokens_per_s"] > 0 and (r["batch"], r["seq_len"]) == (2, 16) for r in rows)
    assert seen == [True] * 15 + [False] * 15  # each Trainer read its steps' values as its row says


def test_bad_arguments():
    config = ModelConfig(mixer="gla", d_model=32, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match="checks must be one of late, at-once, got 'never'"):
        trainer_speed.trainer_tokens_per_s(config, 2, 16, 15, "never", "cpu")
    with pytest.raises(ValueError, match="steps must be at least 3 \\* log_every = 15, got 10"):
        trainer_speed.trainer_tokens_per_s(config, 2, 16, 10, "late", "cpu")
