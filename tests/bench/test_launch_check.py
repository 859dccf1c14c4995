"""python -m linattn.bench.launch_check runs end to end at --small shapes: one launch config checked in its own
process against the recurrence (every output and gradient within tolerance), and a config the kernels reject is
reported as a crash of that config, not of the tool."""

import json

import pytest
import torch

from linattn.bench.launch_check import main, parse_configs
from linattn.ops.common.triton_compat import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_launch_check_small(tmp_path, capsys):
    out = tmp_path / "launch.json"
    main(["--family", "gated_delta_rule", "--small", "--device", DEVICE, "--configs", '[{}, {"no_such_key": 1}]',
          "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    default, bad = results
    assert default["config"] == {} and default["status"] == "ok", default
    assert set(default["cases"]) == {"lra_bf16", "strong_fp32", "big_bf16"}
    for case in default["cases"].values():
        assert case["finite"] and set(case["errors"]) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert default["cases"]["strong_fp32"]["max_rel"] < 1e-4
    assert default["ms_largest"] > 0
    assert bad["status"] == "crash" and "no_such_key" in bad["error"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "status=ok" in lines[0] and "status=crash" in lines[1]


def test_configs_must_be_a_list_of_objects():
    assert parse_configs('[{}, {"wy_warps": 2}]') == [{}, {"wy_warps": 2}]
    for bad in ('{"wy_warps": 2}', "[1]", "not json"):
        with pytest.raises(ValueError, match="--configs"):
            parse_configs(bad)
