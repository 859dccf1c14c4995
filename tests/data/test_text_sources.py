"""A corpus of several folders: source-prefixed paths, splits by that path (disjoint, deterministic, stable when
files are added), reading, fingerprints, shards, and the builder's --python-docs corpus."""

from __future__ import annotations

import json

import pytest
from text_fixtures import write_corpus

from linattn.data.text import (
    SPLITS,
    MultiCorpus,
    TextCorpus,
    build_shards,
    make_sources_corpus,
    split_of,
    stdlib_docs_sources,
)
from linattn.data.text.__main__ import main
from linattn.errors import ConfigError, DataError


def _sources(tmp_path) -> list[dict]:
    write_corpus(tmp_path / "a")
    write_corpus(tmp_path / "b", n_extra=30)
    return [{"name": "one", "root": str(tmp_path / "a"), "include": ["*.txt"], "exclude": ["skip"]},
            {"name": "two", "root": str(tmp_path / "b"), "include": ["*.txt"]}]


def test_paths_are_prefixed_and_sources_cannot_collide(tmp_path):
    c = make_sources_corpus(_sources(tmp_path), 0.2, 0.2)
    files = c.files()
    assert files == sorted(files, key=lambda p: p.encode())
    # the same relative path in both folders gives two files
    assert "one/a.txt" in files and "two/a.txt" in files and "two/skip/f.txt" in files
    assert "one/skip/f.txt" not in files and not any(f.endswith(".py") for f in files)
    assert len(files) == len(set(files)) == len(TextCorpus(str(tmp_path / "a"), ("*.txt",), ("skip",)).files()) \
        + len(TextCorpus(str(tmp_path / "b"), ("*.txt",)).files())
    assert c.read("two/b.txt").startswith("héllo") and c.read("one/bad.txt") == "valid \ufffd\ufffd invalid\n"
    with pytest.raises(DataError, match="not a file of this corpus"):
        c.read("three/a.txt")


def test_splits_disjoint_by_file_deterministic_and_by_prefixed_path(tmp_path):
    sources = _sources(tmp_path)
    c = make_sources_corpus(sources, 0.2, 0.2)
    parts = {s: c.split_files(s) for s in SPLITS}
    assert all(parts.values()) and sum(map(len, parts.values())) == len(c.files())
    for a, b in (("train", "val"), ("val", "test"), ("train", "test")):
        assert set(parts[a]).isdisjoint(parts[b])
    assert all(split_of(f, 0.2, 0.2) == s for s, fs in parts.items() for f in fs)
    # the listing order of the sources changes nothing: not the files, the splits or the fingerprint
    flipped = make_sources_corpus(sources[::-1], 0.2, 0.2)
    assert {s: flipped.split_files(s) for s in SPLITS} == parts and flipped.fingerprint() == c.fingerprint()
    # a file's split is its path's: adding files (here to one source) moves no other file
    (tmp_path / "b" / "zz_new.txt").write_text("a new file\n")
    grown = make_sources_corpus(sources, 0.2, 0.2)
    assert "two/zz_new.txt" in grown.files() and grown.fingerprint() != c.fingerprint()
    for s in SPLITS:
        assert set(parts[s]) <= set(grown.split_files(s))


def test_documents_and_shards(tmp_path):
    c = make_sources_corpus(_sources(tmp_path), 0.2, 0.2)
    docs = {path: text for s in SPLITS for path, text in c.documents(s)}
    assert all(docs.values()) and "one/empty.txt" in c.files() and "one/empty.txt" not in docs
    shards = build_shards(c, tmp_path / "cache")
    meta = shards.meta
    assert [s["name"] for s in meta["sources"]] == ["one", "two"] and meta["val_fraction"] == 0.2
    assert meta["splits"]["train"]["files"] == [p for p, _ in c.documents("train")]
    # a one-source corpus of the same folder is another corpus (other paths, other splits): another cache
    single = TextCorpus(str(tmp_path / "b"), ("*.txt",), val_fraction=0.2, test_fraction=0.2)
    assert build_shards(single, tmp_path / "cache").folder != shards.folder
    assert build_shards(make_sources_corpus(_sources(tmp_path), 0.2, 0.2), tmp_path / "cache").folder == shards.folder


@pytest.mark.parametrize("sources, match", [
    ([], "non-empty list"),
    ([{"root": "x"}], "sources\\[0\\]"),
    ([{"name": "a", "root": "x", "colour": 1}], "sources\\[0\\]"),
])
def test_bad_sources(sources, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        make_sources_corpus(sources)


def test_bad_names_and_fractions(tmp_path):
    one = TextCorpus(str(tmp_path))
    for names in (["a/b"], [".."], ["a", "a"]):
        with pytest.raises(ConfigError, match="sources"):
            MultiCorpus(tuple((n, one) for n in names))
    with pytest.raises(ConfigError):
        MultiCorpus((("a", one),), val_fraction=0.6, test_fraction=0.5)


def test_builder_python_docs_corpus(tmp_path, monkeypatch, capsys):
    """--python-docs DIR: the standard library's *.py (here a stand-in folder) plus DIR's *.rst.txt."""
    stdlib = tmp_path / "stdlib"
    for i in range(30):
        (stdlib / "pkg").mkdir(parents=True, exist_ok=True)
        (stdlib / "pkg" / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n")
    (stdlib / "test").mkdir()
    (stdlib / "test" / "test_x.py").write_text("left out\n")
    docs = tmp_path / "docs"
    for i in range(30):
        (docs / "library").mkdir(parents=True, exist_ok=True)
        (docs / "library" / f"m{i:02d}.rst.txt").write_text(f"Module {i}\n=========\n\nText *{i}*.\n")
    (docs / "python-docs.json").write_text("{}")
    monkeypatch.setattr("linattn.data.text.corpus.stdlib_root", lambda: str(stdlib))
    summary = main(["--python-docs", str(docs), "--val-fraction", "0.2", "--test-fraction", "0.2",
                    "--out", str(tmp_path / "cache")])
    assert json.loads(capsys.readouterr().out) == summary
    assert sum(s["files"] for s in summary["splits"].values()) == 60
    meta = json.loads((tmp_path / "cache" / summary["folder"].rsplit("/", 1)[1] / "meta.json").read_text())
    files = [f for s in SPLITS for f in meta["splits"][s]["files"]]
    assert {f.split("/")[0] for f in files} == {"stdlib", "docs"} and "stdlib/test/test_x.py" not in files
    assert stdlib_docs_sources(str(docs))[1] == {"name": "docs", "root": str(docs), "include": ["*.rst.txt"],
                                                 "exclude": None}
    with pytest.raises(SystemExit):
        main(["--python-docs", str(docs), "--root", str(docs), "--out", str(tmp_path / "cache")])
