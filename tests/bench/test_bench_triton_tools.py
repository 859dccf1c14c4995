"""The kernel tools of linattn.bench: per-kernel profile, launch tuning, and the sm_90 resource report."""

import json
import os
import subprocess
import sys

import pytest
import torch

from linattn.bench import profile_op, triton_tune
from linattn.ops.common.triton_compat import triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton through its interpreter
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def test_profile_op_tables_forward_and_backward_on_cpu():
    text = profile_op.profile_op("simple_gla", "chunk", 1, 64, 1, 8, 8, "cpu", torch.float32, rows=3)
    assert "simple_gla [chunk] forward:" in text and "simple_gla [chunk] backward:" in text
    assert text.count(" ms ") >= 2


def test_profile_op_reports_missing_fla_without_failing():
    text = profile_op.profile_op("mesa_net", "fla", 1, 16, 1, 8, 8, "cpu", torch.float32)
    assert "FLA" in text


def test_profile_op_uses_the_ops_benchmark_settings(monkeypatch):
    # the tables must explain `linattn bench ops` rows: ttt_linear with its inner norm, mesa_net's 30 CG steps
    spec = profile_op.get_op("ttt_linear")
    seen = {}

    def recording(**kwargs):
        seen.update(kwargs)
        return spec.fn(**kwargs)

    monkeypatch.setattr(profile_op, "get_op", lambda op: type("Spec", (), {"fn": staticmethod(recording),
                                                                            "example_inputs": spec.example_inputs}))
    text = profile_op.profile_op("ttt_linear", "chunk", 1, 32, 1, 8, 8, "cpu", torch.float32, rows=2)
    assert "ttt_linear [chunk] backward:" in text
    assert seen["inner_norm"] is True and seen["backend"] == "chunk"


def test_default_grids_start_from_the_current_setting_and_use_known_keys():
    for family in triton_tune.KERNEL_GROUPS:
        module = triton_tune.launch_module(family) if triton_available() else None
        grid = triton_tune.default_grid(family)
        for group, candidates in grid.items():
            assert candidates[0] == {} and len(candidates) > 1
            if module is not None:
                assert all(set(c) <= set(module.LAUNCH) for c in candidates), (family, group)


@needs_triton
def test_ttt_linear_groups_name_its_kernels_and_launch_keys():
    module = triton_tune.launch_module("ttt_linear")
    for kernel, group in triton_tune.KERNEL_GROUPS["ttt_linear"].items():
        assert hasattr(module, kernel), kernel
        assert {f"{group}_warps", f"{group}_stages"} <= set(module.LAUNCH)


@needs_triton
@pytest.mark.parametrize("family", ["forgetting_attn", "deltaformer", "path_attn_ut"])
def test_softmax_side_groups_name_their_kernels_and_launch_keys(family):
    module = triton_tune.launch_module(family)
    for kernel, group in triton_tune.KERNEL_GROUPS[family].items():
        assert hasattr(module, kernel), kernel
        assert {f"{group}_warps", f"{group}_stages"} <= set(module.LAUNCH), (kernel, group)


@pytest.mark.triton
@needs_triton
def test_tune_runs_every_setting_and_checks_it_against_the_first():
    result = triton_tune.tune("gated_delta_rule", {"scan": [{}, {"scan_warps": 2}], "out": [{}, {"out_BV": 16}]},
                              B=1, T=20, H=1, K=16, V=16, repeats=1, device=DEVICE, op="delta_rule",
                              on_row=lambda row: None)
    assert [r["setting"] for r in result["runs"]] == [{"scan": {}, "out": {}},
                                                      {"scan": {"scan_warps": 2}, "out": {"out_BV": 16}}]
    assert all(r["ok"] and r["err_vs_run0"] < 1e-6 for r in result["runs"])
    # bf16 inputs: the outputs are rounded to bf16, so the float32 call differs, and the limit is at least 1e-2
    assert 0 < result["float32_distance"] < 0.05 and result["limit"] == max(1e-2, 2 * result["float32_distance"])
    module = __import__("linattn.ops.gated_delta_rule.triton", fromlist=["LAUNCH"])
    assert module.LAUNCH == result["default"]  # restored


