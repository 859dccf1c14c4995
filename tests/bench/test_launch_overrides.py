"""LINATTN_TRITON_LAUNCH: JSON launch overrides per Triton kernel family, checked against the family's keys."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from linattn.ops.common.triton_utils import launch_overrides  # noqa: E402

ENV = "LINATTN_TRITON_LAUNCH"


def _launch() -> dict:
    return {"BT": 64, "num_warps": 4, "num_stages": 2}


def test_no_variable_leaves_the_launch_unchanged(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    launch = _launch()
    assert launch_overrides("gla", launch) is launch and launch == _launch()
    monkeypatch.setenv(ENV, "")
    assert launch_overrides("gla", _launch()) == _launch()


def test_own_family_is_updated_in_place_and_others_are_ignored(monkeypatch):
    monkeypatch.setenv(ENV, json.dumps({"gla": {"num_warps": 2, "BT": 32}, "simple_gla": {"num_warps": 8}}))
    launch = _launch()
    out = launch_overrides("gla", launch)
    assert out is launch and launch == {"BT": 32, "num_warps": 2, "num_stages": 2}
    other = _launch()
    assert launch_overrides("simple_gla", other) == {"BT": 64, "num_warps": 8, "num_stages": 2}
    absent = _launch()
    assert launch_overrides("gated_delta_rule", absent) == _launch(), "a family not named keeps its launch"


def test_unknown_key_names_the_family_and_the_valid_keys(monkeypatch):
    monkeypatch.setenv(ENV, json.dumps({"gla": {"num_warp": 2}}))
    launch = _launch()
    with pytest.raises(ValueError, match=r"unknown gla launch key\(s\) \['num_warp'\]; valid: "
                                         r"\['BT', 'num_stages', 'num_warps'\]"):
        launch_overrides("gla", launch)
    assert launch == _launch(), "nothing is applied when a key is unknown"
    assert launch_overrides("simple_gla", _launch()) == _launch(), "another family's bad key is not checked"


@pytest.mark.parametrize("raw", ["{gla: {num_warps: 2}}", "[1, 2]", "7", '{"gla": 5}', '{"gla": [["BT", 16]]}'])
def test_malformed_json_raises_value_error(raw, monkeypatch):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError, match=ENV):
        launch_overrides("gla", _launch())
