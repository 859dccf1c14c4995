"""Named errors of the training side: config fields checked strictly when read, checkpoints verified by
their checksum, and resume refused under a changed config unless overridden."""

from __future__ import annotations

import warnings

import pytest
import torch
import yaml
from test_trainer import ShiftSum, TinyLM

from linattn.errors import CheckpointError, ConfigError, MissingFileError, ResumeError, UserError
from linattn.experiments.runs import cli_train
from linattn.models import ModelConfig
from linattn.train import TrainConfig, Trainer, load_checkpoint
from linattn.train.checkpoint import MAGIC, UncheckedCheckpointWarning

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(max_steps=6, batch_size=8, lr=3e-3, warmup_steps=2, eval_every=3, log_every=3, progress=False,
            device="cpu", seed=0)


def _trainer(out_dir, override: bool = False, **changes) -> Trainer:
    torch.manual_seed(0)
    return Trainer(TinyLM(), ShiftSum(batch_size=8), TrainConfig(**{**BASE, **changes}), out_dir=out_dir,
                   override_config=override)


# -- config fields ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, match", [
    ("betas", 0.9, r"betas: expected a pair \[a, b\] of numbers in \[0, 1\), got 0.9"),
    ("betas", [0.9, 1.0], r"betas: expected a pair"),
    ("target_value", "high", r"target_value: expected a finite number in \[0, 1\], got 'high' \(str\)"),
    ("device", "gpu", r"device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu' \(str\)"),
    ("progress", "no", r"progress: expected true or false, got 'no' \(str\)"),
    ("tensorboard", 1, r"tensorboard: expected true or false, got 1"),
    ("lr", "1e-3", r"lr: expected a finite number > 0 \(YAML reads 1e-3 without a dot as text"),
    ("lr", float("nan"), r"lr: expected a finite number > 0, got nan"),
    ("max_steps", True, r"max_steps: expected an int >= 1, got True \(bool\)"),
    ("eval_every", 1.5, r"eval_every: expected an int >= 1, got 1.5"),
    ("min_lr_ratio", 2, r"min_lr_ratio: expected a finite number in \[0, 1\], got 2"),
    ("target_metric", "f1", r"target_metric: expected one of 'loss', 'accuracy', 'seq_accuracy', got 'f1'"),
    ("precision", "fp8", r"precision: expected one of 'auto', 'bf16', 'fp32'"),
    ("compile", "fastest", r"compile: expected one of 'off', 'default', 'reduce-overhead'"),
])
def test_train_config_fields_are_checked_strictly(field, value, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**{field: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"device: 'cuda' needs a CUDA GPU, but CUDA is not available here"):
        TrainConfig(device="cuda")


@pytest.mark.parametrize("field, value, match", [
    ("norm_eps", -1, r"norm_eps: expected a finite number > 0, got -1"),
    ("norm_eps", float("inf"), r"norm_eps: expected a finite number > 0, got inf"),
    ("mlp_hidden", True, r"mlp_hidden: expected an int >= 1, got True \(bool\)"),
    ("mlp", "yes", r"mlp: expected true or false, got 'yes' \(str\)"),
    ("tie_embeddings", 0, r"tie_embeddings: expected true or false, got 0"),
    ("d_model", True, r"d_model: expected an int >= 1, got True \(bool\)"),
    ("mixer_kwargs", ["k"], r"mixer_kwargs: expected a mapping"),
])
def test_model_config_fields_are_checked_strictly(field, value, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{"mixer": "gla", field: value})


def test_model_config_yaml_errors(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("mixer: gla\nnorm_eps: -1.0\n")
    with pytest.raises(ConfigError, match=rf"^{path}: norm_eps: expected a finite number > 0, got -1.0$"):
        ModelConfig.from_yaml(path)
    path.write_text("mixer: [gla\n")
    with pytest.raises(ConfigError, match=rf"^{path}: invalid YAML at line 2"):
        ModelConfig.from_yaml(path)
    with pytest.raises(ConfigError, match=r"^invalid YAML at line 2, column 8"):
        ModelConfig.from_yaml("mixer: [gla\nd_model: 3")


def test_errors_are_user_errors_and_keep_their_builtin_types():
    with pytest.raises(UserError):
        TrainConfig(lr=-1)
    with pytest.raises(ValueError):
        TrainConfig(lr=-1)
    with pytest.raises(TypeError):
        TrainConfig(lr="x")


# -- run config files ------------------------------------------------------------------------------------
RUN = {"task": {"name": "mqar", "vocab": 16, "seq_len": 16, "num_kv_pairs": 2},
       "model": {"mixer": "gla", "d_model": 16, "n_layers": 1, "n_heads": 2, "mlp": False},
       "train": {"max_steps": 4, "batch_size": 8, "lr": 0.003, "eval_every": 2, "log_every": 2, "warmup_steps": 1,
                 "eval_batch_size": 16, "progress": False},
       "eval_examples": 16}


def _write(path, config) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("section, changes, match", [
    ("train", {"betas": 0.9}, r"run\.yaml: train\.betas: expected a pair"),
    ("train", {"target_value": "high"}, r"run\.yaml: train\.target_value: expected a finite number"),
    ("model", {"norm_eps": -1}, r"run\.yaml: model\.norm_eps: expected a finite number > 0, got -1"),
    ("task", {"vocab": "many"}, r"run\.yaml: task: vocab must be an int"),
    ("task", {"colour": 3}, r"run\.yaml: task: .*colour"),
    ("task", {"random_non_queries": "no"}, r"run\.yaml: task\.random_non_queries: expected true or false, got 'no'"),
])
def test_run_config_errors_name_the_file_and_the_field(tmp_path, section, changes, match):
    config = {**RUN, section: {**RUN[section], **changes}}
    with pytest.raises(ConfigError, match=match):
        cli_train(_write(tmp_path / "run.yaml", config), out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists(), "refused before any file is written"


def test_run_config_top_level_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.yaml: seed: expected an int >= 0, got 'abc' \(str\)"):
        cli_train(_write(tmp_path / "run.yaml", {**RUN, "seed": "abc"}), out_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match=r"run\.yaml: eval_examples: expected an int >= 1, got 0"):
        cli_train(_write(tmp_path / "run.yaml", {**RUN, "eval_examples": 0}), out_dir=tmp_path / "out")


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("task: {name: mqar\nmodel: [\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: invalid YAML at line \d+, column \d+: ") as info:
        cli_train(str(path))
    assert "<unicode string>" not in str(info.value) and "\n" not in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(MissingFileError, match=r"run config .*nope\.yaml does not exist"):
        cli_train(str(tmp_path / "nope.yaml"))


def test_bad_device_flag_is_named_as_a_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^--device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        cli_train(_write(tmp_path / "run.yaml", RUN), device="gpu", out_dir=tmp_path / "out")


# -- resume under a changed config -----------------------------------------------------------------------
def test_resume_with_a_changed_config_is_refused(tmp_path):
    _trainer(tmp_path, max_steps=3).fit()
    with pytest.raises(ResumeError, match=r"checkpoint .*checkpoint\.pt was written with a different config \("
                                          r"train\.lr: 0\.003 -> 0\.5; train\.max_steps: 3 -> 6\).*--override-config"):
        _trainer(tmp_path, lr=0.5).fit()
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 3, "a refused resume changes nothing"


def test_resume_may_change_device_and_progress(tmp_path):
    _trainer(tmp_path, max_steps=3).fit()
    assert _trainer(tmp_path, max_steps=3, device="auto", progress=True).fit().step == 3


def test_override_config_applies_and_reports_the_new_values(tmp_path, capsys):
    _trainer(tmp_path, max_steps=3).fit()
    trainer = _trainer(tmp_path, override=True, lr=0.5, betas=(0.8, 0.9))
    result = trainer.fit()
    assert result.status == "completed" and result.step == 6
    err = capsys.readouterr().err
    assert "with the config overridden: train.betas: [0.9, 0.98] -> [0.8, 0.9]; train.lr: 0.003 -> 0.5" in err
    assert trainer.scheduler.base_lrs == [0.5, 0.5]
    assert all(g["betas"] == (0.8, 0.9) for g in trainer.optimizer.param_groups)
    assert load_checkpoint(tmp_path / "checkpoint.pt")["config"]["lr"] == 0.5, "the next resume compares to it"


def test_run_config_changes_are_refused_then_overridden(tmp_path, capsys):
    path = _write(tmp_path / "run.yaml", RUN)
    cli_train(path, out_dir=tmp_path / "out")
    changed = {**RUN, "train": {**RUN["train"], "lr": 0.5, "max_steps": 6}, "eval_examples": 32}
    _write(tmp_path / "run.yaml", changed)
    with pytest.raises(ResumeError, match=r"eval_examples: 16 -> 32; train\.lr: 0\.003 -> 0\.5"):
        cli_train(path, out_dir=tmp_path / "out")
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["train"]["lr"] == 0.003
    capsys.readouterr()
    assert cli_train(path, out_dir=tmp_path / "out", override_config=True) == 0
    assert "eval_examples: 16 -> 32; train.lr: 0.003 -> 0.5; train.max_steps: 4 -> 6" in capsys.readouterr().err
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["train"]["lr"] == 0.5


# -- checksums -------------------------------------------------------------------------------------------
def _flip(path, start: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_bytes_are_caught_by_the_checksum(tmp_path):
    _trainer(tmp_path, max_steps=3).fit()
    path = tmp_path / "checkpoint.pt"
    assert path.read_bytes().startswith(MAGIC)
    _flip(path, path.stat().st_size // 2, 256)
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is corrupt: sha256 of its payload"):
        _trainer(tmp_path).fit()
    with pytest.raises(CheckpointError, match="is corrupt: sha256"):
        load_checkpoint(path)


def test_damaged_header_and_truncation(tmp_path):
    _trainer(tmp_path, max_steps=3).fit()
    path = tmp_path / "checkpoint.pt"
    good = path.read_bytes()
    _flip(path, 30, 1)  # inside the header's digest
    with pytest.raises(CheckpointError, match="damaged header|is corrupt: sha256"):
        load_checkpoint(path)
    path.write_bytes(good[:-100])
    with pytest.raises(CheckpointError, match=r"corrupt or truncated: its header says \d+ payload bytes"):
        load_checkpoint(path)


def test_format_1_checkpoint_loads_with_a_warning_and_is_rewritten(tmp_path):
    assert _trainer(tmp_path).fit(deadline=0.0).status == "interrupted"
    path = tmp_path / "checkpoint.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        payload = load_checkpoint(path)
    torch.save({**payload, "format_version": 1}, path)  # what linattn wrote before checksums
    with pytest.warns(UncheckedCheckpointWarning, match="before checkpoints carried a checksum"):
        assert load_checkpoint(path)["step"] == 1
    with pytest.warns(UncheckedCheckpointWarning):
        assert _trainer(tmp_path).fit().step == 6
    assert path.read_bytes().startswith(MAGIC)
