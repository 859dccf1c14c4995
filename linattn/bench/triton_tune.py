"""Measure alternative launch settings of the Triton kernels on a GPU (run by hand on the device):

    python -m linattn.bench.triton_tune [--T 16384]

For each setting: forward and forward+backward time of simple_gla at the benchmark shape, and the
error against the default setting (a setting that changes the numbers beyond rounding is a bug).
The chosen defaults live in ``LAUNCH`` of each kernel module; they depend on the head dims only.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from linattn.ops.simple_gla import triton as sgla_triton

from .timing import median_ms


def tune_simple_gla(B: int = 4, T: int = 16384, H: int = 16, K: int = 128, V: int = 128) -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, T, H, d, device=dev, generator=gen, dtype=torch.bfloat16) for d in (K, K, V))
    g = -0.1 * torch.rand(B, T, H, device=dev, generator=gen)
    do = torch.randn_like(v)
    default = dict(sgla_triton.LAUNCH)
    results = []
    ref = None
    for BV, sw, ow, gBV, gw in itertools.product([32, 64], [4, 8], [4, 8], [32, 64], [4, 8]):
        sgla_triton.LAUNCH.update(BV=BV, scan_warps=sw, out_warps=ow, grads_BV=gBV, grads_warps=gw)
        fwd = lambda: sgla_triton.simple_gla_triton_forward(q, k, v, g, K ** -0.5, None, 64)
        bwd = lambda: sgla_triton.simple_gla_triton_backward(q, k, v, g, K ** -0.5, None, 64, do, None)
        out = bwd()
        if ref is None:
            ref = out
        err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(out, ref))
        row = dict(BV=BV, scan_warps=sw, out_warps=ow, grads_BV=gBV, grads_warps=gw,
                   fwd_ms=median_ms(fwd, dev, 10), bwd_ms=median_ms(bwd, dev, 10), err_vs_first=err)
        print(row, flush=True)
        results.append(row)
    sgla_triton.LAUNCH.update(default)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=16384)
    rows = tune_simple_gla(T=parser.parse_args().T)
    best = min(rows, key=lambda r: r["fwd_ms"] + r["bwd_ms"])
    print("best:", best)
