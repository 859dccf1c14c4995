"""ShortConv speed: the multiply-add path (ShortConv's default), ``F.conv1d`` and the Triton kernels, in one process.

    python -m linattn.bench.shortconv --device cuda --out shortconv.json

For each (T, D): median forward and forward+backward times of one ``ShortConv(D, kernel_size=W)`` (float32
weights, SiLU, no bias, inputs in --dtype, no cache) through each backend, the ratios muladd / triton and
conv1d / triton (above 1: triton is faster), and each backend's error against muladd on the forward output
(a fast wrong kernel is a bug, not a result). Defaults: on CUDA B=4, T in {2048, 16384}, D in {1024, 2048,
4096}, W=4, bf16; on the CPU small float32 shapes, and "triton" only under TRITON_INTERPRET=1.
Rows are printed as they are measured; --out writes them all as JSON.
"""

from __future__ import annotations

import argparse
import os

import torch

from linattn.layers.shortconv import ShortConv
from linattn.testing import rel_err

from .timing import format_row, median_ms, triton_version, write_rows

BACKENDS = ("muladd", "conv1d", "triton")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def bench_shape(B: int, T: int, D: int, W: int, dtype: torch.dtype, device: torch.device, repeats: int,
                backends: tuple[str, ...]) -> dict:
    """One row: {backend}_fwd_ms, {backend}_fwdbwd_ms, {backend}_err for each backend, and the ratios."""
    torch.manual_seed(0)
    conv = ShortConv(D, kernel_size=W).to(device)
    x = torch.randn(B, T, D, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(B, T, D, device=device, dtype=dtype)
    row: dict = {"B": B, "T": T, "D": D, "W": W, "dtype": str(dtype).removeprefix("torch.")}
    reference = None
    for backend in backends:
        conv.backend = backend

        def fwd():
            with torch.no_grad():
                return conv(x)[0]

        def fwdbwd():
            x.grad, conv.weight.grad = None, None
            conv(x)[0].backward(dy)

        y = fwd()
        reference = y if reference is None else reference
        row[f"{backend}_err"] = rel_err(y, reference)
        row[f"{backend}_fwd_ms"] = median_ms(fwd, device, repeats, warmup=3)
        row[f"{backend}_fwdbwd_ms"] = median_ms(fwdbwd, device, repeats, warmup=3)
    if "triton" in backends:
        for other in (b for b in backends if b != "triton"):
            for what in ("fwd", "fwdbwd"):
                row[f"{other}_over_triton_{what}"] = row[f"{other}_{what}_ms"] / row[f"triton_{what}_ms"]
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--B", type=int, default=None, help="batch (4 on CUDA, 1 on the CPU)")
    p.add_argument("--T", default=None, help="comma list (2048,16384 on CUDA; 64,256 on the CPU)")
    p.add_argument("--D", default=None, help="comma list (1024,2048,4096 on CUDA; 64,128 on the CPU)")
    p.add_argument("--W", type=int, default=4, help="kernel size")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="input dtype (bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per median (20 on CUDA, 3 on the CPU)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    B = a.B or (4 if cuda else 1)
    Ts = _ints(a.T or ("2048,16384" if cuda else "64,256"))
    Ds = _ints(a.D or ("1024,2048,4096" if cuda else "64,128"))
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    repeats = a.repeats or (20 if cuda else 3)
    backends = BACKENDS if cuda or os.environ.get("TRITON_INTERPRET") == "1" else BACKENDS[:2]
    if "triton" not in backends:
        print("triton skipped: needs CUDA (or TRITON_INTERPRET=1 on the CPU)", flush=True)
    rows = []
    for T in Ts:
        for D in Ds:
            row = bench_shape(B, T, D, a.W, dtype, device, repeats, backends)
            rows.append(row)
            print(format_row(row), flush=True)
    if a.out:
        meta = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                "triton": triton_version()}
        write_rows(a.out, "shortconv", meta, rows)
    return rows


if __name__ == "__main__":
    main()
