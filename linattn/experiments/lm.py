"""The language-modelling study: mixers x short-conv placement x exact K = V on real text, scored in bits per byte.

Claim under test: on language modelling the short convolution matters (the FLA group's DeltaNet at 340M loses
28.24 -> 29.08 Wikitext perplexity without it), mostly through the conv on the keys; and with K = V exactly
(the value fed to the op is its key) the regression-style mixers need the conv more than the others. Grid:
mixer (a Transformer, softmax_attn, beside linear-attention and state-space mixers) x conv placement
(none, k, qkv, a fixed shift of k) x kv (separate projections, or exact K = V) x seeds; a run is of kind
``lm`` (:mod:`linattn.experiments.lm_run`). Score: test bits per byte; validation bits per byte is logged
over training.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from pathlib import Path

from linattn.data.text.corpus import stdlib_docs_sources
from linattn.errors import ConfigError, MissingFileError
from linattn.experiments.lm_run import KIND
from linattn.experiments.report import Cell, change, find_cell, write_report
from linattn.experiments.shortconv import CONV_PLACEMENTS
from linattn.experiments.study import Study, StudyEntry

MIXERS = ("softmax_attn", "delta_rule", "gated_delta_rule", "gla", "mamba2", "mesa_net", "forgetting_attn")
CONVS = ("none", "k", "qkv", "shift-k")
KV = {"separate": {"model.mixer_kwargs.tie_kv": False}, "exact": {"model.mixer_kwargs.tie_kv": "exact"}}
# mamba2's "keys" (B) and "values" (x) differ in width and role: no K = V; with K = V a conv on v is the conv
# on k (the layer refuses it), so qkv has no exact-K=V counterpart
EXCLUDE = [{"mixer": "mamba2", "kv": "exact"}, {"conv": "qkv", "kv": "exact"}]
# MesaNet solves its read-out system by 16 conjugate-gradient steps, as its authors' GPU code does: the exact
# solver's per-token K x K Cholesky factorisations took 103 ms and 3.4 GiB per layer (forward and backward, bf16,
# B=32, T=512, H=4, K=64 on an H100) against 16 CG steps' 6.5 ms, within 1e-4 relative RMS of it
MIXER_SETTINGS: dict[str, dict] = {"mesa_net": {"model.mixer_kwargs.solver": "cg", "model.mixer_kwargs.cg_steps": 16}}
TRANSFORMER = "softmax_attn"
REFERENCE_CONV = "qkv"  # the FLA layers' default placement: the changes are measured from it
METRIC = "test_bpb"


def _base(task: dict, model: dict, train: dict) -> dict:
    return {"kind": KIND, "task": {"name": "text", **task},
            "model": {"mixer": TRANSFORMER, **model, "mixer_kwargs": {}},
            "train": {"target_metric": "loss", "weight_decay": 0.1, **train}}


PRESETS: dict[str, dict] = {
    # CPU, 2 cores, 2 workers: ~6 minutes. Bytes, 2 layers d=64, 150 steps of 16 x 128 bytes; the Transformer
    # (no conv) and gated_delta_rule with conv none / k / qkv, separate and exact K = V; 2 seeds.
    "smoke": {
        "base": _base({"tokenizer": "bytes", "seq_len": 128, "eval_windows": 32, "test_windows": 64},
                      {"d_model": 64, "n_layers": 2, "n_heads": 2},
                      {"max_steps": 150, "batch_size": 16, "warmup_steps": 15, "eval_every": 50, "log_every": 25,
                       "eval_batch_size": 64}),
        "mixers": ["softmax_attn", "gated_delta_rule"], "convs": ["none", "k", "qkv"],
        "exclude": [{"mixer": TRANSFORMER, "conv": "k"}, {"mixer": TRANSFORMER, "conv": "qkv"},
                    {"mixer": TRANSFORMER, "kv": "exact"}],
        "seeds": [0, 1], "lrs": [3e-3],
    },
    # One H100, resumable in --max-minutes 9 invocations: 138 runs, 539 run-minutes (3-5 minutes each beside
    # 6-15 others), about an hour of wall time. BPE 4096 trained on the train split, 4 layers d=256 (3.95-4.52M
    # parameters), 1500 steps of 32 x 512 tokens, every mixer x placement x kv; 3 seeds.
    "full": {
        "base": _base({"tokenizer": "bpe", "vocab_size": 4096, "seq_len": 512, "eval_windows": 64,
                       "test_windows": 512},
                      {"d_model": 256, "n_layers": 4, "n_heads": 4},
                      {"max_steps": 1500, "batch_size": 32, "warmup_steps": 100, "eval_every": 150, "log_every": 50,
                       "eval_batch_size": 32}),
        "mixers": list(MIXERS), "convs": list(CONVS), "exclude": [],
        "seeds": [0, 1, 2], "lrs": [2e-3],
    },
}
# The full preset on a corpus twice as large: the standard library's *.py plus the Python documentation's
# reStructuredText sources (*.rst.txt of Debian's python3.11-doc 3.11.2-6+deb12u8, 497 files, 11.0 MB), one
# corpus whose paths are prefixed stdlib/ and docs/ (so its stdlib files split differently from full's). Measured
# with Python 3.11.7 and BPE 4096 trained on its train split: train 1097 files (648 stdlib + 449 docs), 20.1 MB,
# 5.82M tokens; validation 78 files (50 + 28), 1.69 MB, 0.49M tokens; test 52 files (32 + 20), 1.30 MB, 0.37M
# tokens; unigram entropy of the train split 2.828 bits per byte (stdlib alone: 3.20M train tokens, 2.720).
# 1500 steps of 32 x 512 tokens see the train split about 4 times instead of about 8. Same grid, models and
# steps as full; the documentation folder comes from --corpus-root, else $LINATTN_PYTHON_DOCS, else
# data/python-docs (DOCS_FETCH writes it). Not yet run on a GPU.
PRESETS["full-docs"] = {**PRESETS["full"], "docs": True}
DOCS_ENV = "LINATTN_PYTHON_DOCS"
DEFAULT_DOCS_DIR = "data/python-docs"
DOCS_FETCH = "python -m linattn.data.text python-docs --out"


def docs_root(corpus_root: str | None = None) -> str:
    """The documentation folder of the full-docs preset: ``corpus_root``, else $LINATTN_PYTHON_DOCS, else
    data/python-docs."""
    return corpus_root or os.environ.get(DOCS_ENV) or DEFAULT_DOCS_DIR


def check_docs_folder(path: str) -> str:
    """``path`` as an absolute folder holding ``*.rst.txt`` files (run processes may start elsewhere);
    MissingFileError naming --corpus-root and the command that fetches the files otherwise."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        why = "does not exist"
    elif next(folder.rglob("*.rst.txt"), None) is None:
        why = "has no *.rst.txt file"
    else:
        return str(folder)
    raise MissingFileError(f"--corpus-root: the full-docs preset reads the Python documentation sources from "
                           f"{path}, which {why}; fetch them with '{DOCS_FETCH} {path}' (Debian's python3.X-doc "
                           f"package, about 12 MB), or give their folder with --corpus-root or ${DOCS_ENV}")


