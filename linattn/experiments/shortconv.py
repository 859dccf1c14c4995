"""The short-convolution study (the question of "Why does linear attention add Short Conv?").

Claim under test: a short conv on the KEYS turns the state's online regression from "predict
yourself" (k_t -> v_t from one token) into next-token prediction (k_{t-1}, k_t -> v_t), which binds a key
to the value in the NEXT token. So on multi-query associative recall with key and value in adjacent
tokens a 1-layer model needs conv on k (or a shift), conv on q or v helps far less, and on the
"stacked" control (key and value in one token) the conv should not matter. With K = V (``tie_kv``),
exact-regression mixers (MesaNet) should collapse without it.

Grid: mixers x conv placement (none, q, k, v, qk, kv, qkv, the fixed shift of k, the identity kernel
on k) x {recall, stacked} x tie_kv x width x layers x seeds x lrs.

Preset ``v2`` tests K = V exactly (``tie_kv="exact"``: the value fed to the op is its key, after the key's
conv, feature map and normalisation; ``tie_kv=True`` only shares the projection) and trains the 2-layer
settings longer with an lr sweep, so that depth is compared at (near) convergence.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from linattn.errors import ConfigError
from linattn.experiments.report import Cell, change, difference, find_cell, write_report
from linattn.experiments.study import Study, StudyEntry

CONV_PLACEMENTS: dict[str, dict] = {
    **{name: {"model.mixer_kwargs.short_conv": letters, "model.mixer_kwargs.conv_mode": "learned"}
       for name, letters in [("none", ""), ("q", "q"), ("k", "k"), ("v", "v"), ("qk", "qk"), ("kv", "kv"),
                             ("qkv", "qkv")]},
    "shift-k": {"model.mixer_kwargs.short_conv": "k", "model.mixer_kwargs.conv_mode": "shift"},
    "identity-k": {"model.mixer_kwargs.short_conv": "k", "model.mixer_kwargs.conv_mode": "identity"},
}
TASKS = {"recall": {"task.name": "mqar"}, "stacked": {"task.name": "stacked_mqar"}}
# "yes" shares k's projection with v (K and V still differ by k's conv, feature map and norm); "exact": v is k
TIE = {"no": {"model.mixer_kwargs.tie_kv": False}, "yes": {"model.mixer_kwargs.tie_kv": True},
       "exact": {"model.mixer_kwargs.tie_kv": "exact"}}
V2_MIXERS = ["gla", "delta_rule", "gated_delta_rule", "mesa_net", "ttt_linear", "softmax_attn"]
V2_CONVS = ["none", "k", "v", "qkv", "shift-k", "identity-k"]
# 1 layer keeps the full preset's 300 steps (comparable with its results). In the full preset the 1-layer runs
# that reached 0.99 did so by step 50-300 (median 200), but 229 of the 243 that ended between 0.2 and 0.99 had
# their best eval at step 300, i.e. were still climbing, and only 4 of 252 2-layer runs reached 0.99. 2 layers
# get 1000 steps: over 3x the longest and 5x the median time-to-0.99 of 1 layer, with a 3x wider lr range. A
# 1-layer setting stopped at 300 steps that still beats its 2-layer counterpart is thus a conservative flag.
V2_STEPS = {1: 300, 2: 1000}
V2_EXCLUDE = (
    # exact K = V makes v the key fed to the op: the layer refuses a conv on v
    [{"tie_kv": "exact", "conv": c} for c in ("v", "qkv")]
    # K = V is a 1-layer question; tie_kv=True (shared projection) is kept only as the full preset's reference
    # for exact K = V: on recall, at none and k
    + [{"tie_kv": t, "layers": "2"} for t in ("yes", "exact")] + [{"tie_kv": "yes", "task": "stacked"}]
    + [{"tie_kv": "yes", "conv": c} for c in ("v", "qkv", "shift-k", "identity-k")]
    # depth at the placements that decide each task: none (stacked), k and the shift of k (recall)
    + [{"layers": "2", "conv": c} for c in ("v", "qkv", "identity-k")]
)
FULL_MIXERS = ["linear_attn", "retention", "gla", "delta_rule", "gated_delta_rule", "mesa_net", "softmax_attn"]


def _steps(steps: int | None) -> dict:
    """The overrides that give one axis value its own training length (none: the base's)."""
    if steps is None:
        return {}
    return {"train.max_steps": steps, "train.warmup_steps": max(1, steps // 10)}


def _axes(mixers: list[str], convs: list[str], ties: list[str], widths: list[int], layers: list[int],
          layer_steps: dict[int, int] | None = None) -> dict:
    """The grid's axes; ``layer_steps`` (layers -> max_steps) trains deeper models longer."""
    steps = layer_steps or {}
    return {
        "task": dict(TASKS),
        "mixer": {m: {"model.mixer": m} for m in mixers},
        "layers": {str(n): {"model.n_layers": n, **_steps(steps.get(n))} for n in layers},
        "width": {str(w): {"model.d_model": w} for w in widths},
        "tie_kv": {t: TIE[t] for t in ties},
        "conv": {c: CONV_PLACEMENTS[c] for c in convs},
    }


def _base(vocab: int, seq_len: int, pairs: int, steps: int, batch: int, eval_every: int, eval_examples: int) -> dict:
    return {
        "task": {"name": "mqar", "vocab": vocab, "seq_len": seq_len, "num_kv_pairs": pairs, "power_a": 0.01},
        "model": {"mixer": "gla", "d_model": 64, "n_layers": 1, "n_heads": 2, "mlp": False, "mixer_kwargs": {}},
        "train": {"max_steps": steps, "batch_size": batch, "warmup_steps": max(1, steps // 10), "weight_decay": 0.1,
                  "eval_every": eval_every, "eval_batch_size": 128, "target_metric": "accuracy",
                  "target_value": 0.99, "log_every": 25},
        "eval_examples": eval_examples,
        "eval_seed": 1234,
    }


PRESETS: dict[str, dict] = {
    # CPU, 2 cores: ~4-5 minutes of compute. One layer, the placements that separate the hypotheses.
    "smoke": {
        "base": _base(vocab=32, seq_len=48, pairs=6, steps=150, batch=32, eval_every=50, eval_examples=256),
        "axes": _axes(["gla", "gated_delta_rule"], ["none", "q", "k", "v", "shift-k"], ["no"], [64], [1]),
        "seeds": [0, 1],
        "lrs": [3e-3],
    },
    # One H100, ~25 minutes with many worker processes; splits into 10-minute invocations (--resume).
    "full": {
        "base": _base(vocab=64, seq_len=64, pairs=8, steps=300, batch=64, eval_every=50, eval_examples=512),
        "axes": _axes(FULL_MIXERS, list(CONV_PLACEMENTS), ["no", "yes"], [64, 128], [1, 2]),
        "exclude": [{"width": "128", "tie_kv": "yes"}, {"width": "128", "layers": "2"},
                    {"tie_kv": "yes", "layers": "2"}],
        "seeds": [0, 1],
        "lrs": [3e-3],
    },
    # One H100, at most ~38 minutes with 16 workers in --max-minutes 9 invocations (--resume): 168 settings,
    # 6 mixers x {recall, stacked} x {1 layer: 6 placements untied, 4 with exact K = V, none/k with tie_kv=True
    # on recall; 2 layers, 1000 steps: none, k, shift-k}; 2 seeds x 3 lrs: 1008 runs, 453,600 run-steps before
    # early stops (the full preset: 288,800 run-steps in 21 minutes; 2-layer mesa_net costs 2.4x a mean step).
    "v2": {
        "base": _base(vocab=64, seq_len=64, pairs=8, steps=300, batch=64, eval_every=50, eval_examples=512),
        "axes": _axes(V2_MIXERS, V2_CONVS, ["no", "yes", "exact"], [64], [1, 2], layer_steps=V2_STEPS),
        "exclude": V2_EXCLUDE,
        "seeds": [0, 1],
        "lrs": [1e-3, 3e-3, 1e-2],
    },
}


def shortconv_study(preset: str = "smoke") -> Study:
    """The study for ``preset`` ("smoke", "full" or "v2")."""
    if preset not in PRESETS:
        raise ConfigError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = PRESETS[preset]
    return Study.from_dict({
        "name": "shortconv", "description": f"Short convolution placement on associative recall (preset {preset}). "
        + __doc__.split("\n\n")[1].replace("\n", " "),
        "base": p["base"], "axes": p["axes"], "exclude": p.get("exclude", []), "seeds": p["seeds"],
        "lrs": p["lrs"], "metric": "accuracy", "report": {"facet": "task", "cols": "conv"}})


def _placement_means(cells: list[Cell], **fixed: str) -> dict[str, tuple[float, float, int]]:
    """Per conv placement: (mean over settings of the best-over-lr score, pooled seed std, #settings)."""
    out: dict[str, tuple[float, float, int]] = {}
    by_conv: dict[str, list[Cell]] = {}
    for c in cells:
        if all(c.labels.get(k) == v for k, v in fixed.items()):
            by_conv.setdefault(c.labels["conv"], []).append(c)
    for conv, group in by_conv.items():
        pooled = statistics.fmean(c.std ** 2 for c in group) ** 0.5
        out[conv] = (statistics.fmean(c.mean for c in group), pooled, len(group))
    return out


def conclusion(study: Study, cells: list[Cell], **fixed: str) -> str:
    """The findings, computed from the numbers: per task the winning placement, its margin over the
    runner-up and over no conv, whether the margin exceeds seed noise (2 x pooled seed std / sqrt(n)),
    how k compares with q and v, and the tie_kv (K = V) effect on each mixer. ``fixed`` (axis=label) limits the
    placement ranking to settings where every placement was run, so that each is averaged over the same ones."""
    lines = []
    where = "".join(f", {k}={v}" for k, v in fixed.items())
    for task in study.axes["task"]:
        m = _placement_means(cells, task=task, **fixed)
        if not m:
            continue
        ranked = sorted(m, key=lambda c: m[c][0], reverse=True)
        best, mean, std, n = ranked[0], *m[ranked[0]]
        noise = 2 * std / max(n, 1) ** 0.5
        text = f"- **{task}{where}**: best placement `{best}` ({mean:.3f} averaged over {n} settings)"
        if len(ranked) > 1:
            margin = mean - m[ranked[1]][0]
            verdict = "exceeds" if margin > noise else "does not exceed"
            text += f", ahead of `{ranked[1]}` by {margin:.3f}, which {verdict} the seed noise ({noise:.3f})"
        if "none" in m and best != "none":
            text += f"; no conv scores {m['none'][0]:.3f} ({mean - m['none'][0]:+.3f} for `{best}`)"
        gains = {c: m[c][0] - m["none"][0] for c in ("q", "k", "v") if c in m and "none" in m}
        if gains:
            text += "; gain over no conv: " + ", ".join(f"{c} {g:+.3f}" for c, g in gains.items())
            top = max(gains, key=gains.get)
            if gains[top] > noise:
                text += f" ({top} helps most)"
            else:
                text += " (none of q, k, v alone beats no conv beyond the seed noise)"
        lines.append(text + ".")
    if "tie_kv" in study.axes and "yes" in study.axes["tie_kv"]:
        for task in study.axes["task"]:
            parts = []
            for mixer in study.axes["mixer"]:
                tied = _placement_means(cells, task=task, mixer=mixer, tie_kv="yes")
                if "none" in tied and "k" in tied:
                    parts.append(f"{mixer} {tied['none'][0]:.2f} -> {tied['k'][0]:.2f}")
            if parts:
                lines.append(f"- **{task}, tie_kv=yes (v shares k's projection)**, no conv -> conv on k: "
                             + "; ".join(parts) + ".")
    return "\n".join(lines)


NOISE_NOTE = ("- **Seed noise**: a difference between two settings is called beyond the seed noise when it exceeds "
              "2 standard errors of the difference, 2 sqrt(s_a^2/n_a + s_b^2/n_b) (s: the std over seeds at the "
              "setting's best lr, n: its seeds); the placement margins above use the pooled std of their "
              "settings instead. Differences within it are not conclusions.")


def _counterpart(cell: Cell, **labels: str) -> dict[str, str]:
    """``cell``'s labels with ``labels`` replaced: the setting it is compared with."""
    return {**cell.labels, **labels}


def _setting_name(cell: Cell, skip: tuple[str, ...]) -> str:
    return ", ".join(f"{k}={v}" for k, v in cell.labels.items() if k not in skip)


def exact_kv_lines(study: Study, cells: list[Cell]) -> list[str]:
    """Per task and mixer with exact K = V rows: the change from no conv to conv on k under K = V, and the change
    from separate K and V to exact K = V at each placement, each with its verdict against the seed noise."""
    lines = []
    for task in study.axes["task"]:
        for mixer in study.axes["mixer"]:
            exact = [c for c in cells if c.labels.get("task") == task and c.labels.get("mixer") == mixer
                     and c.labels.get("tie_kv") == "exact"]
            if not exact:
                continue
            parts = []
            none = find_cell(exact, conv="none")
            k = find_cell(exact, conv="k")
            if none is not None and k is not None:
                parts.append(f"no conv {none.mean:.2f} -> conv on k {k.mean:.2f}: {change(none, k)}")
            for c in exact:
                sep = find_cell(cells, **_counterpart(c, tie_kv="no"))
                if sep is not None:
                    parts.append(f"{c.labels['conv']}: separate {sep.mean:.2f} -> exact {c.mean:.2f}: "
                                 f"{change(sep, c)}")
            lines.append(f"- **{task}, {mixer}, exact K = V**: " + "; ".join(parts) + ".")
    return lines


def depth_lines(cells: list[Cell], solved_at: float | None = None) -> list[str]:
    """2 layers against 1 layer, setting by setting: how many differ beyond the seed noise, and a flag naming
    every 2-layer setting below its 1-layer counterpart beyond it (a deeper model can represent the 1-layer
    solution, so it scores below only when undertrained or at a bad lr). Two settings whose means both reach
    ``solved_at`` (the runs' early-stop target) tie: a run stops at its first evaluation at or above the target,
    so how far above it the score lands depends on when that evaluation fell, not on the model."""
    pairs = [(one, two) for two in cells if two.labels.get("layers") == "2"
             if (one := find_cell(cells, **_counterpart(two, layers="1"))) is not None]
    if not pairs:
        return []
    below, above, solved = [], 0, 0
    for one, two in pairs:
        diff, noise = difference(one, two)
        if solved_at is not None and min(one.mean, two.mean) >= solved_at:
            solved += 1
        elif one.n >= 2 and two.n >= 2 and abs(diff) > noise:
            if diff < 0:
                below.append(f"{_setting_name(two, ('layers',))} ({two.mean:.3f} vs {one.mean:.3f}, "
                             f"{diff:+.3f}, noise {noise:.3f}, best lr {two.best_lr:g})")
            else:
                above += 1
    both = f", {solved} where both reach the early-stop target {solved_at:g} (a tie)" if solved_at is not None else ""
    lines = [f"- **2 layers against 1 layer** ({len(pairs)} settings): {above} score above their 1-layer "
             f"counterpart beyond the seed noise, {len(below)} below it{both}, "
             f"{len(pairs) - above - len(below) - solved} within it (or with one seed)."]
    if below:
        lines.append("- **Flag: 2 layers below 1 layer beyond the seed noise** (undertrained or a bad lr, not a "
                     "finding about depth): " + "; ".join(below) + ".")
    return lines


def shortconv_conclusion(study: Study, cells: list[Cell]) -> str:
    """:func:`conclusion`, then the exact K = V changes, the depth comparison and how seed noise is judged."""
    # v2 runs every placement only untied at 1 layer (exact K = V refuses v, 2 layers run three placements)
    v2 = "exact" in study.axes.get("tie_kv", {})
    lines = [conclusion(study, cells, **({"tie_kv": "no", "layers": "1"} if v2 else {}))]
    if v2:
        lines += exact_kv_lines(study, cells)
    target = study.base.get("train", {}).get("target_value")
    lines += depth_lines(cells, solved_at=None if target is None else float(target))
    lines.append(NOISE_NOTE)
    return "\n".join(line for line in lines if line)


def shortconv_report(study: Study, study_dir: Path, rows: list[dict]) -> None:
    write_report(study, study_dir, rows, conclusion=shortconv_conclusion)


SHORTCONV_STUDY = StudyEntry("shortconv", tuple(PRESETS), shortconv_study, shortconv_report)
