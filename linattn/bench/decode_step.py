"""One decoding step of each matrix-state family: the PyTorch step vs the fused Triton kernel, in one process.

    python -m linattn.bench.decode_step --device cuda --out decode_step.json [--sweep]

For simple_gla, gla, delta_rule and gated_delta_rule at B in {1, 16}, H=16, K=V=128 (q, k, v in bf16, gates
and beta float32, state float32), the time per step (µs, median over repeats of --steps consecutive steps
carrying the state) of:

- torch:          the op's PyTorch step (its reference, what runs on the CPU);
- fused:          the Triton kernel, new state each step (what the ops' step functions use on CUDA);
- fused_inplace:  the Triton kernel updating the state in place;
- op_step_torch / op_step_fused: the public step function (argument checks included; the delta rules'
  beta range check synchronises with the host) with the step backend forced to "torch" / "triton".

Each row also has torch / fused ratios, the fused kernel's state traffic in GB/s (state read + written),
and its error against the PyTorch step after one step. ``--sweep`` adds the fused kernel at other launch
settings (value block BV, warps). On the CPU: small float32 shapes, fused rows only under TRITON_INTERPRET=1.
Rows are printed as they are measured; --out writes them all as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable

import torch

from linattn.ops.common.triton_step import set_step_backend
from linattn.ops.delta_rule import delta_rule_step
from linattn.ops.gated_delta_rule import gated_delta_rule_step
from linattn.ops.gated_delta_rule.reference import gated_delta_step_reference
from linattn.ops.gla import gla_step
from linattn.ops.gla.reference import gla_step_reference
from linattn.ops.simple_gla import simple_gla_step
from linattn.ops.simple_gla.reference import simple_gla_step_reference
from linattn.testing import l2norm, rel_err

from .timing import format_row, median_ms, write_rows

FAMILIES = ("simple_gla", "gla", "delta_rule", "gated_delta_rule")
KERNEL_OF = {"simple_gla": "simple_gla", "gla": "gla", "delta_rule": "gated_delta_rule",
             "gated_delta_rule": "gated_delta_rule"}
REFERENCE = {"simple_gla": simple_gla_step_reference, "gla": gla_step_reference,
             "delta_rule": gated_delta_step_reference, "gated_delta_rule": gated_delta_step_reference}
PUBLIC = {"simple_gla": simple_gla_step, "gla": gla_step, "delta_rule": delta_rule_step,
          "gated_delta_rule": gated_delta_rule_step}


def step_inputs(family: str, B: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device) -> dict:
    """One token's q, k, v (dtype), g, beta (float32; None where the family has none) and a float32 state."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, generator=gen) for n in (K, K, V))
    delta = "delta" in family
    g = None if family == "delta_rule" else -0.1 * torch.rand(B, H, *((K,) if family == "gla" else ()), generator=gen)
    beta = torch.rand(B, H, generator=gen) if delta else None
    x = {"q": q, "k": l2norm(k) if delta else k, "v": v}
    out = {name: t.to(device=device, dtype=dtype) for name, t in x.items()}
    out.update(g=None if g is None else g.to(device), beta=None if beta is None else beta.to(device),
               state=0.1 * torch.randn(B, H, K, V, generator=gen).to(device))
    return out


def step_calls(family: str, x: dict, fused: bool) -> dict[str, Callable]:
    """Each implementation as ``state -> (o_t, new state)`` on the token ``x``."""
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    scale = q.shape[-1] ** -0.5
    ref_args = (g,) if family in ("simple_gla", "gla") else (g, beta)
    public_args = {name: a for name, a in (("g", g), ("beta", beta)) if a is not None}
    calls = {"torch": lambda S: REFERENCE[family](q, k, v, *ref_args, S, scale=scale)}
    if fused:
        from linattn.ops.common.triton_step_kernel import STEP_KERNELS, fused_step

        gate = {"simple_gla": "scalar", "gla": "vector", "delta_rule": "none", "gated_delta_rule": "scalar"}[family]
        calls["fused"] = lambda S: STEP_KERNELS[KERNEL_OF[family]](q, k, v, *ref_args, S, scale=scale)
        calls["fused_inplace"] = lambda S: fused_step(q, k, v, S, scale=scale, gate=gate, g_t=g, beta_t=beta,
                                                      inplace=True)
    calls["op_step"] = lambda S: PUBLIC[family](q, k, v, **public_args, state=S, scale=scale)
    return calls