@needs_triton
def test_resource_report_compiles_the_kernels_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real kernels, launches intercepted
    out = subprocess.run([sys.executable, "-m", "linattn.bench.triton_resources", "simple_gla", "--T", "32", "--H",
                          "1", "--K", "16", "--V", "16", "--dtype", "float32"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [r[1] for r in rows] == ["_state_fwd_kernel", "chunk_output_kernel", "_state_bwd_kernel",
                                    "_grads_bwd_kernel"]
    assert all(int(r[4]) > 0 for r in rows)  # registers read back from the cubin
    # float32 inputs multiply in full precision ("ieee"), off the tensor cores: no HGMMA and nothing to wait for
    assert all(int(r[7]) == 0 and int(r[8]) == 0 for r in rows)


@needs_triton
def test_forgetting_attn_forward_issues_its_tensor_core_products_back_to_back():
    """In SASS for sm_90, the forward's HGMMAs are not each followed by a wait: cleaning the value tile in registers
    inside the kernel had made Triton 3.6 issue all of them one at a time (as many waits as products)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "linattn.bench.triton_resources", "forgetting_attn", "--T", "256",
                          "--H", "2", "--K", "128", "--V", "128", "--dtype", "bfloat16"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r[1]: r for r in (line.split() for line in out.stdout.splitlines()[1:])}
    mma, waits = int(rows["fox_fwd_kernel"][7]), int(rows["fox_fwd_kernel"][8])
    assert mma > 0 and 4 * waits < mma, (mma, waits)


def test_tune_records_a_setting_that_fails_and_goes_on(monkeypatch):
    """A setting that raises (as Triton does for tiles beyond the GPU's shared memory) becomes a row with its error,
    never chosen; the runs after it still run. Run 0 raising is an error: there is nothing to compare with."""
    calls = []

    def fake_run(op, inputs, repeats):
        module = triton_tune.launch_module("gated_delta_rule")
        calls.append(module.LAUNCH["scan_warps"])
        if module.LAUNCH["scan_warps"] == 8:
            raise RuntimeError("out of resources: shared memory")
        return [torch.ones(3)], {"_state_fwd_kernel": float(module.LAUNCH["scan_warps"])}

    monkeypatch.setattr(triton_tune, "_run", fake_run)
    monkeypatch.setattr(triton_tune, "_inputs", lambda *a: {})
    monkeypatch.setattr(triton_tune, "_float32_distance", lambda *a: 0.0)
    rows = []
    grid = {"scan": [{}, {"scan_warps": 8}, {"scan_warps": 2}]}
    result = triton_tune.tune("gated_delta_rule", grid, device="cpu", on_row=rows.append)
    assert calls == [triton_tune.launch_module("gated_delta_rule").LAUNCH["scan_warps"], 8, 2]
    assert [r["ok"] for r in rows] == [True, False, True] and "out of resources" in rows[1]["error"]
    assert result["runs"] == rows
    assert result["best"]["scan"]["setting"] == {"scan_warps": 2}  # the fastest of the runs that ran
    with pytest.raises(RuntimeError, match="out of resources"):
        triton_tune.tune("gated_delta_rule", {"scan": [{"scan_warps": 8}]}, device="cpu", on_row=rows.append)


def test_tune_cli_saves_each_run_as_it_comes(monkeypatch, tmp_path):
    """--out holds the runs measured so far ("partial") while the sweep goes on, the whole result at its end."""
    out = tmp_path / "tune.json"
    seen = []

    def fake_run(op, inputs, repeats):
        if out.exists():
            seen.append(json.loads(out.read_text()))
        return [torch.ones(3)], {"_state_fwd_kernel": 1.0}

    monkeypatch.setattr(triton_tune, "_run", fake_run)
    monkeypatch.setattr(triton_tune, "_inputs", lambda *a: {})
    monkeypatch.setattr(triton_tune, "_float32_distance", lambda *a: 0.0)
    grid = json.dumps({"scan": [{}, {"scan_warps": 2}, {"scan_warps": 8}]})
    triton_tune.main(["--family", "gated_delta_rule", "--grid", grid, "--out", str(out)])
    assert [len(s["runs"]) for s in seen] == [1, 2] and all(s["partial"] for s in seen)
    final = json.loads(out.read_text())
    assert "partial" not in final and len(final["runs"]) == 3