def lm_study(preset: str = "smoke", corpus_root: str | None = None) -> Study:
    """The study at ``preset`` ("smoke", "full" or "full-docs"); ``corpus_root``: full-docs' documentation
    folder (:func:`docs_root`; not checked here, so that listing the presets needs no files)."""
    if preset not in PRESETS:
        raise ConfigError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = PRESETS[preset]
    base = p["base"]
    if p.get("docs"):
        base = copy.deepcopy(base)
        base["task"]["sources"] = stdlib_docs_sources(docs_root(corpus_root))
    elif corpus_root is not None:
        raise ConfigError(f"preset {preset!r} reads the standard library only; a documentation folder is for "
                          f"preset full-docs", field="--corpus-root")
    return Study.from_dict({
        "name": "lm", "description": f"Language modelling on real text (preset {preset}). "
        + __doc__.split("\n\n")[1].replace("\n", " "),
        "base": base,
        "axes": {"mixer": {m: {"model.mixer": m, **MIXER_SETTINGS.get(m, {})} for m in p["mixers"]},
                 "conv": {c: CONV_PLACEMENTS[c] for c in p["convs"]},
                 "kv": dict(KV)},
        "exclude": EXCLUDE + p["exclude"], "seeds": p["seeds"], "lrs": p["lrs"], "metric": METRIC,
        "report": {"facet": "kv", "rows": ["mixer"], "cols": "conv"}})


# -- the report ------------------------------------------------------------------------------------------
def conclusion(study: Study, cells: list[Cell], rows: list[dict]) -> str:
    """The findings, computed: the unigram baseline and how far below it each setting lands; per mixer the
    change in test bits per byte from removing the conv, from the conv on k alone and from the shift of k
    (each against the reference placement qkv) and from exact K = V; whether each exceeds the seed noise
    (2 standard errors of the difference); the spread of parameter counts."""
    finished = [r for r in rows if r.get("status") == "finished"]
    lines = []
    unigram = [float(r["unigram_bpb"]) for r in finished if r.get("unigram_bpb") is not None]
    if unigram:
        base = statistics.fmean(unigram)
        below = [c for c in cells if c.mean < base]
        best = min(cells, key=lambda c: c.mean)
        lines.append(f"- **Baseline**: the unigram entropy of the training split is {base:.3f} bits per byte; "
                     f"{len(below)} of {len(cells)} settings score below it. Best: "
                     f"{', '.join(f'{k}={v}' for k, v in best.labels.items())} at {best.mean:.3f} ± {best.std:.3f} "
                     f"({base - best.mean:.3f} below the baseline).")
        for mixer, conv in ((TRANSFORMER, "none"), ("gated_delta_rule", "k"), ("gated_delta_rule", REFERENCE_CONV)):
            c = find_cell(cells, mixer=mixer, conv=conv, kv="separate")
            if c is not None:
                margin = base - c.mean
                sure = "clearly " if margin > 2 * c.std + 0.1 else ""
                lines.append(f"- {mixer} (conv {conv}): {c.mean:.3f} ± {c.std:.3f}, {margin:.3f} bits per byte "
                             f"{sure}{'below' if margin > 0 else 'above'} the unigram entropy.")
    for mixer in study.axes["mixer"]:
        ref = find_cell(cells, mixer=mixer, conv=REFERENCE_CONV, kv="separate")
        parts = []
        for conv, what in (("none", "removing the conv"), ("k", "conv on k alone"), ("shift-k", "shift of k")):
            text = change(ref, find_cell(cells, mixer=mixer, conv=conv, kv="separate"))
            if text is not None:
                parts.append(f"{what} {text}")
        exact = [f"conv {conv}: {text}" for conv in study.axes["conv"]
                 if (text := change(find_cell(cells, mixer=mixer, conv=conv, kv="separate"),
                                    find_cell(cells, mixer=mixer, conv=conv, kv="exact"))) is not None]
        if parts:
            lines.append(f"- **{mixer}**, change in test bits per byte against conv {REFERENCE_CONV} "
                         f"({ref.mean:.3f}; negative: fewer bits, better): " + "; ".join(parts) + ".")
        if exact:
            lines.append(f"- **{mixer}, exact K = V** against separate K and V: " + "; ".join(exact) + ".")
    params: dict[str, set[int]] = {}
    for r in finished:
        if r.get("num_params"):
            params.setdefault(str(r["kv"]), set()).add(int(r["num_params"]))
    if params:
        spans = [f"{kv} K and V {min(n):,} to {max(n):,} (max/min {max(n) / min(n):.3f})" for kv, n in params.items()]
        lines.append("- **Parameters**: " + "; ".join(spans) + " (exact K = V has no value projection).")
    return "\n".join(lines)


