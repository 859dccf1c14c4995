"""Running a study: ``runs/<study>/<stamp>/``, many runs at once, resumable, under a time budget.

Layout of a study folder::

    config.yaml            the study definition (+ fingerprint)
    runs/<run_id>/         per run: config.yaml, checkpoint.pt, metrics.jsonl, result.json when finished
    results.csv, report.md, *.png      rewritten after every invocation from the finished runs

A finished run (result.json present) is never run again; an interrupted one resumes from its
checkpoint (exactly, see the Trainer). Runs execute in ``workers`` processes; on a GPU several
processes share it (small models leave it idle otherwise), on several GPUs runs go round-robin.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from multiprocessing import get_context
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from linattn.config_files import read_yaml
from linattn.errors import ResumeError
from linattn.experiments.runs import train_run
from linattn.experiments.study import RunSpec, Study
from linattn.train.resume import config_changes, format_changes
from linattn.train.trainer import NonFiniteLossError

RESULT_NAME = "result.json"


@dataclass
class StudyOutcome:
    """What an invocation did: the study folder, and how many runs are finished, left, failed."""

    study_dir: Path
    finished: int
    pending: int
    failed: list[str]

    @property
    def complete(self) -> bool:
        return self.pending == 0 and not self.failed


def resumable_study_dir(out_root: str | Path, name: str) -> Path:
    """The newest ``<out_root>/<name>/<stamp>/`` holding a study record (config.yaml); ResumeError when
    there is none, so ``--resume`` never silently starts a new study."""
    base = Path(out_root) / name
    stamps = sorted(p for p in base.iterdir() if (p / "config.yaml").is_file()) if base.is_dir() else []
    if not stamps:
        raise ResumeError(f"--resume: nothing to resume: no earlier run of study {name!r} under {base} (no folder "
                          f"with a config.yaml); run without --resume to start one, or pass the --out it was run with")
    return stamps[-1]


def find_study_dir(study: Study, out_root: str | Path, resume: bool) -> Path:
    """A new ``<out_root>/<study>/<UTC stamp>/``; with ``resume`` the newest existing one, which must have
    been made from the same definition (ResumeError listing the differences otherwise, or when there is none),
    or from a definition that ``study`` extends (more seeds, more values of an axis, more lrs: every saved run is
    also a run of ``study``, with the same config): the study grows (its record is rewritten) and its finished runs
    are kept."""
    if resume:
        latest = resumable_study_dir(out_root, study.name)
        saved = read_yaml(latest / "config.yaml", "study record")
        if _extends(saved, study):
            _write_record(latest, study)
        elif not isinstance(saved, dict) or saved.get("fingerprint") != study.fingerprint():
            record = {k: v for k, v in saved.items() if k != "fingerprint"} if isinstance(saved, dict) else {}
            diff = format_changes(config_changes(record, study.to_dict()))
            raise ResumeError(f"--resume: {latest} was made by a different definition of study {study.name!r} "
                              f"(another preset or edited settings{': ' + diff if diff else ''}); rerun without "
                              f"--resume or pass its --out")
        return latest
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path(out_root) / study.name / stamp
    path.mkdir(parents=True, exist_ok=False)
    _write_record(path, study)
    return path


def _write_record(study_dir: Path, study: Study) -> None:
    """The study's definition and fingerprint, as ``--resume`` checks them."""
    (study_dir / "config.yaml").write_text(yaml.safe_dump({**study.to_dict(), "fingerprint": study.fingerprint()},
                                                          sort_keys=False))


def _extends(saved: object, study: Study) -> bool:
    """Whether ``study`` has every run of the saved study (the record ``saved``, unedited), with the same run
    configs, and more."""
    if not isinstance(saved, dict):
        return False
    try:
        old = Study.from_dict({k: v for k, v in saved.items() if k != "fingerprint"})
    except (ValueError, TypeError, KeyError):
        return False
    if old.fingerprint() != saved.get("fingerprint"):
        return False
    new_runs = {s.run_id: s.config for s in study.runs()}
    old_runs = {s.run_id: s.config for s in old.runs()}
    return len(new_runs) > len(old_runs) and all(new_runs.get(r) == c for r, c in old_runs.items())


def execute_run(spec: RunSpec, run_dir: str, device: str, deadline: float | None, threads: int,
                gpu_share: float = 1.0, sharing: int = 1) -> dict:
    """Train one run in this process; returns its result row (status "finished", "diverged",
    "interrupted", "skipped" (deadline passed before it started) or "error"). ``gpu_share``: the
    fraction of the GPU's memory this process may hold (the caching allocator frees its cache
    before exceeding it, so processes sharing a GPU do not starve each other); ``sharing``: how many runs
    the study ran at once on this device (recorded in the row, so reports can say what a run's wall time
    cost)."""
    start = time.time()
    row = {"run_id": spec.run_id, **spec.row()}
    if deadline is not None and time.time() >= deadline:
        return {**row, "status": "skipped"}
    torch.set_num_threads(threads)
    if device.startswith("cuda") and gpu_share < 1.0:
        dev = torch.device(device)
        torch.cuda.set_per_process_memory_fraction(gpu_share, dev.index if dev.index is not None else 0)
    out = Path(run_dir)
    try:
        result = train_run(spec.config, out, device=device, progress=False, deadline=deadline)
    except NonFiniteLossError as exc:
        final = {**row, "status": "diverged", "message": str(exc)}
        (out / RESULT_NAME).write_text(json.dumps(final, indent=2))
        return final
    except Exception as exc:  # keep the study going; the run is retried on --resume
        (out / "error.txt").write_text(traceback.format_exc())
        return {**row, "status": "error", "message": f"{type(exc).__name__}: {exc}"}
    if result.status == "interrupted":
        return {**row, "status": "interrupted", "step": result.step}
    saved = json.loads((out / RESULT_NAME).read_text())
    final = {**row, "status": "finished", "stop": result.status, "step": result.step, **result.metrics,
             "best": result.best, "wall_s": result.wall_s, "run_wall_s": round(time.time() - start, 3),
             "num_params": saved["num_params"], "device": device, "runs_on_device": sharing}
    final.pop("message", None)
    (out / RESULT_NAME).write_text(json.dumps(final, indent=2))
    return final


