"""The concurrency probe of the LRA study: copies of one run trained at once, timed from their logs."""

from __future__ import annotations

import json

import pytest

from linattn.experiments import lra_concurrency as lc


def test_probe_times_copies_of_a_run(tmp_path, capsys):
    lc.main(["--preset", "smoke", "--mixers", "gla", "--concurrency", "1,2", "--steps", "6", "--device", "cpu",
             "--out", str(tmp_path)])
    saved = json.loads((tmp_path / lc.RESULT_FILE).read_text())
    rows = saved["rows"]
    assert [(r["mixer"], r["concurrency"]) for r in rows] == [("gla", 1), ("gla", 2)]
    for r in rows:
        assert r["error"] is None and r["seconds_per_step"] > 0
        assert r["slowest_seconds_per_step"] >= r["seconds_per_step"]
        assert r["total_steps_per_s"] == pytest.approx(r["concurrency"] / r["seconds_per_step"])
    # two copies ran as two seeds of the run, each trained the given steps with its one evaluation at the end
    runs = sorted((tmp_path / "gla-none-x2").glob("lra/*/runs/*"))
    assert len(runs) == 2 and {p.name.split("_s")[-1][0] for p in runs} == {"0", "1"}
    faster = max(rows, key=lambda r: r["total_steps_per_s"])["concurrency"]
    assert saved["best"] == {"gla/none": faster}
    assert "| gla | none | 2 |" in capsys.readouterr().out


def test_best_concurrency_leaves_out_failed_rows():
    rows = [lc.ConcurrencyRow("m", "none", 1, 0.1, 0.1, 10.0), lc.ConcurrencyRow("m", "none", 4, 0.3, 0.35, 13.3),
            lc.ConcurrencyRow("m", "none", 6, error="failed: out of memory")]
    assert lc.best_concurrency(rows) == {"m/none": 4}


@pytest.mark.parametrize("argv, match", [(["--concurrency", "0,2"], "--concurrency"),
                                         (["--concurrency", "two"], "--concurrency"),
                                         (["--concurrency", ","], "--concurrency"), (["--steps", "2"], "--steps")])
def test_bad_options_are_named(tmp_path, argv, match):
    with pytest.raises(ValueError, match=match):
        lc.main(["--preset", "smoke", "--device", "cpu", "--out", str(tmp_path), *argv])
