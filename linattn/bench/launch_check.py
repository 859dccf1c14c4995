"""Check Triton launch settings on a GPU: each config in its own process, every output and gradient vs the recurrence.

    python -m linattn.bench.launch_check --family gated_delta_rule --configs '[{}, {"wy_warps": 4}]' [--out x.json]

A launch config is a JSON object of ``LAUNCH`` keys of the family's kernel module (``linattn/ops/<family>/triton.py``);
it reaches the kernels through the environment variable ``LINATTN_TRITON_LAUNCH`` (``launch_overrides`` in
``ops/common/triton_utils.py``). Each config runs in a fresh subprocess, because a miscompiled kernel can kill the
CUDA context (illegal memory access) and would take every later config down with it. In the subprocess, for each case
the op runs forward and backward with ``backend="triton"`` and with ``backend="recurrent"`` in float32 on the same
(dtype-rounded) inputs; the relative error ||a - b|| / ||b|| of the output and of every input gradient is recorded,
with whether all were finite, and the forward+backward time of the last (largest) case.

Families: gated_delta_rule (its kernels also run delta_rule, comba and gated_delta_product), gla, simple_gla.
Cases (B, T, H, K = V, dtype, log gates uniform in [gate_min, 0], keys repeated in runs of ``repeat``):

- lra_bf16:    8, 1024, 4,  32, bfloat16, g in [-4, 0],  keys repeated in runs of 32 (what LRA layers see);
- strong_fp32: 1,  130, 1,  16, float32,  g in [-20, 0] (strong decay, odd T);
- big_bf16:    2, 2048, 4, 128, bfloat16, g in [-4, 0] (timed).

``--small`` shrinks the shapes so the check runs on the CPU under ``TRITON_INTERPRET=1`` (set for the subprocesses).
Status per config: ok (finite, every error within tolerance: 2e-4 float32, 3e-2 bfloat16), inaccurate, nan, crash
(exception or the process died; the message or its stderr tail is kept), timeout. One line per config is printed;
``--out`` writes all results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from linattn.bench.timing import median_ms
from linattn.testing import rel_rmse

FAMILIES = ("gated_delta_rule", "gla", "simple_gla")
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
RESULT_TAG = "LAUNCH_CHECK_RESULT "


@dataclass(frozen=True)
class Case:
    """One check: shapes, dtype of q, k, v (gates and beta stay float32), gate range, key repetition."""

    name: str
    B: int
    T: int
    H: int
    K: int
    dtype: torch.dtype
    gate_min: float
    repeat: int = 1


CASES = (
    Case("lra_bf16", 8, 1024, 4, 32, torch.bfloat16, -4.0, repeat=32),
    Case("strong_fp32", 1, 130, 1, 16, torch.float32, -20.0),
    Case("big_bf16", 2, 2048, 4, 128, torch.bfloat16, -4.0),
)
SMALL_CASES = (
    Case("lra_bf16", 1, 48, 1, 16, torch.bfloat16, -4.0, repeat=8),
    Case("strong_fp32", 1, 67, 1, 16, torch.float32, -20.0),
    Case("big_bf16", 1, 80, 2, 32, torch.bfloat16, -4.0),
)


def case_inputs(family: str, case: Case, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """The op's float32 inputs for ``case`` (q, k, v already rounded to ``case.dtype``): L2-normalised q and k
    (k repeated in runs of ``case.repeat`` tokens), v normal, g uniform in [gate_min, 0] per head ([B, T, H]) or per
    key channel for gla ([B, T, H, K]), beta uniform in (0, 1) for the delta rule."""
    B, T, H, K = case.B, case.T, case.H, case.K
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    runs = -(-T // case.repeat)
    k = F.normalize(torch.randn(B, runs, H, K, generator=gen), dim=-1).repeat_interleave(case.repeat, dim=1)[:, :T]
    v = torch.randn(B, T, H, K, generator=gen)
    g = case.gate_min * torch.rand(*((B, T, H, K) if family == "gla" else (B, T, H)), generator=gen)
    x = dict(q=q, k=k, v=v, g=g)
    if family == "gated_delta_rule":
        x["beta"] = torch.rand(B, T, H, generator=gen)
    x.update({n: x[n].to(case.dtype).float() for n in ("q", "k", "v")})
    return {n: t.to(device) for n, t in x.items()}


def forward_backward(family: str, inputs: dict[str, torch.Tensor], do: torch.Tensor, dtype: torch.dtype,
                     backend: str) -> dict[str, torch.Tensor]:
    """o and the gradient of sum(o * do) for every input, all float32; q, k, v are passed in ``dtype``."""
    from linattn.ops import get_op

    leaves = {n: (t.to(dtype) if n in ("q", "k", "v") else t).detach().requires_grad_(True) for n, t in inputs.items()}
    o, _ = get_op(family).fn(**leaves, backend=backend)
    (o.float() * do).sum().backward()
    return {"o": o.detach().float(), **{f"d{n}": t.grad.float() for n, t in leaves.items()}}


def check_case(family: str, case: Case, device: torch.device) -> dict:
    """Errors of the Triton op vs the float32 recurrence for one case, finiteness and pass/fail."""
    inputs = case_inputs(family, case, device)
    do = torch.randn(inputs["v"].shape, generator=torch.Generator().manual_seed(1)).to(device)
    ref = forward_backward(family, inputs, do, torch.float32, "recurrent")
    out = forward_backward(family, inputs, do, case.dtype, "triton")
    errors = {n: rel_rmse(out[n], ref[n]) for n in ref}
    finite = all(bool(torch.isfinite(t).all()) for t in out.values())
    worst = max(errors.values())
    return dict(finite=finite, max_rel=worst, ok=finite and worst <= TOLERANCE[case.dtype], errors=errors)


def time_case(family: str, case: Case, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds per Triton forward+backward of ``case`` after ``warmup`` calls."""
    inputs = case_inputs(family, case, device)
    do = torch.randn(inputs["v"].shape, generator=torch.Generator().manual_seed(1)).to(device)
    return median_ms(lambda: forward_backward(family, inputs, do, case.dtype, "triton"), device, repeats, warmup)