def _setting(row: dict, axes: list[str]) -> str:
    return " | ".join(f"{row[a]}" for a in axes)


def validation_curves(study: Study, study_dir: Path, rows: list[dict]) -> dict[str, dict[int, float]]:
    """Per setting, the validation bits per byte at each evaluated step, averaged over seeds (and lrs)."""
    axes = list(study.axes)
    sums: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        path = study_dir / "runs" / r["run_id"] / "metrics.jsonl"
        if r.get("status") != "finished" or not path.is_file() or not r.get("val_bpb_per_nat"):
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if rec.get("split") == "eval":
                per = sums.setdefault(_setting(r, axes), {}).setdefault(int(rec["step"]), [])
                per.append(float(rec["loss"]) * float(r["val_bpb_per_nat"]))
    return {s: {step: statistics.fmean(v) for step, v in sorted(by.items())} for s, by in sums.items()}


def plot_curves(curves: dict[str, dict[int, float]], unigram: float | None, path: Path) -> bool:
    """Validation bits per byte over training, one line per setting; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), marker="o", markersize=3, label=name)
    if unigram is not None:
        ax.axhline(unigram, color="grey", linestyle="--", label=f"unigram entropy ({unigram:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def lm_report(study: Study, study_dir: Path, rows: list[dict]) -> None:
    """report.md (tables, heatmaps, conclusion), results.csv, and the validation curves (curves.csv, curves.png)."""
    write_report(study, study_dir, rows, conclusion=lambda s, c: conclusion(s, c, rows))
    curves = validation_curves(study, study_dir, rows)
    unigram = [float(r["unigram_bpb"]) for r in rows if r.get("unigram_bpb") is not None]
    base = statistics.fmean(unigram) if unigram else None
    lines = ["setting,step,val_bpb"] + [f"{name},{step},{v:.5f}" for name, curve in curves.items()
                                        for step, v in curve.items()]
    (study_dir / "curves.csv").write_text("\n".join(lines) + "\n")
    text = ["", "## Validation bits per byte over training", "",
            f"Mean over seeds per setting ({' | '.join(study.axes)}); numbers in curves.csv."
            + (f" Dashed: the unigram entropy of the training split ({base:.3f})." if base is not None else ""), ""]
    text.append("![validation curves](curves.png)" if curves and plot_curves(curves, base, study_dir / "curves.png")
                else "(no plot: no curves, or matplotlib is not installed)")
    with open(study_dir / "report.md", "a") as f:
        f.write("\n".join(text) + "\n")


def add_lm_options(group: argparse._ArgumentGroup) -> None:
    """The flags of ``linattn run lm``."""
    group.add_argument("--corpus-root", default=None, metavar="DIR",
                       help=f"preset full-docs: the folder of the Python documentation's *.rst.txt sources "
                            f"(default ${DOCS_ENV}, else {DEFAULT_DOCS_DIR}); '{DOCS_FETCH} DIR' fetches them")


def lm_study_from_args(args: argparse.Namespace, workers: int) -> Study:
    """The study of ``linattn run lm [--preset P] [--corpus-root DIR]``; full-docs checks its folder first."""
    corpus_root = getattr(args, "corpus_root", None)
    if PRESETS[args.preset].get("docs"):
        corpus_root = check_docs_folder(docs_root(corpus_root))
    return lm_study(args.preset, corpus_root)


LM_STUDY = StudyEntry("lm", tuple(PRESETS), lm_study, lm_report, add_lm_options, ("corpus_root",),
                      lm_study_from_args)
