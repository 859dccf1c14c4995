"""Is generated Pathfinder learnable by the study's pipeline? ``python -m linattn.experiments.pathfinder_check``.

Two checks on ``<data-dir>/pathfinder<size>/<difficulty>`` (generated first with ``--generate N`` when absent):

1. Audit: for every image of every split (or ``--audit`` of each), the label the loader gives equals the
   connectivity of the two markers read off the token ids a model receives (``pathfinder_oracle``), and
   the labels are balanced.
2. Learnability: a small CNN (``linattn.models.cnn.PixelCNN``) trained on the train split through the
   study's own batches (``LRABatches``) and ``Trainer``, evaluated on the held-out test split. Only the
   model differs from an LRA run, so a CNN well above chance shows that the images, labels and batches
   carry the task, and a sequence model at chance has an optimisation or budget problem, not a data one.

Prints one JSON object (audit, steps, accuracies, seconds); exit code 1 when the audit finds a mismatch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from linattn.data.lra import DIFFICULTIES, LRABatches, get_task, pathfinder_config, whole_split, write_pathfinder
from linattn.data.lra.pathfinder_oracle import audit_pathfinder
from linattn.models.cnn import PixelCNN
from linattn.train.config import TrainConfig
from linattn.train.trainer import Trainer
from linattn.validation import int_arg

TASK = {32: "pathfinder32", 128: "pathx"}
GEN_BATCH = 500  # images per generated metadata batch


def _generate_batch(args: tuple[str, int, str, int, int]) -> None:
    out, size, difficulty, b, seed = args
    write_pathfinder(out, pathfinder_config(size, difficulty), difficulty, num_batches=1, batch_size=GEN_BATCH,
                     seed=seed, first_batch=b)


def generate(data_dir: Path, size: int, difficulty: str, count: int, workers: int, seed: int = 0) -> None:
    """``count`` images (rounded up to whole batches of ``GEN_BATCH``) in the release layout."""
    jobs = [(str(data_dir), size, difficulty, b, seed) for b in range(math.ceil(count / GEN_BATCH))]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        list(pool.map(_generate_batch, jobs))


def audit(data_dir: Path, size: int, difficulty: str, limit: int | None) -> dict:
    """Per split: images checked, label mismatches (must be 0) and the fraction of positives."""
    link = pathfinder_config(size, difficulty).link
    report = {}
    for split in ("train", "val", "test"):
        ds = get_task(TASK[size], data_dir, split, difficulty=difficulty)
        n = len(ds) if limit is None else min(limit, len(ds))
        bad = audit_pathfinder(ds, link, range(n))
        report[split] = {"checked": n, "mismatches": len(bad), "first_mismatches": bad[:5],
                         "positive_fraction": round(float(ds.labels.float().mean()), 4)}
    return report


def train_cnn(data_dir: Path, size: int, difficulty: str, steps: int, batch_size: int, lr: float, width: int,
              seed: int, device: str, num_train: int | None = None) -> dict:
    """Train PixelCNN through LRABatches and the Trainer; val accuracy during training, test at the end."""
    splits = {s: get_task(TASK[size], data_dir, s, difficulty=difficulty) for s in ("train", "val", "test")}
    train = splits["train"]
    if num_train is not None and num_train < len(train):
        train = torch.utils.data.Subset(train, range(num_train))  # the first images (generation order is random)
        train.vocab = splits["train"].vocab
    torch.manual_seed(seed)
    model = PixelCNN(size, 2, width=width, offset=splits["train"].vocab.offset)
    cfg = TrainConfig(max_steps=steps, batch_size=batch_size, lr=lr, weight_decay=0.01,
                      warmup_steps=max(1, steps // 20), eval_every=max(1, steps // 4), eval_batch_size=500,
                      log_every=max(1, steps // 20), seed=seed, device=device, precision="fp32", progress=False)
    trainer = Trainer(model, LRABatches(train, batch_size, seed), cfg, eval_data=whole_split(splits["val"]))
    res = trainer.fit()
    trainer.eval_data = whole_split(splits["test"])
    test = trainer.evaluate()
    return {"steps": res.step, "epochs": round(res.step * batch_size / len(train), 2), "train_images": len(train),
            "val_accuracy": round(res.metrics["accuracy"], 4), "test_accuracy": round(test["accuracy"], 4),
            "test_images": len(splits["test"]), "params": sum(p.numel() for p in model.parameters()),
            "train_s": round(res.wall_s, 1)}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, audit and train; returns the exit code (1: the audit found a wrong label)."""
    p = argparse.ArgumentParser(prog="python -m linattn.experiments.pathfinder_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--size", type=int, choices=(32, 128), default=32)
    p.add_argument("--difficulty", choices=list(DIFFICULTIES), default="curv_contour_length_14")
    p.add_argument("--generate", type=int_arg(GEN_BATCH), default=None,
                   help="images to generate when the data set is absent (whole batches of 500)")
    p.add_argument("--workers", type=int_arg(1), default=2)
    p.add_argument("--audit", type=int_arg(0), default=None, help="images audited per split (default: all)")
    p.add_argument("--steps", type=int_arg(1), default=1200)
    p.add_argument("--batch-size", type=int_arg(1), default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--width", type=int_arg(1), default=16)
    p.add_argument("--num-train", type=int_arg(1), default=None, help="use only the first N training images")
    p.add_argument("--seed", type=int_arg(0), default=0)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    folder = a.data_dir / f"pathfinder{a.size}" / a.difficulty
    t0 = time.perf_counter()
    if not (folder / "metadata").is_dir():
        if a.generate is None:
            p.error(f"{folder} has no metadata/; generate it with --generate N")
        generate(a.data_dir, a.size, a.difficulty, a.generate, a.workers)
    out = {"data": str(folder), "generate_s": round(time.perf_counter() - t0, 1)}
    out["audit"] = audit(a.data_dir, a.size, a.difficulty, a.audit)
    out["cnn"] = train_cnn(a.data_dir, a.size, a.difficulty, a.steps, a.batch_size, a.lr, a.width, a.seed, a.device,
                           a.num_train)
    print(json.dumps(out, indent=2))
    return 1 if any(s["mismatches"] for s in out["audit"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
