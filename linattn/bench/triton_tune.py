"""Time alternative launch settings of a family's Triton kernels, kernel by kernel (run on a GPU):

    python -m linattn.bench.triton_tune --family gated_delta_rule [--T 16384] [--grid '{"scan": [{}, ...]}']
        [--out tune.json]

A family's kernels each read their own ``LAUNCH`` keys (``linattn/ops/<family>/triton.py``; ttt_linear's in
``linattn/ops/ttt/triton_linear.py``, mesa_net's in ``linattn/ops/mesa_net/triton_cg.py``, path_attn's UT
transform's, family path_attn_ut, in ``linattn/ops/path_attn/ut_triton.py``), so the settings of
different kernels do not interact. Run i sets every kernel group to its i-th candidate (groups with fewer
candidates repeat their last), runs forward+backward of the family's op at the benchmark shape under
torch.profiler, and records each kernel's device time (median of the repeats); the best candidate of each group
is then the one whose kernels took least. Every run's outputs and gradients are compared with run 0's (the current
``LAUNCH``): a candidate that changes the numbers beyond rounding is reported as wrong and never chosen. Beyond
rounding means not finite, or a relative error above the limit: 1e-2, or twice run 0's own distance from the same
call on float32 inputs where that is larger (two results each that close to the exact one are within twice it of
each other). A setting that fails to run (Triton refusing a launch whose tiles exceed the GPU's shared memory)
is recorded with its error and never chosen. Results print as they come, and ``--out`` is rewritten after each
run (marked "partial" until the sweep ends), so a sweep cut short by a time limit keeps what it measured.
A launch that miscompiles into an illegal memory access kills the process: check risky settings with
``linattn.bench.launch_check`` (a process per setting) first.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from linattn.bench.ops import OP_KWARGS
from linattn.bench.shape_args import add_shape_arguments
from linattn.ops import get_op

# which LAUNCH group (prefix) each kernel of a family reads
KERNEL_GROUPS = {
    "gated_delta_rule": {"_prepare_kernel": "prep", "_state_fwd_kernel": "scan", "chunk_output_kernel": "out",
                         "_dv_local_kernel": "dv", "_state_bwd_kernel": "bscan", "_grads_qk_kernel": "grads",
                         "_grads_wy_kernel": "wy"},
    "gla": {"_state_fwd_kernel": "scan", "_scores_kernel": "scores", "_output_kernel": "out",
            "_state_bwd_kernel": "bscan", "_inter_bwd_kernel": "inter", "_intra_bwd_kernel": "intra"},
    "simple_gla": {"_state_fwd_kernel": "scan", "chunk_output_kernel": "out", "_state_bwd_kernel": "bscan",
                   "_grads_bwd_kernel": "grads"},
    "mesa_net": {"_states_kernel": "scan", "_chunk_cg_kernel": "cg", "_readout_kernel": "out",
                 "_dstates_kernel": "bscan", "_read_grads_kernel": "grads", "_solve_grads_kernel": "kk"},
    "ttt_linear": {f"_ttt_{g}_kernel": g for g in ("fwd_scan", "fwd_out", "bwd_pre", "bwd_scan", "bwd_post")},
    "forgetting_attn": {"fox_fwd_kernel": "fwd", "fox_delta_kernel": "delta", "fox_dkv_kernel": "dkv",
                        "fox_dq_kernel": "dq"},
    # its attention passes run forgetting_attn's kernels, whose settings live in forgetting_attn's LAUNCH: tune them
    # there; here the solve, its adjoint and the panel updates (both update kernels read the "update" keys)
    "deltaformer": {"deltaformer_solve_kernel": "solve", "deltaformer_psi_kernel": "psi",
                    "deltaformer_update_kernel": "update", "deltaformer_psi_update_kernel": "update"},
    # path_attn's UT transform (its flash pass has settings of its own in path_attn's LAUNCH)
    "path_attn_ut": {"ut_fwd_kernel": "fwd", "ut_bwd_kernel": "bwd"},
}
# the module holding a family's LAUNCH, where it is not linattn/ops/<family>/triton.py
LAUNCH_MODULES = {"ttt_linear": "linattn.ops.ttt.triton_linear",
                  "mesa_net": "linattn.ops.mesa_net.triton_cg",
                  "path_attn_ut": "linattn.ops.path_attn.ut_triton"}
# the op run on a family's kernels, where it is not the family's name
FAMILY_OPS = {"path_attn_ut": "path_attn"}


def launch_module(family: str):
    """The module whose ``LAUNCH`` dict the family's kernels read."""
    return importlib.import_module(LAUNCH_MODULES.get(family, f"linattn.ops.{family}.triton"))


