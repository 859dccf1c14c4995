from __future__ import annotations

import pytest
from text_fixtures import write_corpus

from linattn.data.text import SPLITS, TextCorpus, make_corpus, split_of, stdlib_corpus
from linattn.errors import ConfigError, DataError, MissingFileError


def test_reader_patterns_order_and_exclusion(tmp_path):
    c = TextCorpus(str(write_corpus(tmp_path)), ("*.txt",), ("skip",))
    files = c.files()
    assert files == sorted(files, key=lambda p: p.encode())
    assert "sub/d.rst.txt" in files and "a.txt" in files
    assert "sub/e.py" not in files and "skip/f.txt" not in files
    only_rst = TextCorpus(str(tmp_path), ("*.rst.txt",)).files()
    assert only_rst == ["sub/d.rst.txt"]


def test_invalid_utf8_is_replaced_and_empty_files_left_out(tmp_path):
    c = TextCorpus(str(write_corpus(tmp_path)), ("*.txt",), val_fraction=0.0, test_fraction=0.0)
    assert c.read("bad.txt") == "valid \ufffd\ufffd invalid\n"
    docs = dict(c.documents("train"))
    assert "empty.txt" not in docs and docs["b.txt"].startswith("héllo")


def test_splits_disjoint_cover_and_deterministic(tmp_path):
    c = TextCorpus(str(write_corpus(tmp_path)), ("*.txt",), val_fraction=0.2, test_fraction=0.2)
    parts = {s: c.split_files(s) for s in SPLITS}
    assert all(parts.values())
    assert sum(len(p) for p in parts.values()) == len(c.files())
    assert set(parts["train"]).isdisjoint(parts["val"]) and set(parts["val"]).isdisjoint(parts["test"])
    assert set(parts["train"]).isdisjoint(parts["test"])
    again = TextCorpus(str(tmp_path), ("*.txt",), val_fraction=0.2, test_fraction=0.2)
    assert {s: again.split_files(s) for s in SPLITS} == parts
    # a file's split is a function of its path alone: adding files moves nothing
    (tmp_path / "zz_new.txt").write_text("new file\n")
    grown = TextCorpus(str(tmp_path), ("*.txt",), val_fraction=0.2, test_fraction=0.2)
    for s in SPLITS:
        assert set(parts[s]) <= set(grown.split_files(s))
    assert split_of("a.txt", 0.2, 0.2) == split_of("a.txt", 0.2, 0.2)


def test_fingerprint_follows_content(tmp_path):
    c = TextCorpus(str(write_corpus(tmp_path)), ("*.txt",))
    before = c.fingerprint()
    (tmp_path / "a.txt").write_text("changed\n")
    assert TextCorpus(str(tmp_path), ("*.txt",)).fingerprint() != before


def test_errors(tmp_path):
    with pytest.raises(MissingFileError):
        TextCorpus(str(tmp_path / "nope")).files()
    with pytest.raises(DataError):
        TextCorpus(str(tmp_path), ("*.md",)).files()
    with pytest.raises(ConfigError):
        TextCorpus(str(tmp_path), ("*.txt",), val_fraction=0.6, test_fraction=0.5)
    with pytest.raises(ConfigError):
        TextCorpus(str(tmp_path), ())


def test_stdlib_corpus_is_python_sources():
    c = stdlib_corpus()
    files = c.files()
    assert files and all(f.endswith(".py") for f in files)
    assert not any(part in ("site-packages", "test", "__pycache__") for f in files for part in f.split("/"))
    assert "os.py" in files
    assert make_corpus(None).files() == files
