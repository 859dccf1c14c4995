"""Learning curves of an LRA study, and the test accuracy of runs that have not finished.

``python -m linattn.experiments.lra_curves STUDY_DIR [--evaluate] [--device cuda]`` writes
``curves_<task>.png`` into the study folder (every run, finished or not): the pretraining loss of the SPT runs
and the validation accuracy of every run against the run's total step (pretraining + fine-tuning), so the
compute-matched runs share one axis. ``--evaluate`` also scores each run's latest fine-tuning checkpoint on
the whole test split and writes ``checkpoint-test.json``: the accuracy a run had reached when it was stopped,
for studies that ran out of time before some runs finished (a finished run's checkpoint is its final model).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from linattn.train.trainer import read_metrics

SPT_STYLE = {"none": "-", "causal": "--", "masked": ":"}
CHECKPOINT_SCORES = "checkpoint-test.json"


def run_curves(run_dir: Path) -> dict:
    """One run's labels and curves: ``pretrain`` [(step, loss)], ``val`` [(total step, accuracy)]."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    offset = cfg["task"].get("pretrain_steps", 0) if cfg["task"].get("spt", "none") != "none" else 0
    curves = {"task": cfg["task"]["name"], "mixer": cfg["model"]["mixer"], "spt": cfg["task"].get("spt", "none"),
              "seed": cfg.get("seed", 0), "pretrain": [], "val": []}
    for phase, key in (("pretrain", "pretrain"), ("finetune", "val")):
        if not (run_dir / phase / "metrics.jsonl").is_file():
            continue
        for r in read_metrics(run_dir / phase):
            if phase == "pretrain" and r.get("split") == "train":
                curves[key].append((r["step"], r["loss"]))
            elif phase == "finetune" and r.get("split") == "eval" and "accuracy" in r:
                curves[key].append((offset + r["step"], r["accuracy"]))
    return curves


def plot_curves(study_dir: str | Path) -> list[Path]:
    """``curves_<task>.png`` per task of the study at ``study_dir`` (module docstring); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run_curves(d) for d in sorted((Path(study_dir) / "runs").iterdir()) if (d / "config.yaml").is_file()]
    written = []
    for task in sorted({r["task"] for r in runs}):
        mine = [r for r in runs if r["task"] == task]
        mixers = sorted({r["mixer"] for r in mine})
        colour = {m: plt.cm.tab10(i) for i, m in enumerate(mixers)}
        fig, (pre, val) = plt.subplots(1, 2, figsize=(11, 4))
        for r in mine:
            label = f"{r['mixer']} {r['spt']} s{r['seed']}"
            style = {"color": colour[r["mixer"]], "linestyle": SPT_STYLE.get(r["spt"], "-")}
            if r["pretrain"]:
                pre.plot(*zip(*r["pretrain"]), label=label, **style)
            if r["val"]:
                val.plot(*zip(*r["val"]), marker=".", label=label, **style)
        pre.set(title=f"{task}: SPT loss", xlabel="pretraining step", ylabel="loss")
        val.set(title=f"{task}: validation accuracy", xlabel="step (pretraining + fine-tuning)", ylabel="accuracy")
        for ax in (pre, val):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(study_dir) / f"curves_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def evaluate_checkpoints(study_dir: str | Path, device: str | None = None,
                         data_dir: str | Path | None = None) -> dict[str, dict]:
    """Test accuracy and loss of each run's latest fine-tuning checkpoint: run id -> {fine-tuning step, test
    accuracy, test loss, finished}, scored by the run's own fine-tuning Trainer (its precision and evaluation
    batch), as the run scores itself when it ends. Runs without a fine-tuning checkpoint are left out.
    ``device`` replaces the runs' own; ``data_dir`` replaces the runs' data folder (a study copied from another
    machine)."""
    from linattn.data.lra import task_info
    from linattn.experiments.lra_run import (
        build_models,
        check_lra_config,
        finetune_trainer,
        load_splits,
        resolve_data_dir,
        score_on_test,
    )
    from linattn.train.checkpoint import load_checkpoint

    out = {}
    for run in sorted((Path(study_dir) / "runs").iterdir()):
        ckpt = run / "finetune" / "checkpoint.pt"
        if not ckpt.is_file():
            continue
        cfg = check_lra_config(yaml.safe_load((run / "config.yaml").read_text()))
        if data_dir is not None:
            cfg["task"]["data_dir"] = str(data_dir)
        info = task_info(cfg["task"]["name"])
        _, clf = build_models(cfg, info.num_classes, len(info.vocab), dual=info.pair)
        splits = load_splits(cfg["task"], resolve_data_dir(cfg["task"], run))
        trainer = finetune_trainer(cfg, clf, splits, device, progress=False)
        state = load_checkpoint(ckpt)
        trainer.model.load_state_dict(state["model"])
        test = score_on_test(trainer, splits)
        out[run.name] = {"finetune_step": state.get("step"), "test_accuracy": test["accuracy"],
                         "test_loss": test["loss"], "finished": (run / "result.json").is_file()}
    return out


def stopped_runs_table(study_dir: str | Path) -> list[str]:
    """Markdown lines for the runs of ``study_dir/checkpoint-test.json`` that had not finished (their test
    accuracy at their last checkpoint); empty without the file or without such runs."""
    path = Path(study_dir) / CHECKPOINT_SCORES
    if not path.is_file():
        return []
    stopped = {k: v for k, v in json.loads(path.read_text()).items() if not v.get("finished", False)}
    if not stopped:
        return []
    lines = ["## Runs stopped before their last step", "",
             f"Test accuracy of each run's last fine-tuning checkpoint ({CHECKPOINT_SCORES}, made by "
             "`python -m linattn.experiments.lra_curves STUDY_DIR --evaluate`); these runs are not in the tables "
             "above.", "", "| run | fine-tuning step | test accuracy |", "| --- | ---: | ---: |"]
    lines += [f"| {run} | {v['finetune_step']} | {v['test_accuracy']:.4f} |" for run, v in sorted(stopped.items())]
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m linattn.experiments.lra_curves", description=__doc__.splitlines()[0])
    p.add_argument("study_dir", type=Path)
    p.add_argument("--evaluate", action="store_true", help="score every run's latest checkpoint on the test split")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: each run's own device)")
    p.add_argument("--data-dir", type=Path, default=None, help="the LRA data, instead of the runs' own folder")
    a = p.parse_args(argv)
    if not (a.study_dir / "runs").is_dir():
        p.error(f"study_dir: {a.study_dir} has no runs/ folder (expected a folder made by 'linattn run lra')")
    for path in plot_curves(a.study_dir):
        print(path)
    if a.evaluate:
        scores = evaluate_checkpoints(a.study_dir, a.device, data_dir=a.data_dir)
        (a.study_dir / CHECKPOINT_SCORES).write_text(json.dumps(scores, indent=2))
        print(json.dumps(scores, indent=2))


if __name__ == "__main__":
    main()