def _candidates(group: str, warps=(2, 4, 8), stages=(2, 3), blocks: tuple[str, tuple[int, ...]] | None = None
                ) -> list[dict]:
    """{} first (the current setting), then every combination of warps, stages and one block key."""
    out: list[dict] = [{}]
    for b in (blocks[1] if blocks else (None,)):
        for w in warps:
            for s in stages:
                c = {f"{group}_warps": w, f"{group}_stages": s}
                if b is not None:
                    c[blocks[0]] = b
                out.append(c)
    return out


def default_grid(family: str) -> dict[str, list[dict]]:
    """Candidate settings per kernel group (the wy group of the delta family is left to launch_check: some of its
    settings miscompile on Hopper)."""
    groups = sorted(set(KERNEL_GROUPS[family].values()) - {"wy"})
    if family == "mesa_net":
        return _mesa_grid()
    if family == "ttt_linear":
        return _ttt_grid()
    if family == "forgetting_attn":
        return _fox_grid()
    if family == "deltaformer":
        return _deltaformer_grid()
    if family == "path_attn_ut":
        return _path_ut_grid()
    blocks = {"gated_delta_rule": {"scan": ("scan_BV", (32, 64)), "bscan": ("bscan_BV", (32, 64)),
                                   "out": ("out_BV", (64, 128)), "dv": ("dv_BV", (64, 128)),
                                   "grads": ("grads_BV", (32, 64))},
              "gla": {"scan": ("scan_BK", (32, 64)), "inter": ("inter_BV", (32, 64)), "intra": ("intra_BK", (32, 64))},
              "simple_gla": {"grads": ("grads_BV", (32, 64))}}[family]
    grid = {g: _candidates(g, warps=(2, 4, 8) if g in ("scan", "bscan") else (4, 8), blocks=blocks.get(g))
            for g in groups}
    if family == "gla":  # bf16/fp16 operands in the intra-chunk gradient products (FLA's way): what do they save?
        grid["intra"] += [{"intra_dots": "input"}, {"intra_dots": "input", "intra_warps": 8}]
    return grid


def _mesa_grid() -> dict[str, list[dict]]:
    """mesa_net's candidates (each fits an H100's shared memory at K = V = 128, bf16: checked by compiling for sm_90
    with bench/triton_resources.py). The CG kernel has no stages (no loads in its loop); "chunk" changes every
    kernel at once and is left to whole-op runs (``LINATTN_TRITON_LAUNCH='{"mesa_net": {"chunk": 32}}'``)."""
    cg = [{}, {"cg_warps": 8}, {"cg_rows": 16}, {"cg_rows": 16, "cg_warps": 8}, {"cg_rows": 64, "cg_warps": 8},
          {"cg_rows": 64}, {"cg_dots": "tf32"}, {"cg_dots": "tf32", "cg_rows": 64}]
    return {"cg": cg,
            "scan": _candidates("scan", warps=(2, 4, 8), blocks=("scan_BV", (32, 64))),
            "out": _candidates("out", warps=(4, 8), blocks=("out_BV", (64, 128))),
            "bscan": _candidates("bscan", warps=(2, 4, 8), blocks=("bscan_BV", (32, 64))),
            "grads": _candidates("grads", warps=(4, 8), stages=(1, 2), blocks=("grads_BV", (32, 64))),
            "kk": [{}, {"kk_BV": 16}, {"kk_BV": 16, "kk_stages": 2}, {"kk_warps": 4}, {"kk_BV": 16, "kk_warps": 4}]}


def _ttt_grid() -> dict[str, list[dict]]:
    """ttt_linear's candidates: the scans (a program per batch-head, latency-bound) with a prefetching second stage;
    the chunk kernels at 4 warps (they spill a few hundred bytes at 8 and would spill more at 4: to be timed). Their
    second stages are left out: the backward's post kernel needs 160 KB of shared memory with one."""
    scans = {g: _candidates(g, warps=(4, 8), stages=(1, 2)) for g in ("fwd_scan", "bwd_scan")}
    chunks = {g: [{}, {f"{g}_warps": 4}] for g in ("fwd_out", "bwd_pre", "bwd_post")}
    return {**scans, **chunks}


