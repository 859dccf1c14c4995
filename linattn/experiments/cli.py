"""``linattn run STUDY`` as a function, for linattn/cli.py to call: the flags every study shares, each named
study's own flags (its registry entry), and the run itself."""

from __future__ import annotations

import argparse
import os

from linattn.errors import ConfigError
from linattn.experiments.registry import STUDIES, get_entry, is_study_file, list_studies
from linattn.experiments.report import write_report
from linattn.experiments.runner import run_study
from linattn.experiments.study import Study
from linattn.validation import check_device, check_float, check_int


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``linattn run``: the shared ones, then a group per named study."""
    parser.add_argument("study", help=f"a named study ({', '.join(list_studies())}) or a study YAML file")
    presets = "; ".join(f"{name}: {', '.join(entry.presets)}" for name, entry in STUDIES.items())
    parser.add_argument("--preset", default=None,
                        help=f"size of a named study's grid (default: smoke); {presets}")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cuda uses every visible GPU)")
    parser.add_argument("--out", default="runs", help="root folder: results go to OUT/<study>/<stamp>/")
    parser.add_argument("--resume", action="store_true", help="continue the newest folder of this study")
    parser.add_argument("--workers", type=int, default=None,
                        help="parallel run processes (default: 2 on CPU, 16 per GPU up to the CPU count)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run process (default: CPU count / workers on CPU, 1 on GPU)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop (checkpointing running runs) after this many minutes; --resume continues")
    parser.add_argument("--seeds", default=None, help="comma list of seeds, instead of the study's")
    for name, entry in STUDIES.items():
        if entry.options:
            entry.add_options(parser.add_argument_group(f"{name} study"))


def check_run_flags(args: argparse.Namespace) -> None:
    """ConfigError naming the first flag of ``linattn run`` out of range (argparse checked the types)."""
    for flag in ("threads", "workers"):
        if getattr(args, flag, None) is not None:
            check_int(f"--{flag}", getattr(args, flag), 1)
    for flag in ("max_minutes", "run_minutes"):
        if getattr(args, flag, None) is not None:
            check_float(f"--{flag.replace('_', '-')}", getattr(args, flag), 0, low_open=True)
    check_device("--device", args.device, allow_auto=False)


def _check_study_flags(args: argparse.Namespace) -> None:
    """The preset and study flags must belong to the study run: ConfigError naming the first that does not."""
    own = () if is_study_file(args.study) else get_entry(args.study).options
    for name, entry in STUDIES.items():
        for dest in entry.options:
            if dest not in own and getattr(args, dest, None) is not None:
                flag = "--" + dest.replace("_", "-")
                raise ConfigError(f"is an option of study {name!r}, not of {args.study!r}", field=flag)
    if is_study_file(args.study):
        if getattr(args, "preset", None) is not None:
            raise ConfigError(f"a study file has no presets (got {args.preset!r}); edit the file", field="--preset")
        return
    entry = get_entry(args.study)
    args.preset = getattr(args, "preset", None) or entry.presets[0]
    if args.preset not in entry.presets:
        raise ConfigError(f"study {entry.name!r} has presets {', '.join(entry.presets)}; got {args.preset!r}",
                          field="--preset")


def _seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise ConfigError(f"expected a comma list of integers >= 0, got {text!r}", field="--seeds")
    return seeds


def cli_run(args: argparse.Namespace) -> int:
    """Run the study; prints where the report is; exit code 0 when complete, 3 when runs are left
    (time budget), 1 when some runs failed."""
    import torch

    check_run_flags(args)
    _check_study_flags(args)
    seeds = getattr(args, "seeds", None)
    args.seeds = _seeds(seeds) if isinstance(seeds, str) else seeds
    workers = args.workers
    if workers is None:
        gpus = max(1, torch.cuda.device_count())
        workers = 2 if args.device == "cpu" else min(os.cpu_count() or 16, 16 * gpus)
    if is_study_file(args.study):
        study, report = Study.from_yaml(args.study), write_report
    else:
        entry = get_entry(args.study)
        study, report = entry.study_from_args(args, workers), entry.report
    if args.seeds is not None:
        study = study.with_seeds(args.seeds)
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

    for name, entry in STUDIES.items():
        sizes = ", ".join(f"{p}: {len(entry.make(p).runs())} runs" for p in entry.presets)
        print(f"study {name:18s} {sizes}")
    for name, cls in sorted(TASKS.items()):
        print(f"task  {name:18s} {(cls.__doc__ or '').strip().splitlines()[0]}")
    return 0