def worker(family: str, small: bool, device: torch.device) -> dict:
    """Run every case under the launch config already in the environment (the subprocess side)."""
    cases = SMALL_CASES if small else CASES
    try:
        results = {case.name: check_case(family, case, device) for case in cases}
        ms = time_case(family, cases[-1], device, *((0, 1) if small else (2, 5)))
    except Exception as exc:  # a compiler or launch failure is a result here, not an error of the tool
        return dict(status="crash", error=f"{type(exc).__name__}: {exc}"[:2000])
    if not all(r["finite"] for r in results.values()):
        status = "nan"
    else:
        status = "ok" if all(r["ok"] for r in results.values()) else "inaccurate"
    return dict(status=status, cases=results, ms_largest=ms, largest_case=cases[-1].name)


def launch_env(family: str, config: dict, device: torch.device) -> dict[str, str]:
    """The subprocess environment: ``config`` merged into LINATTN_TRITON_LAUNCH; the interpreter on the CPU."""
    env = dict(os.environ)
    launch = json.loads(env.get("LINATTN_TRITON_LAUNCH") or "{}")
    launch[family] = {**launch.get(family, {}), **config}
    env["LINATTN_TRITON_LAUNCH"] = json.dumps(launch)
    if device.type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


def run_config(family: str, config: dict, small: bool, device: torch.device, timeout_s: float) -> dict:
    """Check one launch config in a fresh Python process; a dead process or a timeout is reported, not raised."""
    cmd = [sys.executable, "-m", "linattn.bench.launch_check", "--worker", "--family", family, "--device", str(device)]
    cmd += ["--small"] if small else []
    try:
        proc = subprocess.run(cmd, env=launch_env(family, config, device), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(config=config, status="timeout", error=f"no result within {timeout_s:g} s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        return dict(config=config, status="crash", error=f"exit code {proc.returncode}: {tail}")
    return dict(config=config, **json.loads(lines[-1][len(RESULT_TAG):]))


def summary_line(result: dict) -> str:
    """One line: config, status, time of the largest case, worst error per case (or the error message)."""
    head = f"{json.dumps(result['config'])}  status={result['status']}"
    if "cases" not in result:
        return f"{head}  error={result.get('error', '').splitlines()[-1] if result.get('error') else ''}"
    cases = " | ".join(f"{name}: {'finite' if r['finite'] else 'NaN'} max_rel={r['max_rel']:.2e}"
                       for name, r in result["cases"].items())
    return f"{head}  {result['largest_case']}_ms={result['ms_largest']:.2f}  {cases}"


def parse_configs(text: str) -> list[dict]:
    """--configs: a JSON list of objects (launch keys to override; {} = the defaults)."""
    try:
        configs = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--configs must be a JSON list of objects, got {text!r}") from exc
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise ValueError(f"--configs must be a JSON list of objects, got {text!r}")
    return configs


def check_launch_configs(family: str, configs: list[dict], *, small: bool = False, device: str | None = None,
                         timeout_s: float = 600.0) -> list[dict]:
    """Check each launch config of ``family`` in its own process; print and return one result per config."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}; got {family!r}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() and not small else "cpu"))
    results = []
    for config in configs:
        results.append(run_config(family, config, small, dev, timeout_s))
        print(summary_line(results[-1]), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="gated_delta_rule")
    parser.add_argument("--configs", default="[{}]", help='JSON list of launch overrides: \'[{}, {"wy_warps": 4}]\'')
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--device", default=None, help="cuda (default when available and not --small) or cpu")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per config")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(args.family, args.small, torch.device(args.device))
        print(RESULT_TAG + json.dumps(result), flush=True)
        sys.exit(0 if result["status"] != "crash" else 1)
    try:
        configs = parse_configs(args.configs)
    except ValueError as exc:
        parser.error(str(exc))
    results = check_launch_configs(args.family, configs, small=args.small, device=args.device, timeout_s=args.timeout)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(family=args.family, small=args.small, results=results), f, indent=1)


if __name__ == "__main__":
    main()
