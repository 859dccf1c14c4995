"""The command line's error contract: a user error is one line on stderr and exit code 2, a bug keeps its
traceback, ``--debug`` shows the traceback of everything; plus the CLI-level cases (resume, study files,
devices, changed configs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml
from test_errors_train import RUN
from test_experiments import _tiny_study

from linattn import cli
from linattn.errors import ConfigError, MissingFileError, ResumeError
from linattn.experiments import Study
from linattn.experiments.runner import find_study_dir

pytestmark = pytest.mark.usefixtures("one_thread")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def _user_error(capsys, argv: list[str]) -> str:
    """Run ``linattn argv``; it must fail as a user error: exit 2, one line, no traceback. Returns the line."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("linattn: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_resume_with_nothing_to_resume(tmp_path, capsys):
    err = _user_error(capsys, ["run", "shortconv", "--resume", "--out", str(tmp_path)])
    assert "--resume: nothing to resume: no earlier run of study 'shortconv' under" in err
    assert not (tmp_path / "shortconv").exists(), "no new study was started"


def test_lra_resume_with_nothing_to_resume_fails_before_the_budget_probe(tmp_path, capsys):
    err = _user_error(capsys, ["run", "lra", "--resume", "--run-minutes", "1", "--out", str(tmp_path)])
    assert "nothing to resume: no earlier run of study 'lra'" in err
    assert not any(tmp_path.iterdir()), "no probe ran"


def test_missing_study_file(tmp_path, capsys):
    err = _user_error(capsys, ["run", str(tmp_path / "missing.yaml")])
    assert f"study file {tmp_path / 'missing.yaml'} does not exist" in err


def test_study_file_errors_name_the_file_and_field(tmp_path, capsys):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(_tiny_study(lrs=["1e-3"])))
    err = _user_error(capsys, ["run", str(path), "--out", str(tmp_path)])
    assert f"{path}: lrs[0]: expected a finite number > 0 (YAML reads 1e-3 without a dot as text" in err
    path.write_text(yaml.safe_dump(_tiny_study(base={**_tiny_study()["base"], "train": {"betas": 0.9}})))
    assert f"{path}: train.betas: expected a pair" in _user_error(capsys, ["run", str(path), "--out", str(tmp_path)])


def test_changed_study_definition_lists_the_differences(tmp_path):
    find_study_dir(Study.from_dict(_tiny_study()), tmp_path, resume=False)
    with pytest.raises(ResumeError, match=r"different definition of study 'tiny' \(another preset or edited "
                                          r"settings: seeds: \[0, 1\] -> \[0\]\)"):
        find_study_dir(Study.from_dict(_tiny_study(seeds=[0])), tmp_path, resume=True)


@pytest.mark.parametrize("argv, match", [
    (["run", "shortconv", "--threads", "0"], "--threads: expected an int >= 1, got 0"),
    (["run", "shortconv", "--device", "gpu"], "--device: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    (["run", "nope"], "study must be one of ['lm', 'lra', 'shortconv'] or a study .yaml file, got 'nope'"),
    (["bench", "decode", "--mixers", "gdn"], "--mixers: unknown mixer(s) ['gdn']"),
    (["bench", "ops", "--lengths", "2048,x"], "--lengths: expected a comma list of ints >= 1, got '2048,x'"),
])
def test_bad_flags(capsys, argv, match):
    assert match in _user_error(capsys, argv)


@no_cuda
@pytest.mark.parametrize("argv", [["bench", "ops", "--device", "cuda"], ["bench", "decode", "--device", "cuda"]])
def test_cuda_without_cuda(capsys, argv):
    err = _user_error(capsys, argv)
    assert "--device: 'cuda' needs a CUDA GPU, but CUDA is not available here" in err
    assert "Torch not compiled" not in err


def test_yaml_syntax_error(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train: {lr: 0.1\n")
    assert f"{path}: invalid YAML at line 2, column 1" in _user_error(capsys, ["train", str(path)])


def test_train_refuses_a_changed_config_then_overrides_it(tmp_path, capsys):
    path, out = tmp_path / "run.yaml", str(tmp_path / "out")
    path.write_text(yaml.safe_dump(RUN))
    assert cli.main(["train", str(path), "--out", out]) == 0
    path.write_text(yaml.safe_dump({**RUN, "train": {**RUN["train"], "lr": 0.5}}))
    capsys.readouterr()
    err = _user_error(capsys, ["train", str(path), "--out", out])
    assert "was written with a different config (train.lr: 0.003 -> 0.5)" in err and "--override-config" in err
    assert cli.main(["train", str(path), "--out", out, "--override-config"]) == 0
    assert "with the config overridden: train.lr: 0.003 -> 0.5" in capsys.readouterr().err


def _corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 256):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_train_refuses_a_corrupt_checkpoint_naming_the_file(tmp_path, capsys):
    path, out = tmp_path / "run.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(RUN))
    assert cli.main(["train", str(path), "--out", str(out)]) == 0
    _corrupt(out / "checkpoint.pt")
    capsys.readouterr()
    err = _user_error(capsys, ["train", str(path), "--out", str(out)])
    assert f"checkpoint {out / 'checkpoint.pt'} is corrupt: sha256 of its payload" in err


def test_real_process_refuses_a_changed_config_and_a_corrupt_checkpoint(tmp_path):
    """What a user sees: exit code 2 and one line naming the change, then the file."""
    path, out = tmp_path / "run.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(RUN))
    assert cli.main(["train", str(path), "--out", str(out)]) == 0
    path.write_text(yaml.safe_dump({**RUN, "train": {**RUN["train"], "lr": 0.5}}))
    cmd = [sys.executable, "-m", "linattn.cli", "train", str(path), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "was written with a different config (train.lr: 0.003 -> 0.5)" in proc.stderr
    path.write_text(yaml.safe_dump(RUN))
    _corrupt(out / "checkpoint.pt")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"checkpoint {out / 'checkpoint.pt'} is corrupt" in proc.stderr


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(MissingFileError):
        cli.main(["--debug", "run", str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError):
        cli.main(["run", "nope", "--debug"])


def test_bugs_keep_their_traceback(monkeypatch):
    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_cmd_list", broken)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["list"])


def test_data_command_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["data", "pathfinder", "--out", str(tmp_path / "pf"), "--batches", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "linattn data pathfinder: error: argument --batches: expected an int >= 1, got '0'" in err
    assert not (tmp_path / "pf").exists()


def test_real_process_exit_code_and_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "linattn.cli", "run", str(tmp_path / "missing.yaml")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("linattn: error: study file ")