def per_step_us(call: Callable, state: torch.Tensor, steps: int, repeats: int, device: torch.device) -> float:
    """Median time of one step (µs) over ``repeats`` runs of ``steps`` consecutive steps carrying the state."""
    holder = [state.clone()]

    def run() -> None:
        S = holder[0]
        for _ in range(steps):
            S = call(S)[1]
        holder[0] = S  # decays < 1 and unit keys keep the carried state bounded

    return 1e3 * median_ms(run, device, repeats, warmup=2) / steps


def bench_family(family: str, B: int, H: int, K: int, V: int, dtype: torch.dtype, device: torch.device, steps: int,
                 repeats: int, fused_ok: bool, sweep: bool) -> list[dict]:
    """The rows of one family at one batch size: the implementations, then (with ``sweep``) launch settings."""
    x = step_inputs(family, B, H, K, V, dtype, device)
    calls = step_calls(family, x, fused_ok)
    base = {"family": family, "B": B, "H": H, "K": K, "V": V, "dtype": str(dtype).removeprefix("torch.")}
    row = dict(base)
    with torch.no_grad():
        for name, call in calls.items():
            if name == "op_step":
                for backend in ("torch", "triton") if fused_ok else ("torch",):
                    previous = set_step_backend(backend)
                    row[f"op_step_{'fused' if backend == 'triton' else 'torch'}_us"] = per_step_us(
                        call, x["state"], steps, repeats, device)
                    set_step_backend(previous)
            else:
                row[f"{name}_us"] = per_step_us(call, x["state"], steps, repeats, device)
        if fused_ok:
            o_ref, S_ref = calls["torch"](x["state"])
            o, S = calls["fused"](x["state"])
            row.update(fused_err_o=rel_err(o, o_ref), fused_err_state=rel_err(S, S_ref),
                       torch_over_fused=row["torch_us"] / row["fused_us"],
                       op_step_torch_over_fused=row["op_step_torch_us"] / row["op_step_fused_us"],
                       fused_state_GBps=2 * x["state"].numel() * 4 / (row["fused_us"] * 1e3))
    rows = [row]
    if fused_ok and sweep:
        from linattn.ops.common import triton_step_kernel as kernel

        default = dict(kernel.LAUNCH)
        try:
            for BV, warps in itertools.product((16, 32, 64, 128), (1, 2, 4, 8)):
                kernel.LAUNCH.update(BV=BV, num_warps=warps)
                with torch.no_grad():
                    us = per_step_us(calls["fused"], x["state"], steps, repeats, device)
                rows.append({**base, "impl": f"fused BV={BV} warps={warps}", "BV": BV, "num_warps": warps,
                             "fused_us": us})
        finally:
            kernel.LAUNCH.clear()
            kernel.LAUNCH.update(default)
    return rows


def _launch() -> dict | None:
    """The fused kernel's default launch settings (None without Triton)."""
    try:
        from linattn.ops.common.triton_step_kernel import LAUNCH
    except ImportError:
        return None
    return dict(LAUNCH)


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--B", default=None, help="comma list of batch sizes (1,16 on CUDA; 1,2 on the CPU)")
    p.add_argument("--H", type=int, default=None, help="heads (16 on CUDA, 2 on the CPU)")
    p.add_argument("--K", type=int, default=None, help="key dim (128 on CUDA, 32 on the CPU)")
    p.add_argument("--V", type=int, default=None, help="value dim (as K)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="q, k, v dtype (bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--steps", type=int, default=None, help="consecutive steps per timing (100 on CUDA, 3 on the CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timings per median (20 on CUDA, 3 on the CPU)")
    p.add_argument("--sweep", action="store_true", help="also time the fused kernel at other launch settings")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    families = [f for f in a.families.split(",") if f]
    for f in families:
        if f not in FAMILIES:
            p.error(f"--families: unknown family {f!r}; choose from {', '.join(FAMILIES)}")
    K = a.K or (128 if cuda else 32)
    H, V = a.H or (16 if cuda else 2), a.V or K
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    steps, repeats = a.steps or (100 if cuda else 3), a.repeats or (20 if cuda else 3)
    fused_ok = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if not fused_ok:
        print("fused rows skipped: need CUDA (or TRITON_INTERPRET=1 on the CPU)", flush=True)
    rows = []
    for family in families:
        for B in _ints(a.B or ("1,16" if cuda else "1,2")):
            for row in bench_family(family, B, H, K, V, dtype, device, steps, repeats, fused_ok, a.sweep):
                rows.append(row)
                print(format_row(row), flush=True)
    if a.out:
        meta = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                "step_launch": _launch()}
        write_rows(a.out, "decode_step", meta, rows)
    return rows


if __name__ == "__main__":
    main()