def _fox_grid() -> dict[str, list[dict]]:
    """forgetting_attn's candidates: each kernel's warps and stages with one block size of its own (the query rows
    per dK/dV step, the keys per forward and dQ step); delta, a row sum, only its warps. Steps of 128 keys only at 8
    warps and 2 stages: compiled for sm_90 (Triton 3.6, K = V = 128, bf16) the forward needs 162 KB of shared memory
    there (952 bytes of spills) and dQ 194 KB (none); with 3 stages both exceed an H100's 227 KB, and at 4 warps
    both spill over 2 KB."""
    wide = {"fwd": [{"fwd_BN": 128, "fwd_warps": 8, "fwd_stages": 2}],
            "dq": [{"dq_BN": 128, "dq_warps": 8, "dq_stages": 2}]}
    return {"fwd": _candidates("fwd", warps=(4, 8), blocks=("fwd_BN", (32, 64))) + wide["fwd"],
            "dkv": _candidates("dkv", warps=(4, 8), stages=(2, 3), blocks=("dkv_BM", (32, 64))),
            "dq": _candidates("dq", warps=(4, 8), blocks=("dq_BN", (32, 64))) + wide["dq"],
            "delta": [{}, {"delta_warps": 8}]}


def _deltaformer_grid() -> dict[str, list[dict]]:
    """deltaformer's candidates: the sequential solve and adjoint (no block key: their value blocks, BV, are shared)
    with one to three stages, and the panel updates with value blocks of their own (update_BV)."""
    return {"solve": _candidates("solve", warps=(4, 8), stages=(1, 2, 3)),
            "psi": _candidates("psi", warps=(4, 8), stages=(1, 2, 3)),
            "update": _candidates("update", warps=(4, 8), stages=(2, 3), blocks=("update_BV", (64, 128)))}


def _path_ut_grid() -> dict[str, list[dict]]:
    """path_attn's UT transform: each kernel's warps and stages (stages pipeline its sweeps over K's columns).
    The column block BJ is shared by both kernels and left to whole-op runs
    (``LINATTN_TRITON_LAUNCH='{"path_attn_ut": {"BJ": 32}}'``)."""
    return {g: _candidates(g, warps=(4, 8), stages=(1, 2)) for g in ("fwd", "bwd")}


