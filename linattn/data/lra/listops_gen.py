"""ListOps generator with the Long Range Arena distribution (Nangia & Bowman 2018; Tay et al. 2021).

A tree node at depth ``d`` (root ``d = 1``) is a leaf digit 0-9 with probability 0.75, always a leaf at
``d = max_depth``; otherwise an operator among MIN, MAX, MED (median, floored), SM (sum mod 10) with
2 to ``max_args`` arguments. A tree's length counts operators, closing brackets and digits; trees
with ``min_length < length < max_length`` are kept, each distinct tree once.

``write_listops`` writes the release layout ``<root>/listops-1000/basic_{train,val,test}.tsv``: a header
``Source<TAB>Target``, then one tree a row. The source string wraps every node of the binary tuple
form of LRA's generator in parentheses: ``[MAX 2 9 ]`` is written ``( ( ( [MAX 2 ) 9 ) ] )``.
"""

from __future__ import annotations

import contextlib
import csv
import random
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from linattn.data.base import check_int
from linattn.errors import GenerationError

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
LEAF_PROB = 0.75
RELEASE_DIR = "listops-1000"

Tree = int | tuple  # a digit, or (operator, (child, child, ...))


def evaluate(tree: Tree) -> int:
    """The value of ``tree``: MIN, MAX, MED = floor of the median, SM = sum mod 10."""
    if isinstance(tree, int):
        return tree
    op, children = tree
    vals = sorted(evaluate(c) for c in children)
    if op == "[MIN":
        return vals[0]
    if op == "[MAX":
        return vals[-1]
    if op == "[MED":
        n = len(vals)
        return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) // 2
    if op == "[SM":
        return sum(vals) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def tree_length(tree: Tree) -> int:
    """Operators + closing brackets + digits of ``tree``."""
    return 1 if isinstance(tree, int) else 2 + sum(tree_length(c) for c in tree[1])


def to_source(tree: Tree) -> str:
    """The release's source string: LRA's left-nested binary tuples ``((op, c1), c2) ... , ])``, each
    tuple wrapped in ``( ... )``."""
    if isinstance(tree, int):
        return str(tree)
    op, children = tree
    s = f"( {op} {to_source(children[0])} )"
    for c in children[1:]:
        s = f"( {s} {to_source(c)} )"
    return f"( {s} {END} )"


def random_tree(rng: random.Random, max_depth: int, max_args: int, depth: int = 1) -> Tree:
    """One random tree from the LRA distribution, starting at ``depth``."""
    if depth >= max_depth or rng.random() < LEAF_PROB:
        return rng.randrange(10)
    n = rng.randint(2, max_args)
    children = tuple(random_tree(rng, max_depth, max_args, depth + 1) for _ in range(n))
    return (rng.choice(OPERATORS), children)


@dataclass(frozen=True)
class ListOpsConfig:
    """Generator parameters; the defaults are LRA's (96000 / 2000 / 2000 trees, 500 < length < 2000)."""

    num_train: int = 96000
    num_val: int = 2000
    num_test: int = 2000
    min_length: int = 500
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10
    seed: int = 0
    max_draws: int = 100_000_000

    def __post_init__(self) -> None:
        for name in ("num_train", "num_val", "num_test", "min_length", "seed"):
            check_int(name, getattr(self, name), 0)
        check_int("max_length", self.max_length, self.min_length + 2)
        check_int("max_depth", self.max_depth, 1)
        check_int("max_args", self.max_args, 2)
        check_int("max_draws", self.max_draws, 1)


# a small, short set for CPU smoke runs (``--smoke`` of the generator, the lra study's smoke preset)
LISTOPS_SMOKE: dict[str, int] = dict(num_train=2000, num_val=200, num_test=200, min_length=20, max_length=200,
                                     max_depth=6, max_args=5)


BLOCK_TREES = 1000  # trees per independently seeded block of draws


