"""Segmented state scans, cut or not: ``python -m linattn.bench.scan_segments [--ops gla,simple_gla]
[--shapes 8x2048,2x8192,1x32768,packed] [--H 8] [--K 128] [--V 128] [--dtype bfloat16] [--seg-min N] [--device cuda]
[--out F]``.

For each op (gla, simple_gla: the families whose scans are cut, docs/triton.md "Segmented state scans") and shape
(``BxT`` rows, or ``packed``: one row of ``--packed-tokens`` tokens as documents of ``--doc-lengths`` tokens, seeded),
one forward and backward through the Triton backend (initial and final states included) with the launch setting
``segments`` at each of ``--modes``: how many segments the forward scan ran (0: not cut), the median ms of the
forward and backward (host time included, as a caller sees it), and the largest error of the outputs, final states
and every gradient against the ``never`` mode's, relative to that tensor's largest value. Rows are printed as they
finish and rewritten to ``--out`` after each one.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import Iterator

import torch

from linattn import settings
from linattn.bench.model import packed_documents, parse_doc_lengths
from linattn.bench.timing import environment, format_row, median_ms, write_rows
from linattn.ops import get_op

OPS = ("gla", "simple_gla")
MODES = ("never", "auto", "always")


@contextlib.contextmanager
def counting_segments(op: str) -> Iterator[list[int]]:
    """Within the block, the segment count of every fix-up launch of ``op``'s scans, in order (a scan that is not
    cut launches none)."""
    module = importlib.import_module(f"linattn.ops.{op}.triton")
    fix = module.fix_segments
    counts: list[int] = []

    def counted(x, ends, lam, Lam, out, segments, **kwargs):
        counts.append(segments.count)
        return fix(x, ends, lam, Lam, out, segments, **kwargs)

    module.fix_segments = counted
    try:
        yield counts
    finally:
        module.fix_segments = fix


def shape_inputs(op: str, shape: str, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device,
                 packed_tokens: int, doc_lengths: tuple[int, int], seed: int = 0
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(inputs including the initial state, all requiring grad; cu_seqlens or None) of one shape."""
    cu = None
    if shape == "packed":
        offsets = packed_documents(packed_tokens, *doc_lengths, torch.Generator().manual_seed(seed))
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        B, T, rows = 1, packed_tokens, len(offsets) - 1
    else:
        B, T = (int(x) for x in shape.split("x"))
        rows = B
    inputs = get_op(op).example_inputs(B, T, H, K, V, dtype=dtype, device=device, seed=seed)
    inputs["k"] = torch.nn.functional.normalize(inputs["k"].float(), dim=-1).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    inputs["initial_state"] = torch.randn(rows, H, K, V, generator=gen).to(device)
    for x in inputs.values():
        x.requires_grad_(True)
    return inputs, cu


def forward_backward(op: str, inputs: dict[str, torch.Tensor], cu: torch.Tensor | None, do: torch.Tensor,
                     dfinal: torch.Tensor) -> list[torch.Tensor]:
    """Output, final state and the gradient of every input (float32 copies) of one forward and backward."""
    for x in inputs.values():
        x.grad = None
    o, final = get_op(op).fn(**inputs, output_final_state=True, backend="triton", cu_seqlens=cu)
    torch.autograd.backward([o, final], [do, dfinal])
    return [o.detach().float(), final.detach().float()] + [x.grad.float() for x in inputs.values()]


def largest_error(results: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|b|."""
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(results, reference,
                                                                                          strict=True))


def measure(op: str, shape: str, modes: list[str], *, H: int, K: int, V: int, dtype: torch.dtype,
            device: torch.device, repeats: int, packed_tokens: int, doc_lengths: tuple[int, int],
            seg_min: int | None = None) -> list[dict]:
    """One row per mode of ``op`` at ``shape`` (``seg_min``: the shortest segment in chunks; None: the family's)."""
    inputs, cu = shape_inputs(op, shape, H, K, V, dtype, device, packed_tokens, doc_lengths)
    do = torch.randn_like(inputs["v"])
    dfinal = torch.randn_like(inputs["initial_state"])
    rows, reference = [], None
    for mode in ["never"] + [m for m in modes if m != "never"]:
        launch = {"segments": mode} | ({} if seg_min is None else {"seg_min": seg_min})
        with settings(triton_launch={op: launch}):
            with counting_segments(op) as counts:
                results = forward_backward(op, inputs, cu, do, dfinal)
            ms = median_ms(lambda: forward_backward(op, inputs, cu, do, dfinal), device, repeats=repeats, warmup=2)
        reference = results if reference is None else reference
        if mode in modes:
            rows.append({"op": op, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "mode": mode,
                         "segments": counts[0] if counts else 0, "ms": ms,
                         "max_rel_error_vs_never": largest_error(results, reference)})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--shapes", default="8x2048,2x8192,1x32768,packed", help="BxT rows or 'packed'")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--packed-tokens", type=int, default=16384)
    p.add_argument("--doc-lengths", default="64,4096", help="MIN,MAX document length of the packed shape")
    p.add_argument("--seg-min", type=int, default=None, help="shortest segment in chunks (default: the family's)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write the rows as JSON to this file")
    a = p.parse_args(argv)
    ops, modes = a.ops.split(","), a.modes.split(",")
    for name, values, allowed in (("--ops", ops, OPS), ("--modes", modes, MODES)):
        bad = [x for x in values if x not in allowed]
        if bad:
            p.error(f"{name} takes {', '.join(allowed)}, got {', '.join(bad)}")
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    meta = {**environment(device), "H": a.H, "K": a.K, "V": a.V, "packed_tokens": a.packed_tokens,
            "doc_lengths": a.doc_lengths}
    rows: list[dict] = []
    for op in ops:
        for shape in a.shapes.split(","):
            for row in measure(op, shape, modes, H=a.H, K=a.K, V=a.V, dtype=dtype, device=device,
                               repeats=a.repeats, packed_tokens=a.packed_tokens,
                               doc_lengths=parse_doc_lengths(a.doc_lengths), seg_min=a.seg_min):
                print(format_row(row), flush=True)
                rows.append(row)
                if a.out:
                    write_rows(a.out, "scan_segments", meta, rows, announce=False)
    if a.out:
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
