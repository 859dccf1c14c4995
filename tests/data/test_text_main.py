from __future__ import annotations

import json

from text_fixtures import write_corpus

from linattn.data.text.__main__ import main


def test_command_builds_and_summarises(tmp_path, capsys):
    root = write_corpus(tmp_path / "corpus")
    argv = ["--root", str(root), "--include", "*.txt", "--exclude", "skip", "--val-fraction", "0.2",
            "--test-fraction", "0.2", "--out", str(tmp_path / "cache")]
    summary = main(argv)
    assert json.loads(capsys.readouterr().out) == summary
    splits = summary["splits"]
    # 4 *.txt of TEXTS outside skip/, 40 numbered and bad.txt; empty.txt is left out
    assert sum(s["documents"] for s in splits.values()) == 45
    assert all(s["tokens"] == s["bytes"] > 0 for s in splits.values())
    assert main(argv)["folder"] == summary["folder"]  # found, not rebuilt
