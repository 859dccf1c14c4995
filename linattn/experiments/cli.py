"""``linattn run STUDY`` as a function, for linattn/cli.py to call."""

from __future__ import annotations

import argparse
import os

from linattn.experiments.registry import get_study, list_studies
from linattn.experiments.runner import resumable_study_dir, run_study
from linattn.validation import check_device, check_float, check_int


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``linattn run``."""
    parser.add_argument("study", help=f"a named study ({', '.join(list_studies())}) or a study YAML file")
    parser.add_argument("--preset", default="smoke", choices=["smoke", "full", "h100"],
                        help="size of the grid (h100: lra only, one H100, every run at once)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cuda uses every visible GPU)")
    parser.add_argument("--out", default="runs", help="root folder: results go to OUT/<study>/<stamp>/")
    parser.add_argument("--resume", action="store_true", help="continue the newest folder of this study")
    parser.add_argument("--workers", type=int, default=None,
                        help="parallel run processes (default: 2 on CPU, 16 per GPU up to the CPU count)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run process (default: CPU count / workers on CPU, 1 on GPU)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop (checkpointing running runs) after this many minutes; --resume continues")
    lra = parser.add_argument_group("lra study")
    lra.add_argument("--task", action="append", help="LRA task(s), comma list (default: the preset's)")
    lra.add_argument("--model", action="append", help="model label(s) or mixer name(s), comma list")
    lra.add_argument("--spt", action="append", help="none, causal and/or masked, comma list")
    lra.add_argument("--data-dir", default=None, help="folder with the LRA release files (smoke: generated if absent)")
    lra.add_argument("--seeds", default=None, help="comma list of seeds (default: the preset's)")
    lra.add_argument("--steps", type=int, default=None,
                     help="total steps of every run (SPT pretrains for half), instead of the preset's")
    lra.add_argument("--run-minutes", type=float, default=None,
                     help="fit the steps to this wall-clock budget per run, measured by a short probe of "
                          "every run at the same concurrency (saved beside the study; --resume reuses it)")


def check_run_flags(args: argparse.Namespace) -> None:
    """ConfigError naming the first flag of ``linattn run`` out of range (argparse checked the types)."""
    for flag in ("threads", "workers"):
        if getattr(args, flag, None) is not None:
            check_int(f"--{flag}", getattr(args, flag), 1)
    for flag in ("max_minutes", "run_minutes"):
        if getattr(args, flag, None) is not None:
            check_float(f"--{flag.replace('_', '-')}", getattr(args, flag), 0, low_open=True)
    check_device("--device", args.device, allow_auto=False)


def cli_run(args: argparse.Namespace) -> int:
    """Run the study; prints where the report is; exit code 0 when complete, 3 when runs are left
    (time budget), 1 when some runs failed."""
    import torch

    check_run_flags(args)
    workers = args.workers
    if workers is None:
        gpus = max(1, torch.cuda.device_count())
        workers = 2 if args.device == "cpu" else min(os.cpu_count() or 16, 16 * gpus)
    if args.study == "lra":
        from linattn.experiments.lra import lra_report, lra_study_from_args, lra_study_within_budget

        if args.resume:  # before the budget probe, which takes minutes
            resumable_study_dir(args.out, "lra")
        if getattr(args, "run_minutes", None) is not None:
            study = lra_study_within_budget(args, workers=workers)
        else:
            study = lra_study_from_args(args)
        report = lra_report
    else:
        study, report = get_study(args.study, args.preset)
    budget = None if args.max_minutes is None else 60.0 * args.max_minutes
    outcome = run_study(study, args.out, resume=args.resume, workers=workers, device=args.device,
                        threads=getattr(args, "threads", None),
                        time_budget_s=budget, write_report=report)
    print(f"{study.name}: {outcome.finished} runs finished, {outcome.pending} left; "
          f"report: {outcome.study_dir / 'report.md'}")
    for line in outcome.failed:
        print(f"FAILED {line}")
    if outcome.failed:
        return 1
    if outcome.pending:
        print(f"rerun with --resume to continue {outcome.study_dir}")
        return 3
    return 0


def cli_list() -> int:
    """For ``linattn list``: the named studies (runs per preset) and the synthetic tasks."""
    from linattn.data import TASKS

    for name in list_studies():
        sizes = ", ".join(f"{p}: {len(get_study(name, p)[0].runs())} runs" for p in ("smoke", "full"))
        print(f"study {name:18s} {sizes}")
    for name, cls in sorted(TASKS.items()):
        print(f"task  {name:18s} {(cls.__doc__ or '').strip().splitlines()[0]}")
    return 0
