"""The benchmark harness and the CLI run end to end at tiny sizes (function, not timing)."""

import json

import pytest
import torch

from linattn.bench.memprobe import probe
from linattn.bench.ops import format_table, run_ops_bench
from linattn.cli import main


def test_ops_bench_rows_and_table():
    rows = run_ops_bench(["simple_gla"], [16, 33], ["recurrent", "parallel", "sdpa", "fla"], B=1, H=2, K=8, V=4,
                         dtype=torch.float32, device=torch.device("cpu"), repeats=1, memory=False, progress=False)
    impls = {(r.T, r.impl) for r in rows}
    assert {(16, "recurrent"), (16, "parallel"), (16, "sdpa"), (33, "parallel")} <= impls
    assert all(r.fwd_ms > 0 and r.fwdbwd_ms > 0 and r.fwdbwd_b2b_ms > 0 for r in rows)
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "x recurrent" in table
    assert all(line.count("|") == 12 for line in table.splitlines())  # 11 columns: back to back beside fwd+bwd


def test_recurrent_skipped_above_limit():
    rows = run_ops_bench(["simple_gla"], [40], ["recurrent", "parallel"], B=1, H=1, K=4, V=4, dtype=torch.float32,
                         device=torch.device("cpu"), repeats=1, max_recurrent_T=32, memory=False, progress=False)
    assert [r.impl for r in rows] == ["parallel"]


def test_memprobe_grows_with_length():
    small = probe("simple_gla", "parallel", 1, 64, 1, 8, 8)
    large = probe("simple_gla", "parallel", 1, 2048, 4, 8, 8)  # T x T matrices: ~200 MiB
    assert large > small and large > 50


def test_cli_list_and_bench(tmp_path, capsys):
    assert main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert "simple_gla" in [r["name"] for r in listed]
    out = tmp_path / "bench.json"
    assert main(["bench", "ops", "--ops", "simple_gla", "--lengths", "16", "--impls", "parallel",
                 "--K", "8", "--V", "8", "--repeats", "1", "--no-memory", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["impl"] == "parallel"


def test_cli_bench_accuracy(tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert main(["bench", "accuracy", "--op", "simple_gla", "--impls", "parallel", "--device", "cpu", "--B", "1",
                 "--T", "16", "--H", "1", "--K", "8", "--V", "8", "--out", str(out)]) == 0
    assert "| parallel |" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][0]["impl"] == "parallel"
    with pytest.raises(SystemExit):
        main(["bench", "accuracy", "--op", "simple_gla", "--launch", "{not json"])
    assert "argument --launch: expected a JSON object, got '{not json'" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["{not json", "[1]"])
def test_cli_bench_ops_names_a_bad_launch(text, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "ops", "--ops", "simple_gla", "--launch", text])
    assert f"argument --launch: expected a JSON object, got {text!r}" in capsys.readouterr().err


def test_ops_bench_launch_rows_run_under_their_setting(monkeypatch):
    """Each launch setting adds a triton row per op and length, named after it, measured while the setting is in
    force (and only then); the other rows run under the settings in force."""
    from linattn import switches
    from linattn.bench import ops as bench_ops

    seen = []

    def fake_bench_op(op, T, impl, **kw):
        seen.append((impl, dict(switches.current().triton_launch)))
        return bench_ops.BenchRow(op, T, impl, 1.0, 2.0, None)

    monkeypatch.setattr(bench_ops, "bench_op", fake_bench_op)
    monkeypatch.setattr(bench_ops.get_op("simple_gla"), "example_inputs", lambda *a, **k: {})
    setting = {"simple_gla": {"grads_BV": 16}}
    rows = run_ops_bench(["simple_gla"], [16, 32], ["chunk"], launches=[setting], B=1, H=1, K=8, V=8,
                         dtype=torch.float32, device=torch.device("cpu"), memory=False, progress=False)
    label = 'triton {"simple_gla":{"grads_BV":16}}'
    assert [(r.T, r.impl) for r in rows] == [(16, "chunk"), (32, "chunk"), (16, label), (32, label)]
    assert seen == [("chunk", {}), ("chunk", {}), ("triton", setting), ("triton", setting)]
    assert switches.current().triton_launch == {}  # restored
    assert f"| {label} |" in format_table(rows)


def test_auto_backend_choice():
    from linattn.ops import get_op

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    spec = get_op("softmax_attn")
    assert spec.resolve("auto", cpu) is spec.implementations["chunk"]
    assert spec.resolve("auto", cuda) is spec.implementations["parallel"]
    gdn = get_op("gated_delta_rule")
    assert gdn.resolve("auto", cpu) is gdn.implementations["chunk"]
    if "triton" in gdn.implementations:
        assert gdn.resolve("auto", cuda) is gdn.implementations["triton"]
        assert gdn.resolve("auto", cuda, 64) is gdn.implementations["triton"]
        for name in ("delta_rule", "gated_delta_rule", "comba", "gated_delta_product"):  # no 128 in their kernels
            spec = get_op(name)
            assert spec.resolve("auto", cuda, 128) is spec.implementations["chunk"], name
        gla = get_op("gla")
        assert gla.resolve("auto", cuda, 128) is gla.implementations["triton"]


def test_back_to_back_is_per_call():
    """back_to_back_ms divides one loop's time by its calls: a call that sleeps 5 ms reads about 5 ms (a loaded
    host may oversleep), not the loop's 50."""
    import time

    from linattn.bench.timing import back_to_back_ms

    calls = []
    ms = back_to_back_ms(lambda: (calls.append(1), time.sleep(0.005)), torch.device("cpu"), calls=10)
    assert len(calls) == 11  # one untimed call, then ten
    assert 4.5 < ms < 40
