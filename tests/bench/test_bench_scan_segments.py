"""linattn.bench.scan_segments: segmented scans against uncut ones, rows per mode."""

import json

import pytest
import torch

from linattn.bench import scan_segments
from linattn.ops.common.triton_compat import triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton through its interpreter


@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_rows_name_the_cut_and_agree_with_the_uncut_scan(tmp_path, capsys):
    out = tmp_path / "segments.json"
    scan_segments.main(["--ops", "simple_gla", "--shapes", "1x600,packed", "--H", "2", "--K", "16", "--V", "16",
                        "--dtype", "float32", "--packed-tokens", "600", "--doc-lengths", "100,400", "--seg-min", "2",
                        "--repeats", "1", "--modes", "never,always", "--device", DEVICE, "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["mode"]) for r in rows] == [("1x600", "never"), ("1x600", "always"),
                                                        ("packed", "never"), ("packed", "always")]
    # 600 tokens are 10 chunks of 64: cut into segments of 2 chunks or more; never: no fix-up launch
    assert [r["segments"] > 1 for r in rows] == [False, True, False, True]
    assert all(r["max_rel_error_vs_never"] < 1e-5 and r["ms"] > 0 for r in rows)
    assert "mode=always" in capsys.readouterr().out


def test_unknown_modes_are_named(capsys):
    with pytest.raises(SystemExit):
        scan_segments.main(["--modes", "sometimes"])
    assert "--modes takes never, auto, always, got sometimes" in capsys.readouterr().err