def load_results(study_dir: Path) -> list[dict]:
    """The result rows of every finished run of the study folder."""
    runs = study_dir / "runs"
    if not runs.is_dir():
        return []
    rows = []
    for p in sorted(runs.iterdir()):
        f = p / RESULT_NAME
        if f.is_file():
            row = json.loads(f.read_text())
            if "status" in row:
                rows.append(row)
    return rows


def _devices(device: str) -> list[str]:
    if device.startswith("cuda") and device == "cuda" and torch.cuda.device_count() > 1:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [device]


# what a process holds on the GPU outside PyTorch's caching allocator (CUDA context, cuBLAS workspace,
# Triton modules); measured ~1.5 GiB per process on the H100 with 16 processes (the full shortconv study
# ran out of memory when the shares ignored it)
PROCESS_OVERHEAD_BYTES = 1.6 * 2**30


def runs_per_device(workers: int, num_devices: int) -> int:
    """How many of ``workers`` processes, spread round-robin over ``num_devices`` devices, share the busiest one."""
    return -(-workers // max(1, num_devices))


def gpu_memory_share(workers: int, num_devices: int, device: str) -> float:
    """The fraction of a GPU's memory one of ``workers`` processes (spread over ``num_devices`` GPUs) may
    cache: 90% of the memory, less each process's overhead outside the allocator, split evenly."""
    per_gpu = runs_per_device(workers, num_devices)
    if per_gpu <= 1 or not device.startswith("cuda") or not torch.cuda.is_available():
        return 1.0
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return max(0.01, (0.9 * total - per_gpu * PROCESS_OVERHEAD_BYTES) / (per_gpu * total))


def run_study(study: Study, out_root: str | Path = "runs", *, resume: bool = False, workers: int = 1,
              device: str = "cpu", time_budget_s: float | None = None, progress: bool = True,
              study_dir: str | Path | None = None, threads: int | None = None,
              write_report: Callable[[Study, Path, list[dict]], None] | None = None) -> StudyOutcome:
    """Run every unfinished run of ``study`` (``workers`` processes; ``time_budget_s``: stop starting
    runs and checkpoint running ones when it is spent, leaving a margin for the report), then write
    results.csv, report.md and the plots. ``study_dir`` reuses that exact folder. Runs start seed by seed (the
    whole grid of the first seed, then the next)."""
    t0 = time.time()
    if study_dir is not None:
        sdir = Path(study_dir)
        if not (sdir / "config.yaml").is_file():
            sdir.mkdir(parents=True, exist_ok=True)
            _write_record(sdir, study)
    else:
        sdir = find_study_dir(study, out_root, resume)
    specs = study.runs()
    done = {r["run_id"] for r in load_results(sdir)}
    # a seed's whole grid first: an invocation stopped early (--max-minutes) leaves complete comparisons, not one
    # setting's seeds (stable within a seed: the grid's order)
    pending = sorted((s for s in specs if s.run_id not in done), key=lambda s: s.seed)
    deadline = None if time_budget_s is None else t0 + max(0.0, time_budget_s - min(20.0, 0.1 * time_budget_s))
    devices = _devices(device)
    cpu_threads = max(1, (os.cpu_count() or 1) // max(1, workers))
    threads = threads or (cpu_threads if device == "cpu" else 1)
    running = min(workers, max(1, len(pending)))  # processes at once: never more than the runs left
    gpu_share = gpu_memory_share(running, len(devices), device)
    failed: list[str] = []
    bar = tqdm(total=len(specs), initial=len(done), desc=f"{study.name} runs", disable=not progress, leave=True)
    jobs = [(s, str(sdir / "runs" / s.run_id), devices[i % len(devices)], deadline, threads, gpu_share,
             runs_per_device(running, len(devices)))
            for i, s in enumerate(pending)]

    def note(row: dict) -> None:
        if row["status"] in ("finished", "diverged"):
            bar.update(1)
        elif row["status"] == "error":
            failed.append(f"{row['run_id']}: {row['message']}")

    if workers <= 1:
        for job in jobs:
            note(execute_run(*job))
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            for fut in as_completed([pool.submit(execute_run, *job) for job in jobs]):
                note(fut.result())
    bar.close()
    rows = load_results(sdir)
    if write_report is None:
        from linattn.experiments.report import write_report as default_report
        write_report = default_report
    write_report(study, sdir, rows)
    return StudyOutcome(sdir, len(rows), len(specs) - len(rows), failed)
