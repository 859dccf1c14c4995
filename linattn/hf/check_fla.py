"""Check the FLA import against FLA itself: build small FLA models with random weights, save them with FLA's
``save_pretrained``, convert with :func:`from_fla`, and compare the logits of both on the same tokens.

    python -m linattn.hf.check_fla --out DIR [--device cuda] [--dtypes bfloat16,float32] [--families ...]

Needs FLA (``fla``) importable. Prints one JSON summary (and writes it to DIR/summary.json): per family, dtype
and length, the relative RMS error of our logits against FLA's, the max abs difference, the share of positions
whose argmax agree, and ``ok`` (relative RMS error within the dtype's tolerance). Two lengths are run because
FLA's layers switch kernels with the length (fused recurrent up to 64 tokens, chunked above). Where FLA itself
fails to run (e.g. a kernel that refuses the GPU), that case reports ``fla_error`` instead of a comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from . import from_fla

# relative RMS error of the logits allowed per dtype (the two sides run different kernels in that dtype)
TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 2e-3}
FAMILIES = ("delta_net", "gated_deltanet", "gla", "mamba2")
VOCAB = 512


def fla_model(family: str) -> torch.nn.Module:
    """A small FLA model of ``family`` with FLA's initialisation (2 layers, hidden 128)."""
    import fla.models as fm

    common = dict(hidden_size=128, num_hidden_layers=2, vocab_size=VOCAB)
    if family == "delta_net":
        return fm.DeltaNetForCausalLM(fm.DeltaNetConfig(**common, num_heads=2, use_gate=True))
    if family == "gated_deltanet":
        return fm.GatedDeltaNetForCausalLM(fm.GatedDeltaNetConfig(**common, num_heads=2, head_dim=64))
    if family == "gla":
        return fm.GLAForCausalLM(fm.GLAConfig(**common, num_heads=2, tie_word_embeddings=True))
    if family == "mamba2":
        return fm.Mamba2ForCausalLM(fm.Mamba2Config(**common, head_dim=32, state_size=32, n_groups=2))
    raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """Random weights around FLA's initialisation, so that no parameter sits at a value (norm weights of one, a
    zero bias) where a wrong mapping would go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        scale = 0.2 * max(float(p.float().std()) if p.numel() > 1 else 0.0, 0.05)
        p.add_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    ours, theirs = ours.float(), theirs.float()
    diff = ours - theirs
    return {"rel_rmse": float(diff.square().mean().sqrt() / theirs.square().mean().sqrt().clamp_min(1e-30)),
            "max_abs_diff": float(diff.abs().max()),
            "argmax_agree": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())}


def check_family(family: str, out: Path, device: str, dtypes: list[str], lengths: list[int]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = fla_model(family)
    perturb(model, seed=1)
    path = out / family
    model.save_pretrained(path)
    ours = from_fla(path)
    rows = []
    ids = torch.randint(0, VOCAB, (2, max(lengths)), generator=torch.Generator().manual_seed(2))
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        theirs_m = model.to(device=device, dtype=dtype).eval()
        ours_m = ours.to(device=device, dtype=dtype).eval()
        for T in lengths:
            x = ids[:, :T].to(device)
            row: dict[str, Any] = {"family": family, "dtype": dtype_name, "T": T}
            try:
                with torch.no_grad():
                    theirs = theirs_m(input_ids=x, use_cache=False).logits
            except Exception as exc:  # FLA's own failure is a result here, not a crash of the check
                row.update(ok=None, fla_error=f"{type(exc).__name__}: {str(exc)[:300]}")
                rows.append(row)
                continue
            with torch.no_grad():
                mine, _ = ours_m(x, use_cache=False)
            row.update(compare(mine, theirs))
            row["ok"] = bool(row["rel_rmse"] <= TOLERANCE[dtype_name])
            rows.append(row)
    return rows


def write_summary(summary: dict[str, Any], out: Path) -> None:
    compared = [r for r in summary["rows"] if r.get("ok") is not None]
    summary["all_compared_ok"] = bool(compared) and all(r["ok"] for r in compared)
    summary["fla_failed"] = [f"{r['family']} {r.get('dtype')} T={r.get('T')}" for r in summary["rows"]
                             if r.get("ok") is None]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the FLA checkpoints and summary.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--lengths", default="48,200", help="token counts (FLA uses recurrent kernels up to 64)")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in TOLERANCE:
            parser.error(f"--dtypes: {d!r} is not one of {', '.join(TOLERANCE)}")
    lengths = [int(t) for t in args.lengths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import fla

    summary: dict[str, Any] = {"device": args.device, "torch": torch.__version__,
                               "fla": getattr(fla, "__version__", "?"), "tolerance_rel_rmse": TOLERANCE, "rows": []}
    if args.device.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name()
    for family in args.families.split(","):
        try:
            rows = check_family(family, out, args.device, dtypes, lengths)
        except Exception as exc:  # a conversion failure: reported with its traceback, the other families still run
            rows = [{"family": family, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=6)}]
        summary["rows"] += rows
        for row in rows:
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        write_summary(summary, out)  # after each family: a check stopped by a time limit keeps what it compared
    print(json.dumps({k: summary[k] for k in ("all_compared_ok", "fla_failed")}))
    return 0 if summary["all_compared_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
