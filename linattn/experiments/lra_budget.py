"""Fit the LRA study's steps to a wall-clock budget per run (pretraining and fine-tuning together), by measuring.

A run's speed depends on the machine and on how many runs share it, so the steps are not guessed: a
*probe* runs every run of the real grid at the same concurrency for a few steps (``probe_steps``; SPT
pretrains for half of them, evaluations as often as in the real run) and measures per run

* seconds per training step, from the trainer's logged ``time`` between its first and last train rows;
* the fixed cost, ``run_wall_s - probe_steps * seconds_per_step`` (data loading, model building, the
  evaluations on val and test).

Per task, with the slowest run's figures: ``steps = floor(safety * (budget_s - fixed) / seconds_per_step)``.
The steps are the same for every mixer and spt mode of a task (compute-matched, as in the paper);
pretraining takes half of them. The measurements and the chosen steps are saved beside the study so a
``--resume`` reuses them instead of measuring again.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from linattn.errors import ConfigError
from linattn.experiments.runner import load_results, run_study
from linattn.experiments.study import Study
from linattn.train.trainer import read_metrics

BUDGET_FILE = "lra-budget.json"


@dataclass
class StepTiming:
    """One probe run: its task, mixer and spt labels, seconds per step, fixed cost and wall time."""

    task: str
    mixer: str
    spt: str
    seconds_per_step: float
    fixed_s: float
    run_wall_s: float


def seconds_per_step(run_dir: Path) -> float:
    """Mean seconds per training step of a finished run, from the logged times of each phase (the
    first logged row of a phase is its start: compilation and warm-up excluded). A span between two train
    rows with an evaluation in it is left out: the trainer's clock runs on through evaluations, which
    belong to the fixed cost."""
    steps, secs = 0, 0.0
    for phase in ("pretrain", "finetune"):
        path = run_dir / phase
        if not (path / "metrics.jsonl").is_file():
            continue
        last = None  # (step, time) of the previous train row, None after an evaluation
        for r in read_metrics(path):
            if r.get("split") == "eval":
                last = None
            elif r.get("split") == "train" and "time" in r:
                if last is not None:
                    steps, secs = steps + r["step"] - last[0], secs + r["time"] - last[1]
                last = (r["step"], r["time"])
    if steps <= 0:
        raise ValueError(f"{run_dir}: fewer than two logged train rows in a phase; lower train.log_every "
                         f"or raise the probe's steps")
    return secs / steps


def measure(probe: Study, out_root: str | Path, *, workers: int, device: str, probe_steps: int,
            threads: int | None = None) -> list[StepTiming]:
    """Run ``probe`` (every run of the grid at ``probe_steps`` steps) in ``workers`` processes on
    ``device`` (``threads`` per process, as the real study will) and time each run."""
    outcome = run_study(probe, out_root, workers=workers, device=device, progress=True, threads=threads,
                        write_report=lambda *args: None)
    if outcome.failed or outcome.pending:
        raise RuntimeError(f"the timing probe did not finish: {outcome.failed or f'{outcome.pending} runs left'}")
    timings = []
    for row in load_results(outcome.study_dir):
        per_step = seconds_per_step(outcome.study_dir / "runs" / row["run_id"])
        wall = float(row["run_wall_s"])
        timings.append(StepTiming(row["task"], row["mixer"], row["spt"], per_step,
                                  max(0.0, wall - probe_steps * per_step), wall))
    return timings


def steps_for_budget(timings: list[StepTiming], budget_s: float, safety: float = 0.85) -> dict[str, int]:
    """Per task: the most steps with which its slowest run still fits ``safety * budget_s`` (see the
    module docstring). ValueError when a task's fixed cost alone leaves fewer than 20 steps."""
    if not timings:
        raise ValueError("no probe timings")
    out = {}
    for task in sorted({t.task for t in timings}):
        mine = [t for t in timings if t.task == task]
        per_step = max(t.seconds_per_step for t in mine)
        fixed = max(t.fixed_s for t in mine)
        steps = math.floor((safety * budget_s - fixed) / per_step)
        if steps < 20:
            raise ConfigError(f"task {task}: a {budget_s:.0f} s budget leaves {steps} steps ({fixed:.1f} s fixed "
                             f"cost, {per_step:.3f} s per step at this concurrency); give more time or fewer runs")
        out[task] = steps - steps % 2
    return out


def save_budget(path: Path, budget_s: float, steps: dict[str, int], timings: list[StepTiming]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"budget_s": budget_s, "steps": steps,
                                "timings": [asdict(t) for t in timings]}, indent=2))


def load_budget(path: Path, budget_s: float) -> dict[str, int] | None:
    """The steps saved for ``budget_s`` at ``path``, or None (no file, or another budget)."""
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved["steps"] if saved.get("budget_s") == budget_s else None
