"""The LRA study's steps: fitted to a wall-clock budget per run by a timing probe (lra_budget), set per task
(--steps), the seeds and the h100 preset, and ``linattn run lra --run-minutes`` end to end with --resume."""

from __future__ import annotations

import argparse
import json

import pytest

from linattn.experiments import lra, runner
from linattn.experiments.lra import conclusion, lra_study, lra_study_from_args
from linattn.experiments.lra_budget import (
    BUDGET_FILE,
    StepTiming,
    load_budget,
    save_budget,
    seconds_per_step,
    steps_for_budget,
)
from linattn.experiments.lra_run import check_lra_config
from linattn.experiments.report import Cell
from linattn.experiments.runner import RESULT_NAME
from linattn.train.metrics import MetricsLog

pytestmark = pytest.mark.usefixtures("one_thread")


# -- seconds per step from the logged times ---------------------------------------------------------------
def _log(folder, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(folder / "metrics.jsonl")
    for row in rows:
        log.write(row)
    log.close()


def _train(step: int, time: float) -> dict:
    return {"step": step, "split": "train", "loss": 1.0, "grad_norm": 0.5, "lr": 1e-3, "time": time}


def test_seconds_per_step_pools_both_phases_and_skips_the_first_row(tmp_path):
    # pretrain: 15 steps in 3 s after its first row (the 9 s before it are warm-up); fine-tune: 10 steps
    # in 5 s; eval rows (with times) and train rows without a time are not train timings
    _log(tmp_path / "pretrain", [_train(5, 9.0), _train(10, 10.0), _train(15, 11.0), _train(20, 12.0)])
    _log(tmp_path / "finetune", [_train(5, 30.0), {"step": 8, "split": "train", "loss": 1.0}, _train(10, 32.5),
                                 _train(15, 35.0), {"step": 15, "split": "eval", "loss": 2.0, "time": 99.0}])
    assert seconds_per_step(tmp_path) == pytest.approx((3.0 + 5.0) / (15 + 10))


def test_seconds_per_step_of_a_scratch_run_and_of_a_phase_with_one_row(tmp_path):
    _log(tmp_path / "finetune", [_train(5, 1.0), _train(10, 2.0), _train(20, 5.0)])
    assert seconds_per_step(tmp_path) == pytest.approx(4.0 / 15), "no pretrain folder (spt none)"
    _log(tmp_path / "pretrain", [_train(5, 100.0)])
    assert seconds_per_step(tmp_path) == pytest.approx(4.0 / 15), "a phase with one row has no span"


def test_seconds_per_step_leaves_out_the_evaluations(tmp_path):
    # a scratch run's mid-run evaluation lies between the train rows of steps 20 and 25 (the trainer's clock
    # runs on through it); it is part of the fixed cost, so that span is not a training span
    _log(tmp_path / "finetune", [_train(5, 1.0), _train(10, 2.0), _train(20, 4.0),
                                 {"step": 20, "split": "eval", "loss": 2.0, "time": 4.0}, _train(25, 15.0),
                                 _train(40, 18.0), {"step": 40, "split": "eval", "loss": 2.0, "time": 18.0}])
    assert seconds_per_step(tmp_path) == pytest.approx(0.2)


def test_seconds_per_step_needs_two_train_rows(tmp_path):
    with pytest.raises(ValueError, match="fewer than two logged train rows"):
        seconds_per_step(tmp_path)
    _log(tmp_path / "pretrain", [_train(5, 1.0), {"step": 5, "split": "eval", "loss": 1.0, "time": 2.0}])
    _log(tmp_path / "finetune", [_train(5, 3.0)])
    with pytest.raises(ValueError, match=f"{tmp_path}: fewer than two logged train rows in a phase"):
        seconds_per_step(tmp_path)


# -- steps for a budget ---------------------------------------------------------------------------------
def _timing(task: str, per_step: float, fixed: float, mixer: str = "gla", spt: str = "none") -> StepTiming:
    return StepTiming(task, mixer, spt, per_step, fixed, fixed + 40 * per_step)


def test_steps_for_budget_by_hand():
    # 0.75 * 100 s = 75 s; the slowest listops run: 0.25 s/step, 4.25 s fixed -> 70.75 / 0.25 = 283 -> even 282
    timings = [_timing("listops", 0.125, 2.0, "gla", "none"), _timing("listops", 0.25, 4.25, "gla", "causal"),
               _timing("text", 0.5, 1.0)]  # text: 74 / 0.5 = 148
    assert steps_for_budget(timings, 100.0, safety=0.75) == {"listops": 282, "text": 148}
    # the default safety 0.85: 85 - 5 = 80 s at 0.25 s/step -> 320; 79.9 s -> 319.6 -> 319 -> 318 (even)
    assert steps_for_budget([_timing("listops", 0.25, 5.0)], 100.0) == {"listops": 320}
    assert steps_for_budget([_timing("listops", 0.25, 5.1)], 100.0) == {"listops": 318}


def test_every_run_of_a_task_fits_the_budget():
    timings = [_timing("listops", 0.31, 2.0, "softmax_attn"), _timing("listops", 0.07, 9.0, "gla"),
               _timing("listops", 0.2, 5.0, "gated_delta_rule", "masked")]
    steps = steps_for_budget(timings, 300.0)["listops"]
    assert steps % 2 == 0
    for t in timings:
        assert t.fixed_s + steps * t.seconds_per_step <= 0.85 * 300.0, t
    # softmax_attn's 0.31 s/step with the gla run's 9 s fixed cost: floor((255 - 9) / 0.31) = 793 -> 792
    assert steps == 792


def test_steps_for_budget_errors():
    # (0.85 * 60 - 45) / 0.3 = 20 steps: just enough; with 0.1 s more fixed cost: 19 -> ValueError
    assert steps_for_budget([_timing("listops", 0.25, 46.0)], 60.0) == {"listops": 20}
    with pytest.raises(ValueError, match=r"task listops: a 60 s budget leaves 19 steps \(46.1 s fixed"):
        steps_for_budget([_timing("listops", 0.25, 46.1)], 60.0)
    with pytest.raises(ValueError, match="task text"):
        steps_for_budget([_timing("listops", 0.25, 1.0), _timing("text", 1.0, 60.0)], 60.0)
    with pytest.raises(ValueError, match="no probe timings"):
        steps_for_budget([], 60.0)


def test_budget_file_round_trip(tmp_path):
    path = tmp_path / "study" / BUDGET_FILE
    assert load_budget(path, 300.0) is None, "no file yet"
    timings = [_timing("listops", 0.25, 4.0), _timing("text", 0.5, 2.0, "softmax_attn", "causal")]
    save_budget(path, 300.0, {"listops": 1004, "text": 498}, timings)
    assert load_budget(path, 300.0) == {"listops": 1004, "text": 498}
    assert load_budget(path, 240.0) is None, "another budget measures again"
    saved = json.loads(path.read_text())
    assert [StepTiming(**t) for t in saved["timings"]] == timings and saved["budget_s"] == 300.0


# -- the study's steps, seeds and presets ---------------------------------------------------------------
def test_steps_per_task_set_every_run():
    study = lra_study("smoke", tasks=["listops", "retrieval"], data_dir="/data/lra", steps={"listops": 100})
    runs = study.runs()
    assert len(runs) == 2 * 3 * 3 * 2
    for r in runs:  # a run config is normalised by its kind's checks: scratch runs pretrain for 0 steps
        task, train = r.config["task"], r.config["train"]
        assert r.config == check_lra_config(r.config)
        if task["name"] == "listops":
            assert (train["max_steps"], task["pretrain_steps"], train["eval_every"], train["warmup_steps"]) == (
                100, 0 if task["spt"] == "none" else 50, 10, 5)
        else:  # not named in steps: the preset's
            assert (train["max_steps"], task["pretrain_steps"], train["eval_every"]) == (
                400, 0 if task["spt"] == "none" else 200, 100)
    for bad in (1, True, 2.5, "100"):
        with pytest.raises(ValueError, match="steps per task must be an int >= 2"):
            lra_study("smoke", steps={"listops": bad})


def test_seeds_and_steps_from_the_command_line():
    args = argparse.Namespace(preset="smoke", seeds=[3, 5], mixers="gla", spt="causal", steps=60)
    study = lra_study_from_args(args)
    assert [r.seed for r in study.runs()] == [3, 5]
    assert all(r.config["train"]["max_steps"] == 60 and r.config["task"]["pretrain_steps"] == 30
               for r in study.runs())
    fitted = lra_study_from_args(args, steps={"listops": 80})
    assert all(r.config["train"]["max_steps"] == 80 for r in fitted.runs()), "fitted steps win over --steps"
    assert lra_study_from_args(argparse.Namespace(preset="smoke", mixers=["gla", "delta_rule,lru"])).axes[
        "mixer"].keys() == {"gla", "delta_rule", "lru"}
    with pytest.raises(ValueError, match="--run-minutes: expected a finite number > 0, got 0.0"):
        lra.lra_study_within_budget(argparse.Namespace(preset="smoke", run_minutes=0.0, out="x", resume=False), 1)


def test_h100_preset_grid():
    study = lra_study("h100", data_dir="/data/lra")
    runs = study.runs()
    assert len(runs) == 3 * 3 * 2
    assert {r.config["model"]["mixer"] for r in runs} == {"softmax_attn", "gla", "gated_delta_rule"}
    assert {r.config["task"]["spt"] for r in runs} == {"none", "causal", "masked"}
    assert sorted({r.seed for r in runs}) == [0, 1]
    assert all(r.config["task"]["data_dir"] == "/data/lra" for r in runs)
    for r in runs:
        check_lra_config(r.config)
    fitted = lra_study("h100", data_dir="/data/lra", steps={"listops": 3000})
    assert {r.config["train"]["max_steps"] for r in fitted.runs()} == {3000}


def test_conclusion_gives_no_verdict_with_one_seed():
    study = lra_study("smoke", mixers=["gla"], spt=["none", "causal"])

    def cell(spt: str, mean: float, n: int) -> Cell:
        return Cell({"task": "listops", "mixer": "gla", "spt": spt}, 3e-3, mean, 0.0 if n == 1 else 0.01, n,
                    {3e-3: mean})

    one = conclusion(study, [cell("none", 0.2, 1), cell("causal", 0.6, 1)])
    assert "mean gain +40.0 points over 1 mixer(s) (1 improved), one seed only: no estimate of the seed noise" in one
    assert "SPT helps" not in one
    two = conclusion(study, [cell("none", 0.2, 2), cell("causal", 0.6, 2)])
    assert "one seed only" not in two and "beyond the seed noise: SPT helps" in two
    mixed = conclusion(study, [cell("none", 0.2, 2), cell("causal", 0.6, 1)])
    assert "one seed only" in mixed


# -- linattn run lra --run-minutes, end to end ------------------------------------------------------------
TINY_SMOKE = {  # the smoke preset shrunk so that the probe and both runs take seconds
    "task": {"data_dir": None, "pretrain_steps": 200,
             "generate": dict(num_train=96, num_val=16, num_test=16, min_length=4, max_length=24, max_depth=3,
                              max_args=3)},
    "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
    "train": {"max_steps": 400, "batch_size": 8, "warmup_steps": 20, "eval_every": 100, "eval_batch_size": 16,
              "log_every": 10},
    "mixers": ["gla"], "seeds": [0, 1], "lrs": [3e-3],
}


def test_run_lra_within_a_budget_then_resume(tmp_path, monkeypatch, capsys):
    from linattn.cli import main

    monkeypatch.setitem(lra.PRESETS, "smoke", TINY_SMOKE)
    # the runner gives each run cpu_count // workers threads; with two on this shared 2-core machine under load
    # the probe saw 0.78 s per tiny step (and left < 20 steps), with one 0.013 s at the same load
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 1)
    minutes = 0.2  # each run fills ~0.85 of it: the two runs take ~20 s of this test's ~25 s (idle machine)
    argv = ["run", "lra", "--preset", "smoke", "--run-minutes", str(minutes), "--workers", "1", "--seeds", "0",
            "--mixers", "gla", "--spt", "none,causal", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / BUDGET_FILE).read_text())
    assert saved["budget_s"] == pytest.approx(60 * minutes)
    steps = saved["steps"]["listops"]
    assert steps >= 20 and steps % 2 == 0 and f"steps per run for {minutes} min: {{'listops': {steps}}}" in out
    assert sorted((t["mixer"], t["spt"]) for t in saved["timings"]) == [("gla", "causal"), ("gla", "none")]
    assert all(t["seconds_per_step"] > 0 for t in saved["timings"])
    probe_runs = list((tmp_path / "probe").glob("lra/*/runs/*/" + RESULT_NAME))
    assert len(probe_runs) == 2 and all(json.loads(p.read_text())["step"] == lra.PROBE_STEPS for p in probe_runs)
    (study_dir,) = (tmp_path / "lra").iterdir()
    results = [json.loads(p.read_text()) for p in sorted(study_dir.glob("runs/*/" + RESULT_NAME))]
    assert sorted(r["spt"] for r in results) == ["causal", "none"]
    for r in results:
        assert r["status"] == "finished" and r["step"] == steps
        # recorded; not compared with the budget: the probe and the runs share a busy machine at different times
        assert isinstance(r["run_wall_s"], float) and r["run_wall_s"] > 0
    assert (study_dir / "report.md").is_file()

    # --resume reuses the saved steps: no new probe, the finished runs are kept
    import shutil

    shutil.rmtree(tmp_path / "probe")
    assert main(argv + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "probe").exists(), "the probe ran again"
    assert f"steps per run for {minutes} min: {{'listops': {steps}}}" in out and "probe listops" not in out
    assert list((tmp_path / "lra").iterdir()) == [study_dir]
    assert [json.loads(p.read_text()) for p in sorted(study_dir.glob("runs/*/" + RESULT_NAME))] == results