def _draw_block(cfg: ListOpsConfig, block: int, draws: int, size: int) -> list[Tree]:
    """Up to ``size`` distinct in-bounds trees from ``draws`` draws of block ``block``'s own random stream
    (seeded by the config's seed and the block's index, so a block is the same whichever process draws it)."""
    rng = random.Random(f"listops-{cfg.seed}-{block}")
    found: dict[Tree, None] = {}
    for _ in range(draws):
        if len(found) >= size:
            break
        tree = random_tree(rng, cfg.max_depth, cfg.max_args)
        if cfg.min_length < tree_length(tree) < cfg.max_length:
            found[tree] = None
    return list(found)


def generate_trees(cfg: ListOpsConfig, workers: int = 1) -> list[Tree]:
    """``num_train + num_val + num_test`` distinct trees with ``min_length < length < max_length``: blocks of
    ``BLOCK_TREES`` trees, each drawn from its own seeded stream, in block order, a tree already taken skipped.
    ``workers`` processes draw the blocks in parallel; the trees do not depend on it. ``max_draws`` is shared by
    the blocks. Raises GenerationError if they do not suffice (bounds too tight)."""
    return _collect(cfg, workers, _draw_block_job)


def _collect(cfg: ListOpsConfig, workers: int, job: Callable[[tuple], list]) -> list:
    """The first ``num_train + num_val + num_test`` distinct items of the blocks' ``job`` results in block order
    (``job`` maps a block's (cfg, block, draws, size) to its trees, or to anything derived one to one from them)."""
    check_int("workers", workers, 1)
    want, size = cfg.num_train + cfg.num_val + cfg.num_test, BLOCK_TREES
    blocks = max(1, -(-want // size))
    draws = max(1, cfg.max_draws // blocks)
    found: dict = {}
    first = 0
    with ProcessPoolExecutor(max_workers=workers) if workers > 1 else contextlib.nullcontext() as pool:
        while len(found) < want:
            # a round of blocks; a block short of trees (bounds too tight) or duplicates across blocks ask for more
            count = -(-(want - len(found)) // size)
            jobs = [(cfg, b, draws, size) for b in range(first, first + count)]
            drawn = pool.map(job, jobs) if pool else map(job, jobs)
            before = len(found)
            for items in drawn:
                found.update(dict.fromkeys(items))
            first += count
            if len(found) < want and (len(found) - before < count * size // 2 or first * draws > cfg.max_draws):
                raise GenerationError(f"only {len(found)} of {want} distinct ListOps trees with {cfg.min_length} < "
                                      f"length < {cfg.max_length} in {first * draws} draws; widen the bounds or raise "
                                      "max_draws")
    return list(found)[:want]


def _draw_block_job(job: tuple[ListOpsConfig, int, int, int]) -> list[Tree]:
    return _draw_block(*job)


def _draw_rows_job(job: tuple[ListOpsConfig, int, int, int]) -> list[tuple[str, int]]:
    """A block's trees as the release's rows (source, label), made in the worker: writing 96,000 trees took the
    parent process longer than drawing them in parallel."""
    return [(to_source(t), evaluate(t)) for t in _draw_block(*job)]


def write_listops(root: str | Path, cfg: ListOpsConfig | None = None, workers: int = 1, **params: object) -> Path:
    """Generate ListOps (``cfg``, or ``ListOpsConfig(**params)``) into ``<root>/listops-1000/``, drawn by
    ``workers`` processes; return that folder. Splits are consecutive slices of the drawn trees (those of
    :func:`generate_trees`): train, val, test."""
    cfg = ListOpsConfig(**params) if cfg is None else cfg
    rows = _collect(cfg, workers, _draw_rows_job)  # a tree's source string is unique to it: the same dedup
    out = Path(root) / RELEASE_DIR
    out.mkdir(parents=True, exist_ok=True)
    bounds = {"train": (0, cfg.num_train), "val": (cfg.num_train, cfg.num_train + cfg.num_val),
              "test": (cfg.num_train + cfg.num_val, len(rows))}
    for split, (a, b) in bounds.items():
        with open(out / f"basic_{split}.tsv", "w", newline="") as f:
            w = csv.writer(f, delimiter="\t")  # csv's default "\r\n" line ends, as the release
            w.writerow(["Source", "Target"])
            w.writerows(rows[a:b])
    return out


__all__ = ["ListOpsConfig", "evaluate", "generate_trees", "random_tree", "to_source", "tree_length",
           "write_listops"]
