"""Studies: grid expansion, best-over-lr aggregation, resumable runs, reports, the shortconv presets."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
import yaml

from linattn.experiments import Study, aggregate, cli_run, run_study, shortconv_study
from linattn.experiments.report import Cell
from linattn.experiments.shortconv import CONV_PLACEMENTS, FULL_MIXERS, conclusion

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_study(**kw) -> dict:
    d = {
        "name": "tiny",
        "base": {"task": {"name": "mqar", "vocab": 16, "seq_len": 16, "num_kv_pairs": 2},
                 "model": {"mixer": "gla", "d_model": 16, "n_layers": 1, "n_heads": 1, "mlp": False},
                 "train": {"max_steps": 6, "batch_size": 8, "warmup_steps": 2, "eval_every": 3,
                           "log_every": 3, "device": "cpu"},
                 "eval_examples": 32},
        "axes": {"conv": {"none": {"model.mixer_kwargs.short_conv": ""},
                          "k": {"model.mixer_kwargs.short_conv": "k"}}},
        "seeds": [0, 1],
        "lrs": [1e-3, 3e-3],
        "report": {"cols": "conv"},
    }
    d.update(kw)
    return d


def test_grid_expansion_overrides_and_exclude():
    study = Study.from_dict(_tiny_study(
        axes={"conv": {"none": {"model.mixer_kwargs.short_conv": ""}, "k": {"model.mixer_kwargs.short_conv": "k"}},
              "width": {"path": "model.d_model", "values": [16, 32]}},
        exclude=[{"conv": "none", "width": "32"}]))
    runs = study.runs()
    assert len(runs) == 3 * 2 * 2
    settings = {r.labels for r in runs}
    assert (("conv", "none"), ("width", "32")) not in settings
    r = next(r for r in runs if dict(r.labels) == {"conv": "k", "width": "32"} and r.seed == 1 and r.lr == 3e-3)
    assert r.config["model"]["d_model"] == 32 and r.config["model"]["mixer_kwargs"]["short_conv"] == "k"
    assert r.config["train"]["lr"] == 3e-3 and r.config["seed"] == 1
    assert study.base["model"].get("d_model") == 16, "the base is not mutated"
    assert len({r.run_id for r in runs}) == len(runs)


@pytest.mark.parametrize("change, match", [
    ({"bogus": 1}, "unknown study key"),
    ({"seeds": []}, "non-empty"),
    ({"name": "a/b"}, "file-safe"),
    ({"exclude": [{"nope": "x"}]}, "unknown axes"),
    ({"axes": {"conv": ["k"]}}, "must map labels"),
    ({"base": {"task": {"name": "mqar"}, "model": {}, "extra": 1}}, "unknown run config"),
])
def test_bad_study_definitions(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Study.from_dict(_tiny_study(**change))


def test_best_over_lr_aggregation():
    rows = [{"conv": "k", "lr": 1e-3, "seed": 0, "accuracy": 0.2, "status": "finished"},
            {"conv": "k", "lr": 1e-3, "seed": 1, "accuracy": 0.4, "status": "finished"},
            {"conv": "k", "lr": 3e-3, "seed": 0, "accuracy": 0.5, "status": "finished"},
            {"conv": "k", "lr": 3e-3, "seed": 1, "accuracy": 0.99, "status": "diverged"}]
    (cell,) = aggregate(rows, ["conv"], "accuracy")
    assert cell.best_lr == 1e-3 and cell.mean == pytest.approx(0.3) and cell.n == 2
    assert cell.std == pytest.approx(0.1414213562) and cell.by_lr[3e-3] == pytest.approx(0.25), "diverged = 0"
    (low,) = aggregate([{**r, "loss": 1.0 - r["accuracy"]} for r in rows], ["conv"], "loss")
    assert low.best_lr == 1e-3 and low.mean == pytest.approx(0.7), "losses: lower is better, diverged = inf"


def test_study_runs_resumes_and_reports(tmp_path):
    study = Study.from_dict(_tiny_study(lrs=[3e-3]))
    out = run_study(study, tmp_path, workers=1, progress=False, time_budget_s=0)
    assert out.finished == 0 and out.pending == 4 and not out.complete
    out = run_study(study, tmp_path, resume=True, workers=1, progress=False)
    assert out.complete and out.finished == 4
    sdir = out.study_dir
    assert sdir.parent == tmp_path / "tiny" and len(list((tmp_path / "tiny").iterdir())) == 1
    rows = list(csv.DictReader(open(sdir / "results.csv")))
    assert len(rows) == 4 and {"conv", "seed", "lr", "accuracy", "step", "wall_s", "status"} <= set(rows[0])
    report = (sdir / "report.md").read_text()
    assert "|  | conv: none | k |" in report.replace("conv: k | none", "conv: none | k")
    assert "best lr" in report and "![all runs](heatmap.png)" in report and (sdir / "heatmap.png").stat().st_size > 0
    saved = yaml.safe_load((sdir / "config.yaml").read_text())
    assert saved["fingerprint"] == study.fingerprint()
    stamp = {p: p.stat().st_mtime_ns for p in sdir.glob("runs/*/result.json")}
    out2 = run_study(study, tmp_path, resume=True, workers=1, progress=False)
    assert out2.study_dir == sdir and out2.complete
    assert stamp == {p: p.stat().st_mtime_ns for p in sdir.glob("runs/*/result.json")}, "finished runs skipped"
    with pytest.raises(ValueError, match="different definition"):
        run_study(Study.from_dict(_tiny_study(seeds=[0])), tmp_path, resume=True, workers=1, progress=False)


def test_resume_with_more_seeds_keeps_the_finished_runs(tmp_path):
    """--resume --seeds with the saved seeds and more: the study grows, the finished runs stay, only the new seeds'
    runs are trained; fewer seeds, or other seeds, are a different definition."""
    one = Study.from_dict(_tiny_study(seeds=[0], lrs=[3e-3]))
    sdir = run_study(one, tmp_path, workers=1, progress=False).study_dir
    stamp = {p: p.stat().st_mtime_ns for p in sdir.glob("runs/*/result.json")}
    assert len(stamp) == 2
    for other in ([1], [1, 2]):
        with pytest.raises(ValueError, match="different definition"):
            run_study(one.with_seeds(other), tmp_path, resume=True, workers=1, progress=False)
    two = one.with_seeds([0, 1])
    out = run_study(two, tmp_path, resume=True, workers=1, progress=False)
    assert out.study_dir == sdir and out.complete and out.finished == 4
    assert stamp == {p: p.stat().st_mtime_ns for p in stamp}, "seed 0's runs were not run again"
    assert yaml.safe_load((sdir / "config.yaml").read_text())["fingerprint"] == two.fingerprint()
    assert run_study(two, tmp_path, resume=True, workers=1, progress=False).study_dir == sdir


def test_resume_with_another_axis_value_keeps_the_finished_runs(tmp_path):
    """A value added to an axis (a mixer, say) extends the study like a seed does; a changed setting of the
    existing runs does not."""
    study = Study.from_dict(_tiny_study(seeds=[0], lrs=[3e-3]))
    sdir = run_study(study, tmp_path, workers=1, progress=False).study_dir
    stamp = {p: p.stat().st_mtime_ns for p in sdir.glob("runs/*/result.json")}
    changed = study.to_dict()
    changed["base"] = {**changed["base"], "train": {**changed["base"]["train"], "max_steps": 7}}
    with pytest.raises(ValueError, match="different definition"):
        run_study(Study.from_dict(changed), tmp_path, resume=True, workers=1, progress=False)
    wider = study.to_dict()
    axis, values = next(iter(wider["axes"].items()))
    extra = {**values, "extra": dict(next(iter(values.values())))}
    wider["axes"] = {**wider["axes"], axis: extra}
    out = run_study(Study.from_dict(wider), tmp_path, resume=True, workers=1, progress=False)
    assert out.study_dir == sdir and out.complete and out.finished == 3
    assert stamp == {p: p.stat().st_mtime_ns for p in stamp}, "the saved runs were not run again"


def test_runs_go_seed_by_seed(tmp_path, monkeypatch):
    """Every run of seed 0 before any of seed 1: an invocation stopped early leaves whole comparisons."""
    import linattn.experiments.runner as runner

    order = []
    monkeypatch.setattr(runner, "execute_run", lambda spec, *a: order.append(spec.run_id) or
                        {"run_id": spec.run_id, "status": "skipped"})
    study = Study.from_dict(_tiny_study(lrs=[3e-3]))
    run_study(study, tmp_path, workers=1, progress=False)
    grid = [s.run_id for s in study.runs()]
    assert sorted(order) == sorted(grid) and order != grid  # the grid lists a setting's seeds together
    assert [r.split("_s")[-1][0] for r in order] == ["0", "0", "1", "1"]


def test_rerun_reproduces_numbers_on_cpu(tmp_path):
    study = Study.from_dict(_tiny_study(seeds=[3], lrs=[3e-3]))
    a = run_study(study, tmp_path / "a", workers=1, progress=False).study_dir
    b = run_study(study, tmp_path / "b", workers=1, progress=False).study_dir
    for p in a.glob("runs/*/result.json"):
        ra, rb = json.loads(p.read_text()), json.loads((b / p.relative_to(a)).read_text())
        assert ra["accuracy"] == rb["accuracy"] and ra["loss"] == rb["loss"]


def test_cli_run_with_a_yaml_study(tmp_path, capsys):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(_tiny_study(seeds=[0], lrs=[1e-3])))
    args = argparse.Namespace(study=str(path), preset=None, device="cpu", out=str(tmp_path / "runs"),
                              resume=False, workers=1, max_minutes=None)
    assert cli_run(args) == 0
    assert "2 runs finished, 0 left" in capsys.readouterr().out
    with pytest.raises(ValueError, match="study must be one of"):
        cli_run(argparse.Namespace(**{**vars(args), "study": "nope"}))
    with pytest.raises(ValueError, match="--threads: expected an int >= 1, got 0"):
        cli_run(argparse.Namespace(**{**vars(args), "threads": 0}))
    with pytest.raises(ValueError, match="--preset: a study file has no presets"):
        cli_run(argparse.Namespace(**{**vars(args), "preset": "smoke"}))
    out = tmp_path / "runs1"
    assert cli_run(argparse.Namespace(**{**vars(args), "threads": 1, "out": str(out), "seeds": "0,1"})) == 0
    assert len(list(out.glob("*/*/runs/*/result.json"))) == 4, "--seeds replaces the study's seeds"


def test_shortconv_presets_cover_the_placements_and_controls():
    full = shortconv_study("full")
    assert set(FULL_MIXERS) <= set(full.axes["mixer"])
    assert list(full.axes["conv"]) == list(CONV_PLACEMENTS) == ["none", "q", "k", "v", "qk", "kv", "qkv",
                                                                "shift-k", "identity-k"]
    assert set(full.axes["task"]) == {"recall", "stacked"} and set(full.axes["tie_kv"]) == {"no", "yes"}
    assert set(full.axes["layers"]) == {"1", "2"} and len(full.axes["width"]) >= 2 and len(full.seeds) >= 2
    shift = next(r for r in full.runs() if dict(r.labels)["conv"] == "shift-k")
    assert shift.config["model"]["mixer_kwargs"] == {"short_conv": "k", "conv_mode": "shift", "tie_kv": False}
    smoke = shortconv_study("smoke")
    assert {"none", "k"} <= set(smoke.axes["conv"]) and len(smoke.runs()) <= 60
    with pytest.raises(ValueError, match="preset"):
        shortconv_study("huge")


def test_conclusion_is_computed_from_the_numbers():
    study = Study.from_dict(_tiny_study(axes={
        "task": {"recall": {"task.name": "mqar"}, "stacked": {"task.name": "stacked_mqar"}},
        "mixer": {"gla": {}, "mesa_net": {}},
        "tie_kv": {"no": {}, "yes": {}},
        "conv": {c: {} for c in ("none", "q", "k", "v")}}))
    score = {("recall", "none"): 0.1, ("recall", "q"): 0.15, ("recall", "k"): 0.9, ("recall", "v"): 0.2,
             ("stacked", "none"): 0.8, ("stacked", "q"): 0.8, ("stacked", "k"): 0.81, ("stacked", "v"): 0.79}
    cells = [Cell({"task": t, "mixer": m, "tie_kv": tie, "conv": c}, 1e-3, score[t, c], 0.05, 2, {})
             for t in ("recall", "stacked") for m in ("gla", "mesa_net") for tie in ("no", "yes")
             for c in ("none", "q", "k", "v")]
    text = conclusion(study, cells)
    assert "**recall**: best placement `k` (0.900" in text and "by 0.700, which exceeds" in text
    assert "(k helps most)" in text
    assert "none of q, k, v alone beats no conv beyond the seed noise" in text.split("**stacked**")[1]
    assert "**stacked**: best placement `k` (0.810" in text and "by 0.010, which does not exceed" in text
    assert "mesa_net 0.10 -> 0.90" in text
