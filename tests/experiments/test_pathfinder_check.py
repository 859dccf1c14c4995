"""The Pathfinder check command: it audits labels against the images (exit code 1 on a mismatch) and trains
the CNN through LRABatches and the Trainer; slow: the CNN learns generated images well above chance."""

import json

import pytest

from linattn.experiments.pathfinder_check import main


def _run(capsys, *args):
    code = main([*args])
    return code, json.loads(capsys.readouterr().out)


def test_generates_audits_and_trains(tmp_path, capsys):
    code, out = _run(capsys, "--data-dir", str(tmp_path), "--difficulty", "curv_baseline", "--generate", "500",
                     "--workers", "1", "--steps", "4", "--batch-size", "8", "--width", "2")
    assert code == 0
    assert {s: out["audit"][s]["checked"] for s in ("train", "val", "test")} == {"train": 400, "val": 50, "test": 50}
    assert all(out["audit"][s]["mismatches"] == 0 for s in out["audit"])
    assert out["cnn"]["steps"] == 4 and out["cnn"]["train_images"] == 400 and 0 <= out["cnn"]["test_accuracy"] <= 1


def test_a_wrong_label_fails_the_audit(tmp_path, capsys):
    main(["--data-dir", str(tmp_path), "--difficulty", "curv_baseline", "--generate", "500", "--workers", "1",
          "--steps", "1", "--batch-size", "8", "--width", "2", "--audit", "0"])
    capsys.readouterr()
    meta = tmp_path / "pathfinder32" / "curv_baseline" / "metadata" / "0.npy"
    lines = meta.read_text().splitlines()
    f = lines[3].split()
    f[3] = str(1 - int(f[3]))
    lines[3] = " ".join(f)
    meta.write_text("\n".join(lines) + "\n")
    code, out = _run(capsys, "--data-dir", str(tmp_path), "--difficulty", "curv_baseline", "--audit", "10",
                     "--steps", "1", "--batch-size", "8", "--width", "2")
    assert code == 1 and out["audit"]["train"]["first_mismatches"] == [3]


def test_missing_data_without_generate_is_refused(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["--data-dir", str(tmp_path)])
    assert exc.value.code == 2


@pytest.mark.slow
def test_cnn_learns_generated_pathfinder(tmp_path, capsys):
    """4,000 generated images (contour length 6): the CNN reaches >= 70% on the 400 held-out test images."""
    code, out = _run(capsys, "--data-dir", str(tmp_path), "--difficulty", "curv_baseline", "--generate", "4000",
                     "--audit", "200", "--steps", "600")
    assert code == 0
    assert out["cnn"]["test_accuracy"] >= 0.7, out["cnn"]
