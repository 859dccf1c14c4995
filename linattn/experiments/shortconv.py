"""The short-convolution study (the question of "Why does linear attention add Short Conv?").

Claim under test: a short conv on the KEYS turns the state's online regression from "predict
yourself" (k_t -> v_t from one token) into next-token prediction (k_{t-1}, k_t -> v_t), which binds a key
to the value in the NEXT token. So on multi-query associative recall with key and value in adjacent
tokens a 1-layer model needs conv on k (or a shift), conv on q or v helps far less, and on the
"stacked" control (key and value in one token) the conv should not matter. With K = V (``tie_kv``),
exact-regression mixers (MesaNet) should collapse without it.

Grid: mixers x conv placement (none, q, k, v, qk, kv, qkv, the fixed shift of k, the identity kernel
on k) x {recall, stacked} x tie_kv x width x layers x seeds x lrs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from linattn.errors import ConfigError
from linattn.experiments.report import Cell, write_report
from linattn.experiments.study import Study, StudyEntry

CONV_PLACEMENTS: dict[str, dict] = {
    **{name: {"model.mixer_kwargs.short_conv": letters, "model.mixer_kwargs.conv_mode": "learned"}
       for name, letters in [("none", ""), ("q", "q"), ("k", "k"), ("v", "v"), ("qk", "qk"), ("kv", "kv"),
                             ("qkv", "qkv")]},
    "shift-k": {"model.mixer_kwargs.short_conv": "k", "model.mixer_kwargs.conv_mode": "shift"},
    "identity-k": {"model.mixer_kwargs.short_conv": "k", "model.mixer_kwargs.conv_mode": "identity"},
}
TASKS = {"recall": {"task.name": "mqar"}, "stacked": {"task.name": "stacked_mqar"}}
TIE = {"no": {"model.mixer_kwargs.tie_kv": False}, "yes": {"model.mixer_kwargs.tie_kv": True}}
FULL_MIXERS = ["linear_attn", "retention", "gla", "delta_rule", "gated_delta_rule", "mesa_net", "softmax_attn"]


def _axes(mixers: list[str], convs: list[str], ties: list[str], widths: list[int], layers: list[int]) -> dict:
    return {
        "task": dict(TASKS),
        "mixer": {m: {"model.mixer": m} for m in mixers},
        "layers": {str(n): {"model.n_layers": n} for n in layers},
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
}


def shortconv_study(preset: str = "smoke") -> Study:
    """The study for ``preset`` ("smoke" or "full")."""
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


def conclusion(study: Study, cells: list[Cell]) -> str:
    """The findings, computed from the numbers: per task the winning placement, its margin over the
    runner-up and over no conv, whether the margin exceeds seed noise (2 x pooled seed std / sqrt(n)),
    how k compares with q and v, and the tie_kv (K = V) effect on each mixer."""
    lines = []
    for task in study.axes["task"]:
        m = _placement_means(cells, task=task)
        if not m:
            continue
        ranked = sorted(m, key=lambda c: m[c][0], reverse=True)
        best, mean, std, n = ranked[0], *m[ranked[0]]
        noise = 2 * std / max(n, 1) ** 0.5
        text = f"- **{task}**: best placement `{best}` ({mean:.3f} averaged over {n} settings)"
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
                lines.append(f"- **{task}, K = V (tie_kv)**, no conv -> conv on k: " + "; ".join(parts) + ".")
    return "\n".join(lines)


def shortconv_report(study: Study, study_dir: Path, rows: list[dict]) -> None:
    write_report(study, study_dir, rows, conclusion=conclusion)


SHORTCONV_STUDY = StudyEntry("shortconv", tuple(PRESETS), shortconv_study, shortconv_report)
