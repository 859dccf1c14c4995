"""Generate LRA data locally: ``python -m linattn.data.lra listops|pathfinder --out DIR [options]``.

ListOps defaults to the release (96000/2000/2000 trees, 500 < length < 2000); ``--smoke`` makes a
small, short set for CPU smoke runs. Pathfinder writes ``--batches`` metadata batches of
``--batch-size`` images each, in parallel over ``--workers`` processes (batch b is seeded by (seed, b)).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from linattn.validation import int_arg

from .listops_gen import LISTOPS_SMOKE, ListOpsConfig, write_listops
from .pathfinder_gen import DIFFICULTIES, pathfinder_config, write_pathfinder


def _one_batch(args: tuple[str, int, str, int, int, int]) -> None:
    out, size, difficulty, b, batch_size, seed = args
    write_pathfinder(out, pathfinder_config(size, difficulty), difficulty, num_batches=1, batch_size=batch_size,
                     seed=seed, first_batch=b)


def main(argv: list[str] | None = None, prog: str = "python -m linattn.data.lra") -> None:
    """Parse ``argv`` and write the data set; a bad flag exits with code 2 naming it (argparse)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="task", required=True)
    lo = sub.add_parser("listops", help="write <out>/listops-1000/basic_{train,val,test}.tsv")
    lo.add_argument("--out", type=Path, required=True)
    lo.add_argument("--smoke", action="store_true", help=f"small set: {LISTOPS_SMOKE}")
    lo.add_argument("--seed", type=int_arg(0), default=0)
    for split, default in (("train", 96000), ("val", 2000), ("test", 2000)):
        lo.add_argument(f"--num-{split}", type=int_arg(1), default=None,
                        help=f"trees in the {split} split (release: {default})")
    lo.add_argument("--workers", type=int_arg(1), default=1,
                    help="processes drawing the trees (the trees do not depend on it)")
    pf = sub.add_parser("pathfinder", help="write <out>/pathfinder<size>/<difficulty>/{imgs,metadata}")
    pf.add_argument("--out", type=Path, required=True)
    pf.add_argument("--size", type=int, choices=(32, 128), default=32)
    pf.add_argument("--difficulty", choices=list(DIFFICULTIES), default="curv_contour_length_14")
    pf.add_argument("--batches", type=int_arg(1), default=10)
    pf.add_argument("--batch-size", type=int_arg(1), default=100)
    pf.add_argument("--seed", type=int_arg(0), default=0)
    pf.add_argument("--workers", type=int_arg(1), default=1)
    a = p.parse_args(argv)
    if a.task == "listops":
        sizes = {f"num_{s}": getattr(a, f"num_{s}") for s in ("train", "val", "test")
                 if getattr(a, f"num_{s}") is not None}
        cfg = ListOpsConfig(seed=a.seed, **{**(LISTOPS_SMOKE if a.smoke else {}), **sizes})
        print(write_listops(a.out, cfg, workers=a.workers))
        return
    jobs = [(str(a.out), a.size, a.difficulty, b, a.batch_size, a.seed) for b in range(a.batches)]
    with ProcessPoolExecutor(max_workers=a.workers) as pool:
        list(pool.map(_one_batch, jobs))
    print(a.out / f"pathfinder{a.size}" / a.difficulty)


if __name__ == "__main__":
    main()
