"""The setting triton_launch (LINATTN_TRITON_LAUNCH): launch overrides per Triton kernel family, applied to the
family's LAUNCH dict when it registers and whenever the setting changes, checked against the family's keys."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from linattn import switches  # noqa: E402
from linattn.ops.common.triton_utils import launch_overrides  # noqa: E402

ENV = "LINATTN_TRITON_LAUNCH"


def _launch() -> dict:
    return {"BT": 64, "num_warps": 4, "num_stages": 2}


@pytest.fixture(autouse=True)
def own_families():
    """Test families registered under names no kernel module uses, removed afterwards."""
    yield
    for family in [f for f in switches._launch_tables if f.startswith("test_")]:
        del switches._launch_tables[family], switches._launch_written[family]


def test_no_setting_leaves_the_launch_unchanged():
    launch = _launch()
    assert launch_overrides("test_gla", launch) is launch and launch == _launch()


def test_own_family_is_updated_in_place_and_others_are_ignored():
    with switches.settings(triton_launch={"test_gla": {"num_warps": 2, "BT": 32}, "test_simple": {"num_warps": 8}}):
        launch = _launch()
        out = launch_overrides("test_gla", launch)
        assert out is launch and launch == {"BT": 32, "num_warps": 2, "num_stages": 2}
        assert launch_overrides("test_simple", _launch()) == {"BT": 64, "num_warps": 8, "num_stages": 2}
        assert launch_overrides("test_absent", _launch()) == _launch(), "a family not named keeps its launch"
    assert launch == _launch(), "the module's values come back after the block"


def test_a_registered_family_follows_later_changes():
    launch = launch_overrides("test_gla", _launch())
    with switches.settings(triton_launch={"test_gla": {"num_warps": 8}}):
        assert launch["num_warps"] == 8
        launch["BT"] = 16  # a tuning tool's direct change lasts until the setting changes
        assert launch["BT"] == 16
    assert launch == _launch()


def test_unknown_key_names_the_family_and_the_valid_keys():
    launch = launch_overrides("test_gla", _launch())
    with pytest.raises(ValueError, match=r"unknown test_gla launch key\(s\) \['num_warp'\]; valid: "
                                         r"\['BT', 'num_stages', 'num_warps'\]"):
        with switches.settings(triton_launch={"test_gla": {"num_warp": 2}}):
            pass
    assert launch == _launch() and switches.current().triton_launch == {}, "nothing is applied when a key is unknown"
    with switches.settings(triton_launch={"test_other": {"num_warp": 2}}):  # not registered: not checked yet
        with pytest.raises(ValueError, match=r"unknown test_other launch key"):
            launch_overrides("test_other", _launch())


@pytest.mark.parametrize("raw", ["{gla: {num_warps: 2}}", "[1, 2]", "7", '{"gla": 5}', '{"gla": [["BT", 16]]}'])
def test_malformed_json_raises_value_error(raw):
    with pytest.raises(ValueError, match=ENV):
        switches.from_environment({ENV: raw})


def test_the_environment_variable_gives_the_setting():
    value = {"gla": {"num_warps": 2}}
    assert switches.from_environment({ENV: json.dumps(value)}).triton_launch == value
    assert switches.from_environment({ENV: ""}).triton_launch == {}
