"""Fetching the Python documentation sources: from an installed folder, from a .deb (dpkg-deb and the pure
Python reader of the ar + tar format), through a stand-in for apt-get, and the errors when nothing works. The
.deb is built here in the real format; nothing touches the network."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import shutil
import stat
import tarfile

import pytest

from linattn.data.text.__main__ import main
from linattn.data.text.python_docs import PROVENANCE, extract_sources, fetch_python_docs, read_ar
from linattn.errors import DataError, MissingFileError

SOURCES = "usr/share/doc/python3.11/html/_sources"
DOCS = {"about.rst.txt": "About\n=====\n\nThese documents.\n",
        "library/json.rst.txt": ":mod:`json` --- JSON encoder and decoder\n" * 3,
        "c-api/abstract.rst.txt": "Abstract Objects Layer ✓\n"}


def _tar(entries: dict[str, bytes], compression: str = "xz", symlinks: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compression}" if compression else "w") as tar:
        folders = sorted({"./" + "/".join(n.split("/")[:i]) for n in entries for i in range(1, n.count("/") + 1)})
        for folder in folders:
            info = tarfile.TarInfo(folder + "/")
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in entries.items():
            info = tarfile.TarInfo("./" + name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        for name, target in (symlinks or {}).items():
            info = tarfile.TarInfo("./" + name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buf.getvalue()


def _ar(members: list[tuple[str, bytes]]) -> bytes:
    out = [b"!<arch>\n"]
    for name, data in members:
        out.append(f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode("ascii"))
        out.append(data + (b"\n" if len(data) % 2 else b""))
    return b"".join(out)


def make_deb(path, data_member: str = "data.tar.xz") -> str:
    """A python3.11-doc-like .deb: debian-binary, control.tar.xz, data.tar.xz with the _sources tree, a file
    beside it and a symlink in it."""
    control = (b"Package: python3.11-doc\nVersion: 3.11.2-6\nArchitecture: all\n"
               b"Maintainer: nobody <nobody@example.org>\nDescription: test\n")
    data = {f"{SOURCES}/{rel}": text.encode() for rel, text in DOCS.items()}
    data["usr/share/doc/python3.11/html/index.html"] = b"<html></html>\n"
    compression = {"data.tar.xz": "xz", "data.tar.gz": "gz", "data.tar": ""}.get(data_member, "xz")
    tar = _tar(data, compression, symlinks={f"{SOURCES}/link.rst.txt": "about.rst.txt"})
    if data_member.endswith(".zst"):
        tar = b"(not read)"
    path.write_bytes(_ar([("debian-binary", b"2.0\n"), ("control.tar.xz", _tar({"control": control}, "xz")),
                          (data_member, tar)]))
    return str(path)


def _tree(folder) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*") if p.is_file()
            and p.name != PROVENANCE}


def test_the_synthetic_deb_is_an_ar_archive_with_the_three_members(tmp_path):
    deb = make_deb(tmp_path / "python3.11-doc_3.11.2-6_all.deb")
    members = read_ar(open(deb, "rb").read())
    assert list(members) == ["debian-binary", "control.tar.xz", "data.tar.xz"] and members["debian-binary"] == b"2.0\n"
    assert lzma.decompress(members["data.tar.xz"])  # an xz stream, as Debian writes it


@pytest.mark.parametrize("data_member", ["data.tar.xz", "data.tar.gz", "data.tar"])
def test_extract_in_python_takes_only_the_sources(tmp_path, data_member):
    deb = make_deb(tmp_path / "p.deb", data_member)
    assert extract_sources(deb, tmp_path / "out", "3.11", dpkg_deb=None) == "python"
    assert _tree(tmp_path / "out") == DOCS  # no index.html, no symlink


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_extract_with_dpkg_deb_matches_the_python_reader(tmp_path):
    deb = make_deb(tmp_path / "p.deb")
    assert extract_sources(deb, tmp_path / "out", "3.11") == "dpkg-deb"
    assert _tree(tmp_path / "out") == DOCS


def test_extract_errors(tmp_path):
    with pytest.raises(DataError, match="zstd"):
        extract_sources(make_deb(tmp_path / "z.deb", "data.tar.zst"), tmp_path / "o1", "3.11", dpkg_deb=None)
    with pytest.raises(DataError, match="has no usr/share/doc/python3.12/html/_sources"):
        extract_sources(make_deb(tmp_path / "p.deb"), tmp_path / "o2", "3.12", dpkg_deb=None)
    (tmp_path / "bad.deb").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(DataError, match="not an ar archive"):
        extract_sources(tmp_path / "bad.deb", tmp_path / "o3", "3.11", dpkg_deb=None)
    (tmp_path / "cut.deb").write_bytes(open(make_deb(tmp_path / "p.deb"), "rb").read()[:300])
    with pytest.raises(DataError, match="cut short"):
        extract_sources(tmp_path / "cut.deb", tmp_path / "o4", "3.11", dpkg_deb=None)
    with pytest.raises(MissingFileError):
        extract_sources(tmp_path / "missing.deb", tmp_path / "o5", "3.11")
    with pytest.raises(ValueError, match="major.minor"):
        fetch_python_docs(tmp_path / "o6", "3.11/../x")


def test_installed_folder_is_copied_and_a_rerun_replaces_it(tmp_path):
    system = tmp_path / "system"
    for rel, text in DOCS.items():
        (system / SOURCES / rel).parent.mkdir(parents=True, exist_ok=True)
        (system / SOURCES / rel).write_text(text)
    out = tmp_path / "data" / "python-docs"
    summary = fetch_python_docs(out, "3.11", system_root=system, apt_get="/nonexistent/apt-get")
    assert summary["installed"] == str(system / SOURCES) and summary["files"] == 3
    assert summary["bytes"] == sum(len(t.encode()) for t in DOCS.values())
    assert _tree(out) == DOCS and json.loads((out / PROVENANCE).read_text()) == summary
    (system / SOURCES / "about.rst.txt").unlink()
    assert fetch_python_docs(out, "3.11", system_root=system)["files"] == 2 and "about.rst.txt" not in _tree(out)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine\n")
    with pytest.raises(DataError, match="not empty and was not made by this command"):
        fetch_python_docs(foreign, "3.11", system_root=system)
    assert (foreign / "notes.txt").read_text() == "mine\n"


def _fake_apt_get(tmp_path, deb: str | None, code: int = 0) -> str:
    """A stand-in for apt-get: 'download PKG' copies ``deb`` into the current folder, or fails with ``code``."""
    script = tmp_path / "apt-get"
    copy = f'cp "{deb}" .\n' if deb else ""
    script.write_text(f'#!/bin/sh\n[ "$1" = download ] || exit 2\n{copy}'
                      f'[ {code} = 0 ] || echo "E: Unable to locate package $2" >&2\nexit {code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.mark.parametrize("dpkg_deb", ["dpkg-deb", None])
def test_download_through_apt_get(tmp_path, dpkg_deb):
    if dpkg_deb and shutil.which(dpkg_deb) is None:
        pytest.skip("needs dpkg-deb")
    deb = make_deb(tmp_path / "python3.11-doc_3.11.2-6_all.deb")
    summary = fetch_python_docs(tmp_path / "out", "3.11", system_root=tmp_path / "empty",
                                apt_get=_fake_apt_get(tmp_path, deb), dpkg_deb=dpkg_deb)
    assert summary["deb"] == "python3.11-doc_3.11.2-6_all.deb" and summary["files"] == 3
    assert summary["sha256"] == hashlib.sha256(open(deb, "rb").read()).hexdigest()
    assert summary["extracted_with"] == (dpkg_deb or "python") and _tree(tmp_path / "out") == DOCS


def test_errors_when_neither_way_works(tmp_path):
    for apt_get, said in (("/nonexistent/apt-get", "cannot run '/nonexistent/apt-get'"),
                          (_fake_apt_get(tmp_path, None, code=100), "Unable to locate package python3.11-doc")):
        with pytest.raises(MissingFileError) as info:
            fetch_python_docs(tmp_path / "out", "3.11", system_root=tmp_path / "empty", apt_get=apt_get)
        text = str(info.value)
        assert f"{tmp_path / 'empty' / SOURCES} does not exist" in text and said in text
        assert "get them by hand" in text and "apt-get install python3.11-doc" in text and "--deb FILE" in text
        assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".python-docs-")]  # no staging folder left


def test_command_line(tmp_path, capsys):
    deb = make_deb(tmp_path / "python3.11-doc_3.11.2-6_all.deb")
    summary = main(["python-docs", "--out", str(tmp_path / "docs"), "--version", "3.11", "--deb", deb])
    assert json.loads(capsys.readouterr().out) == summary
    assert summary["folder"] == str(tmp_path / "docs") and summary["files"] == 3 and summary["version"] == "3.11"
