"""From result rows to results.csv, report.md and heatmaps.

The compared number of a setting (one label per axis) is its best-over-lr score: for each lr the
mean of ``metric`` over seeds; the best lr by that mean; reported as mean +/- std (sample std) over
seeds at that lr. A diverged run counts as 0 (for accuracies; +inf for losses).
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from linattn.experiments.study import Study

LEADING = ("run_id", "status", "seed", "lr")


@dataclass
class Cell:
    """The best-over-lr score of one setting."""

    labels: dict[str, str]
    best_lr: float
    mean: float
    std: float
    n: int
    by_lr: dict[float, float]


def find_cell(cells: list[Cell], **labels: str) -> Cell | None:
    """The first cell whose labels include ``labels``, or None."""
    for c in cells:
        if all(c.labels.get(k) == v for k, v in labels.items()):
            return c
    return None


def difference(a: Cell, b: Cell) -> tuple[float, float]:
    """(b - a, the seed noise of that difference: 2 standard errors)."""
    se = math.sqrt(a.std ** 2 / max(a.n, 1) + b.std ** 2 / max(b.n, 1))
    return b.mean - a.mean, 2 * se


def change(a: Cell | None, b: Cell | None) -> str | None:
    """``b - a`` as text with its verdict against the seed noise; None when either cell is missing."""
    if a is None or b is None:
        return None
    diff, noise = difference(a, b)
    if a.n < 2 or b.n < 2:
        return f"{diff:+.3f} (one seed: noise unknown)"
    verdict = "beyond" if abs(diff) > noise else "within"
    return f"{diff:+.3f} ({verdict} the seed noise {noise:.3f})"


def lower_is_better(metric: str) -> bool:
    # losses and bits per byte (bpb) fall as models improve
    return "loss" in metric or metric.endswith("bpb")


def write_csv(rows: list[dict], axes: list[str], path: Path) -> None:
    """One row per run: every axis label, seed, lr, status, metrics, steps, wall time."""
    keys = list(LEADING[:2]) + axes + list(LEADING[2:])
    for r in rows:
        keys += [k for k in r if k not in keys and k != "message"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _score(row: dict, metric: str) -> float:
    value = row.get(metric)
    if row.get("status") == "diverged" or value is None or not math.isfinite(float(value)):
        return math.inf if lower_is_better(metric) else 0.0
    return float(value)


def aggregate(rows: list[dict], axes: list[str], metric: str) -> list[Cell]:
    """Best-over-lr mean +/- std over seeds for every setting present in ``rows`` (first-seen order)."""
    groups: dict[tuple, dict[float, list[float]]] = {}
    for r in rows:
        key = tuple(str(r[a]) for a in axes)
        groups.setdefault(key, {}).setdefault(float(r["lr"]), []).append(_score(r, metric))
    cells = []
    pick = min if lower_is_better(metric) else max
    for key, by_lr in groups.items():
        means = {lr: statistics.fmean(v) for lr, v in by_lr.items()}
        best = pick(means, key=lambda lr: means[lr])
        vals = by_lr[best]
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        cells.append(Cell(dict(zip(axes, key)), best, means[best], std, len(vals), means))
    return cells


def layout(study: Study) -> tuple[str | None, list[str], str]:
    """(facet axis or None, row axes, column axis) from ``study.report`` (defaults: no facet, the last
    axis as columns, the others as rows)."""
    axes = list(study.axes)
    facet = study.report.get("facet")
    cols = study.report.get("cols", axes[-1] if axes else None)
    varied = [a for a in axes if len(study.axes[a]) > 1]  # single-valued axes only clutter the labels
    rows = study.report.get("rows") or [a for a in varied if a not in (facet, cols)]
    extra = [a for a in varied if a not in (facet, cols) and a not in rows]
    return facet, list(rows) + extra, cols


def _pivot(cells: list[Cell], rows: list[str], cols: str) -> tuple[list[tuple], list[str], dict]:
    row_keys, col_keys, table = [], [], {}
    for c in cells:
        rk, ck = tuple(c.labels[a] for a in rows), c.labels[cols]
        if rk not in row_keys:
            row_keys.append(rk)
        if ck not in col_keys:
            col_keys.append(ck)
        table[rk, ck] = c
    return row_keys, col_keys, table


def facets(cells: list[Cell], facet: str | None) -> dict[str, list[Cell]]:
    out: dict[str, list[Cell]] = {}
    for c in cells:
        out.setdefault(c.labels[facet] if facet else "all", []).append(c)
    return out


def markdown_table(cells: list[Cell], rows: list[str], cols: str) -> str:
    row_keys, col_keys, table = _pivot(cells, rows, cols)
    head = rows or [""]
    lines = [f"| {' | '.join(head)} | {cols}: " + " | ".join(col_keys) + " |",
             "|" + "---|" * (len(head) + len(col_keys))]
    for rk in row_keys:
        vals = [f"{table[rk, ck].mean:.3f} ± {table[rk, ck].std:.3f}" if (rk, ck) in table else "-"
                for ck in col_keys]
        lines.append("| " + " | ".join((list(rk) or ["score"]) + vals) + " |")
    return "\n".join(lines)


def heatmap(cells: list[Cell], rows: list[str], cols: str, title: str, path: Path, metric: str) -> None:
    """A rows x cols heatmap of best-over-lr means, each cell annotated mean (std)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    row_keys, col_keys, table = _pivot(cells, rows, cols)
    data = np.full((len(row_keys), len(col_keys)), np.nan)
    for (rk, ck), c in table.items():
        data[row_keys.index(rk), col_keys.index(ck)] = c.mean
    label_width = max([len(" | ".join(rk)) for rk in row_keys] + [4])
    fig, ax = plt.subplots(figsize=(2.5 + 0.07 * label_width + 0.8 * len(col_keys), 2.0 + 0.4 * len(row_keys)))
    bounded = not lower_is_better(metric) and "acc" in metric
    im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0 if bounded else None, vmax=1.0 if bounded else None)
    ax.set_xticks(range(len(col_keys)), col_keys, rotation=45, ha="right")
    ax.set_yticks(range(len(row_keys)), [" | ".join(rk) or "score" for rk in row_keys])
    ax.set_xlabel(cols)
    ax.set_ylabel(" | ".join(rows))
    for (rk, ck), c in table.items():
        i, j = row_keys.index(rk), col_keys.index(ck)
        ax.text(j, i, f"{c.mean:.2f}\n({c.std:.2f})", ha="center", va="center", fontsize=6,
                color="white" if (bounded and c.mean < 0.6) else "black")
    fig.colorbar(im, ax=ax, label=f"best-over-lr {metric}")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(study: Study, study_dir: Path, rows: list[dict],
                 conclusion: Callable[[Study, list[Cell]], str] | None = None) -> list[Cell]:
    """Write results.csv, report.md and one heatmap per facet value into ``study_dir``."""
    axes = list(study.axes)
    order = {spec.run_id: i for i, spec in enumerate(study.runs())}
    rows = sorted(rows, key=lambda r: order.get(r["run_id"], len(order)))  # grid order
    write_csv(rows, axes, study_dir / "results.csv")
    total = len(study.runs())
    cells = aggregate(rows, axes, study.metric)
    facet, row_axes, col_axis = layout(study)
    diverged = sum(r["status"] == "diverged" for r in rows)
    wall = sum(float(r.get("wall_s") or 0.0) for r in rows)
    lines = [f"# Study `{study.name}`", "", study.description, "",
             f"Runs finished: {len(rows)} / {total} ({diverged} diverged, counted as failures); "
             f"training time summed over runs: {wall / 60:.1f} min. Seeds {study.seeds}, lrs {study.lrs}.", "",
             f"Score: eval `{study.metric}`, best over lr (by the mean over seeds), as mean ± std over seeds.", ""]
    if len(rows) < total:
        lines += [f"**Incomplete**: {total - len(rows)} runs left; rerun with `--resume`.", ""]
    if conclusion is not None and cells:
        lines += ["## Conclusion", "", conclusion(study, cells), ""]
    for value, group in facets(cells, facet).items():
        name = f"{facet}={value}" if facet else "all runs"
        png = f"heatmap_{value}.png" if facet else "heatmap.png"
        if col_axis is not None:
            try:
                heatmap(group, row_axes, col_axis, f"{study.name}: {name}", study_dir / png, study.metric)
                image = [f"![{name}]({png})", ""]
            except ImportError:
                image = ["(no heatmap: matplotlib is not installed)", ""]
            lines += [f"## {name}", "", *image, markdown_table(group, row_axes, col_axis), ""]
    lines += ["## Every setting", "", "| " + " | ".join(axes) + " | best lr | score | seeds |",
              "|" + "---|" * (len(axes) + 3)]
    for c in cells:
        lines.append("| " + " | ".join(c.labels[a] for a in axes)
                     + f" | {c.best_lr:g} | {c.mean:.3f} ± {c.std:.3f} | {c.n} |")
    (study_dir / "report.md").write_text("\n".join(lines) + "\n")
    return cells