def _inputs(op: str, B: int, T: int, H: int, K: int, V: int, device: str) -> dict:
    spec = get_op(op)
    inputs = spec.example_inputs(B, T, H, K, V, dtype=torch.bfloat16, device=device)
    return {n: (x.requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in inputs.items()}


def _run(op: str, inputs: dict, repeats: int) -> tuple[list[torch.Tensor], dict[str, float]]:
    """(output and gradients, median device ms per kernel name) of ``repeats`` forward+backward passes."""
    spec = get_op(op)
    leaves = [x for x in inputs.values() if isinstance(x, torch.Tensor) and x.requires_grad]

    def step():
        for x in leaves:
            x.grad = None
        o, _ = spec.fn(**inputs, **OP_KWARGS.get(op, {}), backend="triton")
        o.backward(torch.ones_like(o))
        return o

    o = step()  # compiles this setting's kernels
    results = [o.detach().float()] + [x.grad.float() for x in leaves]
    per_kernel: dict[str, list[float]] = defaultdict(list)
    on_cuda = leaves[0].is_cuda
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
            step()
            if on_cuda:
                torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:  # none on the CPU: only the errors are checked
                totals[ev.name] += ev.device_time / 1e3
        for name, ms in totals.items():
            per_kernel[name].append(ms)
    return results, {n: statistics.median(v) for n, v in per_kernel.items()}


def tune(family: str, grid: dict[str, list[dict]], *, B: int = 4, T: int = 16384, H: int = 16, K: int = 128,
         V: int = 128, repeats: int = 3, device: str = "cuda", op: str | None = None,
         on_row: Callable[[dict], object] = print) -> dict:
    """{"runs": [...], "best": {group: setting}}: see the module docstring. ``op``: the op run on the family's
    kernels (default: the family's own; e.g. delta_rule on gated_delta_rule's kernels, compiled without the gate).
    ``on_row(row)`` is called with each run's row as it is measured (a run that raised: its "error", not ok)."""
    op = op or FAMILY_OPS.get(family, family)
    module = launch_module(family)
    default = dict(module.LAUNCH)
    inputs = _inputs(op, B, T, H, K, V, device)
    kernel_group = KERNEL_GROUPS[family]
    n_runs = max(len(c) for c in grid.values())
    runs, reference = [], None
    try:
        for i in range(n_runs):
            setting = {g: c[min(i, len(c) - 1)] for g, c in grid.items()}
            module.LAUNCH.clear()
            module.LAUNCH.update(default)
            for c in setting.values():
                module.LAUNCH.update(c)
            try:
                results, times = _run(op, inputs, repeats)
            except Exception as err:  # e.g. a setting whose tiles exceed the GPU's shared memory (Triton refuses
                if reference is None:  # to launch it): recorded, and the sweep goes on; run 0 must run
                    raise
                row = {"run": i, "setting": setting, "kernels_ms": {}, "total_ms": None,
                       "error": f"{type(err).__name__}: {str(err)[:200]}", "ok": False}
                runs.append(row)
                on_row(row)
                continue
            if reference is None:
                reference = results
                rounding = _float32_distance(op, inputs, results)
                limit = max(1e-2, 2 * rounding)
            err = max(_relative_error(a, b) for a, b in zip(results, reference))
            finite = all(bool(torch.isfinite(a).all()) for a in results)
            kernels = {n: round(ms, 4) for n, ms in times.items() if n in kernel_group}
            row = {"run": i, "setting": setting, "kernels_ms": kernels, "total_ms": round(sum(times.values()), 4),
                   "err_vs_run0": err, "ok": finite and err <= limit}
            runs.append(row)
            on_row(row)
    finally:
        module.LAUNCH.clear()
        module.LAUNCH.update(default)
    best = {}
    for group in grid:
        names = [n for n, g in kernel_group.items() if g == group]
        scored = [(sum(r["kernels_ms"].get(n, 0.0) for n in names), r["setting"][group]) for r in runs
                  if r["ok"] and any(n in r["kernels_ms"] for n in names)]
        if scored:
            ms, choice = min(scored, key=lambda x: x[0])
            first = scored[0][0]
            best[group] = {"setting": choice, "ms": round(ms, 4), "run0_ms": round(first, 4)}
    return {"family": family, "op": op, "shape": dict(B=B, T=T, H=H, K=K, V=V), "default": default,
            "float32_distance": rounding, "limit": limit, "runs": runs, "best": best}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _float32_distance(op: str, inputs: dict, results: list[torch.Tensor]) -> float:
    """The largest relative error of ``results`` (the call's outputs and gradients on ``inputs``) against the same
    call on the inputs in float32, current launch settings."""
    wide = {n: (x.detach().float().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
                and x.is_floating_point() else x) for n, x in inputs.items()}
    exact, _ = _run(op, wide, repeats=0)
    return max(_relative_error(a, b) for a, b in zip(results, exact))


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(KERNEL_GROUPS), default="gated_delta_rule")
    p.add_argument("--op", default=None, help="op to run on the family's kernels (default: the family's op)")
    add_shape_arguments(p, B=4, T=16384, H=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--grid", default=None, help="JSON {group: [setting, ...]} (default: default_grid(family))")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    grid = json.loads(a.grid) if a.grid else default_grid(a.family)
    done: list[dict] = []

    def on_row(row: dict) -> None:  # printed and saved as they come: a sweep cut short keeps its runs
        done.append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            _write(a.out, {"family": a.family, "partial": True, "runs": done})

    result = tune(a.family, grid, B=a.B, T=a.T, H=a.H, K=a.K, V=a.V, repeats=a.repeats, op=a.op, on_row=on_row)
    if a.out:
        _write(a.out, result)
    print(f"{a.family}: run 0 is {result['float32_distance']:.2e} from float32 inputs; candidates may differ from it "
          f"by {result['limit']:.2e}")
    for group, b in result["best"].items():
        print(f"{a.family} {group}: best {b['setting']} {b['ms']} ms (current {b['run0_ms']} ms)")


if __name__ == "__main__":
    main()
