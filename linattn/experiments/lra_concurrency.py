"""How many LRA runs should share one GPU: seconds per step of a run alone and with others, by measuring.

Small LRA models leave a GPU mostly idle between kernels, so several runs in parallel processes finish more
steps per second in total than one run alone, up to the point where they queue for the GPU (or its memory).
For each mixer and each concurrency ``c``, ``c`` copies of one run of the study (seeds 0..c-1, the same task,
model, spt mode and batch) train together for ``steps`` steps in ``c`` processes; each copy's seconds per step
come from its logged train rows (:func:`linattn.experiments.lra_budget.seconds_per_step`: evaluations and start-up
left out), and the total throughput is ``c / mean seconds per step``. The best concurrency is the one with the most
steps per second in total; the study's ``--workers`` is then set from it.

``python -m linattn.experiments.lra_concurrency --preset budget --tasks listops --data-dir DIR --device cuda
--mixers softmax_attn,gated_delta_rule --concurrency 1,2,4,6 --out DIR`` prints a table and writes
``<out>/lra-concurrency.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from linattn.bench.model import Column, markdown_table, parse_ints, table_cell
from linattn.experiments.lra import lra_study
from linattn.experiments.lra_budget import seconds_per_step
from linattn.experiments.runner import load_results, run_study

RESULT_FILE = "lra-concurrency.json"


@dataclass
class ConcurrencyRow:
    """``concurrency`` copies of one mixer's run sharing the device: their seconds per step (mean, slowest) and
    the total steps per second; ``error`` when a copy failed (e.g. out of memory)."""

    mixer: str
    spt: str
    concurrency: int
    seconds_per_step: float | None = None
    slowest_seconds_per_step: float | None = None
    total_steps_per_s: float | None = None
    error: str | None = None


def measure_concurrency(preset: str, task: str, mixer: str, spt: str, concurrency: int, steps: int,
                        out_root: Path, device: str, data_dir: str | None = None, train: dict | None = None
                        ) -> ConcurrencyRow:
    """Train ``concurrency`` copies (seeds 0..concurrency-1) of the study's ``task``/``mixer``/``spt`` run for
    ``steps`` steps at once and time them."""
    # one evaluation, at the end: the timed spans are training steps (lra_budget.seconds_per_step skips spans with an
    # evaluation in them, so fewer evaluations leave more steps timed)
    timed = {"max_steps": steps, "eval_every": steps, "warmup_steps": 1, "log_every": 1, **(train or {})}
    study = lra_study(preset, tasks=[task], mixers=[mixer], spt=[spt], data_dir=data_dir,
                      seeds=list(range(concurrency)), train=timed, task_options={"pretrain_steps": steps // 2})
    row = ConcurrencyRow(mixer, spt, concurrency)
    outcome = run_study(study, out_root / f"{mixer}-{spt}-x{concurrency}", workers=concurrency, device=device,
                        progress=False, write_report=lambda *args: None)
    if outcome.failed or outcome.pending:
        row.error = f"failed: {', '.join(outcome.failed)}" if outcome.failed else f"{outcome.pending} runs left"
        return row
    per_step = [seconds_per_step(outcome.study_dir / "runs" / r["run_id"]) for r in load_results(outcome.study_dir)]
    row.seconds_per_step = statistics.fmean(per_step)
    row.slowest_seconds_per_step = max(per_step)
    row.total_steps_per_s = concurrency / row.seconds_per_step
    return row


def best_concurrency(rows: list[ConcurrencyRow]) -> dict[str, int]:
    """Per mixer and spt mode, the concurrency with the most steps per second in total (rows with errors left out)."""
    best: dict[str, ConcurrencyRow] = {}
    for r in rows:
        key = f"{r.mixer}/{r.spt}"
        if r.total_steps_per_s is not None and (key not in best or r.total_steps_per_s > best[key].total_steps_per_s):
            best[key] = r
    return {key: r.concurrency for key, r in best.items()}


COLUMNS: list[Column] = [
    ("mixer", False, lambda r: r["mixer"]), ("spt", False, lambda r: r["spt"]),
    ("runs at once", True, lambda r: str(r["concurrency"])),
    ("s/step (mean)", True, lambda r: table_cell(r["seconds_per_step"], ".3f")),
    ("s/step (slowest)", True, lambda r: table_cell(r["slowest_seconds_per_step"], ".3f")),
    ("steps/s in total", True, lambda r: table_cell(r["total_steps_per_s"])),
    ("error", False, lambda r: r["error"] or "")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m linattn.experiments.lra_concurrency",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="budget")
    p.add_argument("--tasks", default="listops", help="one LRA task")
    p.add_argument("--mixers", default="softmax_attn,gated_delta_rule", help="comma list")
    p.add_argument("--spt", default="none", help="the spt mode whose runs are timed (none: fine-tuning only)")
    p.add_argument("--concurrency", default="1,2,4,6", help="comma list of runs at once")
    p.add_argument("--steps", type=int, default=40, help="steps of every timed run")
    p.add_argument("--micro-batches", type=int, default=None, help="train.micro_batches of the timed runs")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    concurrency = parse_ints(a.concurrency, "--concurrency")
    if not concurrency:
        raise ValueError(f"--concurrency must name at least one count, got {a.concurrency!r}")
    if a.steps < 4:
        raise ValueError(f"--steps must be at least 4 (two logged train rows a phase), got {a.steps}")
    train = None if a.micro_batches is None else {"micro_batches": a.micro_batches}
    out = Path(a.out)
    rows = []
    for mixer in [m.strip() for m in a.mixers.split(",") if m.strip()]:
        for c in concurrency:
            row = measure_concurrency(a.preset, a.tasks, mixer, a.spt, c, a.steps, out, a.device, a.data_dir, train)
            print(f"{mixer} {a.spt} x{c}: {asdict(row)}", file=sys.stderr, flush=True)
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps({"settings": vars(a), "rows": [asdict(r) for r in rows],
                                               "best": best_concurrency(rows)}, indent=2))
    print(markdown_table(COLUMNS, [asdict(r) for r in rows]))
    print(f"best runs at once: {best_concurrency(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
