"""linattn.bench.accuracy: low-precision implementations scored against a float32 reference."""

import json

import pytest
import torch

from linattn.bench import accuracy
from linattn.ops.common.triton_compat import triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton through its interpreter
SMALL = dict(B=1, T=37, H=2, K=8, V=8, device="cpu")


def test_the_reference_backend_in_float32_scores_zero_and_bf16_scores_its_rounding():
    result = accuracy.measure("gla", ["chunk", "recurrent"], dtype=torch.float32, **SMALL)
    assert [r["impl"] for r in result["rows"]] == ["chunk", "recurrent"]  # the rows asked for, no others
    rows = {r["impl"]: r["errors"] for r in result["rows"]}
    assert list(rows["chunk"]) == ["o", "q", "k", "v", "g"]
    assert all(e == 0.0 for e in rows["chunk"].values())
    assert all(0.0 < e < 1e-5 for e in rows["recurrent"].values())
    bf16 = accuracy.measure("gla", ["chunk"], dtype=torch.bfloat16, **SMALL)["rows"][0]["errors"]
    assert all(1e-4 < e < 3e-2 for e in bf16.values()), bf16


def test_a_bad_backend_is_named_before_any_compute(monkeypatch):
    def no_inputs(*args, **kwargs):
        raise AssertionError("inputs were made")

    monkeypatch.setattr(accuracy.get_op("gla"), "example_inputs", no_inputs)
    with pytest.raises(ValueError, match="--impls: gla has no backend 'fast'"):
        accuracy.measure("gla", ["chunk", "fast"], dtype=torch.bfloat16, **SMALL)
    with pytest.raises(ValueError, match="reference"):
        accuracy.measure("gla", ["chunk"], dtype=torch.bfloat16, reference="fla", **SMALL)


def test_missing_fla_is_a_row_note_and_the_table_and_json_are_written(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(accuracy, "fla_function", lambda op: None)
    out = tmp_path / "acc.json"
    accuracy.main(["--op", "gla", "--impls", "chunk,fla", "--device", "cpu", "--B", "1", "--T", "20", "--H", "1",
                   "--K", "8", "--V", "8", "--out", str(out)])
    text = capsys.readouterr().out
    assert "| gla (bfloat16, T=20) | o | q | k | v | g |" in text and "| fla | FLA is not installed |" in text
    saved = json.loads(out.read_text())
    assert saved["reference"] == "chunk, float32" and saved["rows"][1] == {"impl": "fla",
                                                                          "note": "FLA is not installed"}


def test_fla_rows_use_fla_semantics(monkeypatch):
    # mesa_net: FLA's kernel does not scale q, so every row (the reference too) runs with scale 1
    seen = []
    spec = accuracy.get_op("mesa_net")
    real = spec.fn

    def recording(**kwargs):
        seen.append(kwargs["scale"])
        return real(**kwargs)

    monkeypatch.setattr(spec, "fn", recording)
    accuracy.measure("mesa_net", ["chunk"], dtype=torch.float32, **{**SMALL, "T": 9})
    assert seen == [1.0, 1.0]
    assert "the op's keywords in every row: {'solver': 'cg', 'cg_steps': 30, 'scale': 1.0}" in accuracy.table(
        accuracy.measure("mesa_net", [], dtype=torch.float32, **{**SMALL, "T": 9}))


@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_a_launch_setting_adds_a_triton_row_that_runs_under_it():
    tf32_dots = {"mesa_net": {"cg_dots": "tf32"}}
    result = accuracy.measure("mesa_net", ["triton"], dtype=torch.bfloat16, launches=[tf32_dots],
                              **{**SMALL, "T": 20, "device": DEVICE})
    default, tf32 = result["rows"]
    assert tf32["impl"] == 'triton {"mesa_net":{"cg_dots":"tf32"}}'
    assert default["errors"] != tf32["errors"], "the setting took effect"
    assert all(e < 3e-2 for row in (default, tf32) for e in row["errors"].values())
