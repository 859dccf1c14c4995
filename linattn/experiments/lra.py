"""The LRA self-pretraining study (Amos et al. 2023, "Never Train from Scratch").

Claim under test: pretraining on the task's own training inputs (SPT: causal next-token prediction or
masked denoising) before fine-tuning beats training from scratch at the SAME total number of steps
(pretraining + fine-tuning steps of SPT = fine-tuning steps of scratch), for a Transformer (RoPE) and
for linear-attention and state-space mixers alike. Grid: LRA task x mixer x spt (none, causal, masked)
x seeds; one run is a run of kind ``lra`` (:func:`linattn.experiments.lra_run.train_lra_from_config`); the
score is test accuracy. The mixers are named as everywhere else (``softmax_attn`` is the Transformer).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path

from linattn.data.lra import LISTOPS_SMOKE, list_lra_tasks
from linattn.errors import ConfigError
from linattn.experiments.lra_run import KIND, SPT_MODES
from linattn.experiments.report import Cell, write_report
from linattn.experiments.runner import resumable_study_dir
from linattn.experiments.study import Study, StudyEntry
from linattn.validation import check_float

# the paper's Transformer (RoPE) test accuracy (%): trained from scratch -> causal SPT (None: failed)
PAPER_TRANSFORMER: dict[str, tuple[float | None, float]] = {
    "listops": (36.4, 59.2), "text": (64.3, 88.8), "retrieval": (57.5, 90.4), "image": (42.4, 76.0),
    "pathfinder32": (71.4, 88.5), "pathx": (None, 88.1),
}
# the mixers of the study: a Transformer (RoPE), linear-attention mixers and a diagonal SSM (lru)
MIXERS = ("softmax_attn", "gated_delta_rule", "delta_rule", "mamba2", "gla", "lru")
TRANSFORMER = "softmax_attn"
METRIC = "test_accuracy"
EVALS = 10  # evaluations of a run whose steps are given (--steps, --run-minutes)

PRESETS: dict[str, dict] = {
    # CPU, 2 cores: a small generated ListOps (trees of 20-200 tokens), 1-layer d=32 models, 400 steps
    # of which SPT pretrains 200; 3 models x 3 spt x 2 seeds = 18 runs.
    "smoke": {
        "task": {"data_dir": None, "pretrain_steps": 200, "generate": LISTOPS_SMOKE},
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "train": {"max_steps": 400, "batch_size": 32, "warmup_steps": 20, "eval_every": 100,
                  "eval_batch_size": 200, "log_every": 50},
        "mixers": ["softmax_attn", "gla", "gated_delta_rule"],
        "seeds": [0, 1],
        "lrs": [3e-3],
    },
    # GPU: the release data (--data-dir), 4 layers d=128; 10k steps, half of them SPT; 3 seeds.
    "full": {
        "task": {"data_dir": "data/lra", "pretrain_steps": 5000, "generate": None},
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4},
        "train": {"max_steps": 10000, "batch_size": 32, "warmup_steps": 500, "eval_every": 1000,
                  "eval_batch_size": 64, "log_every": 100},
        "mixers": list(MIXERS),
        "seeds": [0, 1, 2],
        "lrs": [1e-3],
    },
    # One H100, every run at once: generated ListOps and Pathfinder (--data-dir), 2 layers d=128, the
    # Transformer and two linear mixers x 3 spt x 2 seeds. The steps are not fixed here: pass --steps, or
    # --run-minutes to calibrate them (see linattn.experiments.lra_budget) so that a run fits the budget.
    "h100": {
        "task": {"data_dir": "data/lra", "pretrain_steps": 500, "generate": None},
        "model": {"d_model": 128, "n_layers": 2, "n_heads": 4},
        "train": {"max_steps": 1000, "batch_size": 32, "warmup_steps": 50, "eval_every": 500,
                  "eval_batch_size": 100, "log_every": 25},
        "mixers": ["softmax_attn", "gla", "gated_delta_rule"],
        "seeds": [0, 1],
        "lrs": [1e-3],
    },
    # The paper's recipe (Amos et al. 2023; sources and gaps in docs/lra_recipe.md) on generated ListOps (the
    # LRA distribution, 96,000 training trees) and Pathfinder-32 (curv_contour_length_14, 200 batches x 1000
    # images, 80% = 160,000 for training); --data-dir DIR holds both (ListOps is generated there if absent).
    # Batch 32, AdamW lr 5e-4, no weight decay, linear warmup then a constant lr; bidirectional classifier
    # (the paper fine-tunes non-causal Transformers after every spt mode), mean pooling. Per task:
    #   ListOps:    6 layers, d 512, 8 heads, MLP 4x (GELU; here SwiGLU of 2/3 the width, as many weights: 1376)
    #               steps per epoch = 96,000 / 32 = 3,000; SPT 100 epochs = 300,000 steps, fine-tuning 100
    #               epochs = 300,000 steps: max_steps = 600,000, pretrain_steps = 300,000; warmup 2,000.
    #   Pathfinder: 4 layers, d 128, 8 heads, MLP 1x (SwiGLU hidden 96)
    #               steps per epoch = 160,000 / 32 = 5,000; SPT 50 epochs = 250,000 steps, fine-tuning 200
    #               epochs = 1,000,000 steps: max_steps = 1,250,000, pretrain_steps = 250,000; warmup 5,000.
    # Compute-matched like every preset: spt none trains for the whole max_steps (more than the paper's
    # scratch runs, which only strengthens the baseline). Evaluation every 5 epochs. Transformer, Gated
    # DeltaNet, GLA x none/causal/masked x 3 seeds = 27 runs per task.
    "paper": {
        "tasks": ["listops", "pathfinder32"],
        "task": {"data_dir": "data/lra", "pretrain_steps": 300_000, "generate": None, "bidirectional": True},
        "model": {"d_model": 512, "n_layers": 6, "n_heads": 8, "mlp_hidden": 1376},
        "train": {"max_steps": 600_000, "batch_size": 32, "warmup_steps": 2000, "weight_decay": 0.0,
                  "min_lr_ratio": 1.0, "eval_every": 15_000, "eval_batch_size": 64, "log_every": 100},
        "per_task": {
            "listops": {"task.generate": {}, "task.pretrain_steps": 100 * 3000, "train.max_steps": 200 * 3000,
                        "train.warmup_steps": 2000, "train.eval_every": 5 * 3000, "model.d_model": 512,
                        "model.n_layers": 6, "model.n_heads": 8, "model.mlp_hidden": 1376},
            "pathfinder32": {"task.generate": None, "task.pretrain_steps": 50 * 5000,
                             "train.max_steps": 250 * 5000, "train.warmup_steps": 5000, "train.eval_every": 5 * 5000,
                             "model.d_model": 128, "model.n_layers": 4, "model.n_heads": 8, "model.mlp_hidden": 96},
        },
        "mixers": ["softmax_attn", "gated_delta_rule", "gla"],
        "seeds": [0, 1, 2],
        "lrs": [5e-4],
    },
    # The paper's Pathfinder-32 recipe within one GPU session (docs/lra_recipe.md, "budget"): its model (4 layers,
    # d 128, 8 heads, MLP 1x), data (160,000 training images), bidirectional classifier, AdamW without weight
    # decay and a constant lr after warmup, but batch 128 (lr 1e-3, warmup one epoch of 1,250 steps): these small
    # models are launch-bound on a GPU, so four times the batch costs about the same time a step and covers four
    # times the epochs. 25,000 steps = 20 epochs (the paper: 250); pass --steps or --run-minutes to fit a
    # session. Learning curves on the first 2,000 val images; the test split (20,000) whole at the end. The
    # Transformer and Gated DeltaNet x none/causal/masked, one seed.
    # ListOps (--tasks listops) the same way: the LRA distribution's 96,000 training trees (in --data-dir: `linattn
    # data listops --workers N`), the Pathfinder model's size with the paper's 4x MLP (SwiGLU 344 ~ GELU 512),
    # batch 128 in two micro-batches, lr 1e-3, warmup one epoch (750 steps), 10% masks for masked SPT, val = the 2,000
    # val trees.
    "budget": {
        "tasks": ["pathfinder32"],
        "task": {"data_dir": "data/lra", "pretrain_steps": 12_500, "generate": None, "bidirectional": True,
                 "val_examples": 2000},
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 8, "mlp_hidden": 96},
        "train": {"max_steps": 25_000, "batch_size": 128, "lr": 1e-3, "warmup_steps": 1250, "weight_decay": 0.0,
                  "min_lr_ratio": 1.0, "eval_every": 1250, "eval_batch_size": 500, "log_every": 125},
        "per_task": {
            # two micro-batches: the bidirectional Gated DeltaNet at batch 128 of ~2,000 tokens did not fit a sixth
            # of an 80 GB GPU in one
            "listops": {"task.pretrain_steps": 15_000, "train.max_steps": 30_000, "train.warmup_steps": 750,
                        "train.eval_every": 1500, "train.micro_batches": 2, "model.mlp_hidden": 344},
        },
        "mixers": ["softmax_attn", "gated_delta_rule"],
        "seeds": [0],
        "lrs": [1e-3],
    },
}


def lra_study(preset: str = "smoke", *, tasks: Sequence[str] | None = None, mixers: Sequence[str] | None = None,
              spt: Sequence[str] | None = None, data_dir: str | Path | None = None,
              seeds: Sequence[int] | None = None, train: dict | None = None, model: dict | None = None,
              task_options: dict | None = None, steps: dict[str, int] | None = None) -> Study:
    """The study at ``preset`` ("smoke", "full", "h100", "paper" or "budget"), restricted to ``tasks`` (default: the
    preset's ``tasks``, else ListOps), ``mixers`` (of :data:`MIXERS`) and ``spt`` modes; ``data_dir``
    replaces the preset's (smoke: None = generate ListOps into the study folder); ``seeds``, ``train``,
    ``model`` and ``task_options`` (partial dicts; the last of LRA task keys: ``pretrain_steps``,
    ``generate``, ``mask_ratio``, ``bidirectional``) override the preset's, its per-task settings included.
    A preset's ``per_task`` maps a task to dotted overrides of its runs (steps, model size, data); ``steps``
    maps a task to its total steps (SPT pretrains for half of them, ``EVALS`` evaluations), overriding both."""
    if preset not in PRESETS:
        raise ConfigError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = PRESETS[preset]
    tasks = list(p.get("tasks", ["listops"]) if tasks is None else tasks)
    mixers = list(p["mixers"] if mixers is None else mixers)
    spt = list(SPT_MODES if spt is None else spt)
    for name, values, valid in (("tasks", tasks, list_lra_tasks()), ("mixers", mixers, list(MIXERS)),
                                ("spt", spt, list(SPT_MODES))):
        bad = [v for v in values if v not in valid]
        if not values or bad:
            raise ConfigError(f"{name} must be a non-empty list from {valid}, got {values}")
    task = {**p["task"], **(task_options or {}), "name": tasks[0]}
    if data_dir is not None:
        task["data_dir"] = str(data_dir)
    study = Study.from_dict({
        "name": "lra", "description": f"LRA self-pretraining, compute-matched (preset {preset}). "
        + __doc__.split("\n\n")[1].replace("\n", " "),
        "base": {"kind": KIND, "task": task, "model": {"mixer": "softmax_attn", **p["model"], **(model or {})},
                 "train": {**p["train"], **(train or {})}},
        "axes": {"task": {t: {"task.name": t, **_per_task(p, t, {"train": train, "model": model, "task": task_options}),
                              **_steps_overrides((steps or {}).get(t))} for t in tasks},
                 "mixer": {m: {"model.mixer": m} for m in mixers},
                 "spt": {s: {"task.spt": s} for s in spt}},
        "seeds": list(p["seeds"] if seeds is None else seeds), "lrs": p["lrs"], "metric": METRIC,
        "report": {"facet": "task", "rows": ["mixer"], "cols": "spt"}})
    return study


def _per_task(preset: dict, task: str, given: dict[str, dict | None]) -> dict:
    """The preset's dotted overrides for ``task``, less those the caller set itself (``given``: section ->
    its partial dict of overrides), so an explicit ``train``, ``model`` or ``task_options`` value wins."""
    mine = {f"{section}.{key}" for section, values in given.items() for key in (values or {})}
    return {k: v for k, v in preset.get("per_task", {}).get(task, {}).items() if k not in mine}


def _steps_overrides(total: int | None) -> dict:
    """The dotted overrides that give a task ``total`` steps: half pretraining (SPT), an evaluation every
    ``total / EVALS`` steps (points of the learning curves; half of them in an SPT run's fine-tuning)."""
    if total is None:
        return {}
    if isinstance(total, bool) or not isinstance(total, int) or total < 2:
        raise ConfigError(f"steps per task must be an int >= 2, got {total!r}")
    return {"train.max_steps": total, "task.pretrain_steps": total // 2, "train.eval_every": max(1, total // EVALS),
            "train.warmup_steps": max(1, total // 20)}


def _by_spt(cells: list[Cell], task: str, mixer: str) -> dict[str, Cell]:
    return {c.labels["spt"]: c for c in cells if c.labels["task"] == task and c.labels["mixer"] == mixer}


def conclusion(study: Study, cells: list[Cell]) -> str:
    """Per task and SPT mode: the mean gain over scratch across models, whether it exceeds the seed
    noise (2 x pooled std / sqrt(#mixers)), how many mixers it helps, and the Transformer's change next
    to the paper's; with several mixers, each mixer's own gain against its own noise (2 x sqrt(std_a^2 +
    std_b^2)) below, since opposite effects can cancel in the mean."""
    lines = []
    for task in study.axes["task"]:
        models = [m for m in study.axes["mixer"] if "none" in _by_spt(cells, task, m)]
        for mode in ("causal", "masked"):
            named = {m: (_by_spt(cells, task, m)["none"], _by_spt(cells, task, m)[mode]) for m in models
                     if mode in _by_spt(cells, task, m)}
            pairs = list(named.values())
            if not pairs:
                continue
            gains = [b.mean - a.mean for a, b in pairs]
            gain = statistics.fmean(gains)
            noise = 2 * statistics.fmean(a.std ** 2 + b.std ** 2 for a, b in pairs) ** 0.5 / len(pairs) ** 0.5
            text = (f"- **{task}, {mode} SPT vs scratch**: mean gain {100 * gain:+.1f} points over {len(pairs)} "
                    f"mixer(s) ({sum(g > 0 for g in gains)} improved), {_verdict(gain, noise, pairs)} "
                    f"({100 * noise:.1f})")
            tr = _by_spt(cells, task, TRANSFORMER)
            if mode == "causal" and "none" in tr and "causal" in tr and task in PAPER_TRANSFORMER:
                before, after = PAPER_TRANSFORMER[task]
                text += (f"; Transformer {100 * tr['none'].mean:.1f} -> {100 * tr['causal'].mean:.1f} here, "
                         f"{before if before is not None else 'fail'} -> {after} in the paper")
            lines.append(text + ".")
            if len(pairs) > 1:  # a pooled mean can hide opposite effects: each mixer's own gain and noise
                for m, (a, b) in named.items():
                    one, own = 2 * (a.std ** 2 + b.std ** 2) ** 0.5, b.mean - a.mean
                    lines.append(f"  - {m}: {100 * a.mean:.1f} -> {100 * b.mean:.1f}, gain {100 * own:+.1f} points, "
                                 f"{_verdict(own, one, [(a, b)])} ({100 * one:.1f}).")
    return "\n".join(lines) or "- no mixer has both a scratch and an SPT result yet."


def _verdict(gain: float, noise: float, pairs: list[tuple[Cell, Cell]]) -> str:
    """Whether a gain exceeds the seed noise (2 x the pooled std of the pairs' means' difference), in words."""
    if min(c.n for pair in pairs for c in pair) < 2:
        return "one seed only: no estimate of the seed noise, so no verdict"
    return ("beyond the seed noise: SPT helps" if gain > noise else "beyond the seed noise: SPT hurts"
            if gain < -noise else "within the seed noise: no clear effect")


def paper_table(study: Study, cells: list[Cell]) -> str:
    """Markdown: our Transformer row per task and spt mode next to the paper's (test accuracy, %)."""
    lines = ["| task | spt | ours (softmax_attn) | paper (Transformer + RoPE) |", "|---|---|---|---|"]
    for task in study.axes["task"]:
        tr = _by_spt(cells, task, TRANSFORMER)
        before, after = PAPER_TRANSFORMER.get(task, (None, None))
        paper = {"none": "fail" if before is None else f"{before:.1f}", "causal": f"{after:.1f}", "masked": "-"}
        for mode in study.axes["spt"]:
            ours = f"{100 * tr[mode].mean:.1f} ± {100 * tr[mode].std:.1f}" if mode in tr else "-"
            lines.append(f"| {task} | {mode} | {ours} | {paper[mode]} |")
    return "\n".join(lines)


def runs_table(rows: list[dict]) -> list[str]:
    """Markdown lines: every finished run's steps (pretraining + fine-tuning), wall minutes, device and how many
    runs shared it, and the device minutes that makes (wall / sharing; "-" for rows written before the runner
    recorded the sharing)."""
    done = sorted((r for r in rows if r.get("status") == "finished"),
                  key=lambda r: (str(r.get("task")), str(r.get("mixer")), str(r.get("spt")), r.get("seed", 0)))
    if not done:
        return []
    lines = ["## Runs", "", "Steps and time of every finished run. Runs that share a device slow each other, so a "
             "run's device time is its wall time over the runs that shared the device (an estimate: runs that "
             "finish early leave the rest more of it).", "",
             "| task | mixer | spt | seed | pretraining steps | fine-tuning steps | wall min | device | runs on it | "
             "device min |", "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in done:
        minutes = r.get("run_wall_s", r.get("wall_s", 0.0)) / 60
        sharing = r.get("runs_on_device")
        lines.append(f"| {r.get('task')} | {r.get('mixer')} | {r.get('spt')} | {r.get('seed')} | "
                     f"{r.get('pretrain_steps', 0)} | {r.get('finetune_steps', r.get('step'))} | {minutes:.1f} | "
                     f"{r.get('device', '-')} | {sharing if sharing else '-'} | "
                     f"{f'{minutes / sharing:.1f}' if sharing else '-'} |")
    return lines + [""]


def lra_report(study: Study, study_dir: Path, rows: list[dict]) -> None:
    """The standard report (tables of test accuracy per mixer x spt, mean ± std over seeds) with a
    computed conclusion, the learning curves of every run (:mod:`linattn.experiments.lra_curves`) and the
    Transformer row beside the paper's numbers."""
    from linattn.experiments.lra_curves import plot_curves, stopped_runs_table

    cells = write_report(study, study_dir, rows, conclusion=conclusion)
    extra = []
    try:
        extra += ["", "## Learning curves", "", *(f"![{p.stem}]({p.name})" for p in plot_curves(study_dir)), ""]
    except ImportError:
        extra += ["", "(no learning curves: matplotlib is not installed)", ""]
    extra += stopped_runs_table(study_dir)
    extra += runs_table(rows)
    if TRANSFORMER in study.axes["mixer"]:
        extra += ["", "## Against the paper", "",
                  "Test accuracy (%). Paper: Amos et al. 2023, Transformer with RoPE (here softmax_attn), full-size "
                  "LRA, trained from scratch vs causal SPT. Ours: this study's model size, steps and data "
                  "(config.yaml; data generated from the LRA task definitions, not the release files), so the "
                  "direction and the gap compare, not the level.", "",
                  paper_table(study, cells), ""]
    with open(study_dir / "report.md", "a") as f:
        f.write("\n".join(extra))


def _names(value: str | Sequence[str] | None) -> list[str] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [x for v in value for x in str(v).split(",")]
    return [x.strip() for x in items if x.strip()]


def _tasks(args: argparse.Namespace) -> list[str]:
    """The tasks of ``--tasks`` (default: the preset's, else ListOps)."""
    return _names(getattr(args, "tasks", None)) or list(PRESETS.get(args.preset, {}).get("tasks", ["listops"]))


def lra_study_from_args(args: argparse.Namespace, steps: dict[str, int] | None = None,
                        train: dict | None = None) -> Study:
    """The study of ``linattn run lra [--preset P] [--tasks T] [--mixers M] [--spt S] [--data-dir DIR]
    [--seeds S] [--steps N]``; each of --tasks, --mixers, --spt takes a comma-separated list (or is repeated)
    and defaults to the preset's; ``args.seeds`` is a list of ints or None. ``steps`` (per task) overrides
    --steps."""
    tasks = _tasks(args)
    if steps is None and getattr(args, "steps", None) is not None:
        steps = {t: args.steps for t in tasks}
    return lra_study(args.preset, tasks=tasks, mixers=_names(getattr(args, "mixers", None)),
                     spt=_names(getattr(args, "spt", None)), data_dir=getattr(args, "data_dir", None),
                     seeds=getattr(args, "seeds", None), steps=steps, train=train)


PROBE_STEPS = 40


def lra_study_within_budget(args: argparse.Namespace, workers: int) -> Study:
    """The study of ``args`` with each task's steps fitted to ``args.run_minutes`` per run
    (:mod:`linattn.experiments.lra_budget`): a probe of every run at ``PROBE_STEPS`` steps in ``workers``
    processes measures the speed; the result is saved as ``<out>/lra-budget.json`` and reused by --resume."""
    from linattn.experiments.lra_budget import BUDGET_FILE, load_budget, measure, save_budget, steps_for_budget

    check_float("--run-minutes", args.run_minutes, 0, low_open=True)
    budget_s = 60.0 * args.run_minutes
    path = Path(args.out) / BUDGET_FILE
    steps = load_budget(path, budget_s) if args.resume else None
    if steps is None:
        probe = lra_study_from_args(args, steps={t: PROBE_STEPS for t in _tasks(args)}, train={"log_every": 1})
        timings = measure(probe, Path(args.out) / "probe", workers=workers, device=args.device,
                          probe_steps=PROBE_STEPS, threads=getattr(args, "threads", None))
        steps = steps_for_budget(timings, budget_s)
        save_budget(path, budget_s, steps, timings)
        for t in timings:
            print(f"probe {t.task} {t.mixer} {t.spt}: {t.seconds_per_step:.3f} s/step, {t.fixed_s:.1f} s fixed")
    print(f"steps per run for {args.run_minutes} min: {steps}")
    return lra_study_from_args(args, steps=steps)


def _cli_study(args: argparse.Namespace, workers: int) -> Study:
    """``linattn run lra ...``: with ``--run-minutes`` the steps come from a timing probe (minutes), so a
    ``--resume`` with nothing to resume is refused before it."""
    if args.resume:
        resumable_study_dir(args.out, "lra")
    if getattr(args, "run_minutes", None) is not None:
        return lra_study_within_budget(args, workers=workers)
    return lra_study_from_args(args)


def add_lra_options(group: argparse._ArgumentGroup) -> None:
    """The flags of ``linattn run lra``."""
    group.add_argument("--tasks", action="append", help=f"LRA task(s), comma list, from {', '.join(list_lra_tasks())} "
                       "(default: the preset's tasks, else listops)")
    group.add_argument("--mixers", action="append", help=f"mixer(s), comma list, from {', '.join(MIXERS)} "
                       "(default: the preset's)")
    group.add_argument("--spt", action="append", help="none, causal and/or masked, comma list (default: all three)")
    group.add_argument("--data-dir", default=None,
                       help="folder with the LRA release files (smoke: ListOps generated if absent)")
    group.add_argument("--steps", type=int, default=None,
                       help="total steps of every run (SPT pretrains for half), instead of the preset's")
    group.add_argument("--run-minutes", type=float, default=None,
                       help="fit the steps to this wall-clock budget per run, measured by a short probe of "
                            "every run at the same concurrency (saved beside the study; --resume reuses it)")


LRA_STUDY = StudyEntry("lra", tuple(PRESETS), lra_study, lra_report, add_lra_options,
                       ("tasks", "mixers", "spt", "data_dir", "steps", "run_minutes"), _cli_study)
