"""The Python documentation's reStructuredText sources, fetched into a folder for use as a text corpus.

Debian's ``python3.X-doc`` package ships the documentation's sources as
``/usr/share/doc/python3.X/html/_sources/**/*.rst.txt`` (about 11 MB for 3.11). :func:`fetch_python_docs`
copies that folder when the package is installed; otherwise it downloads the package with
``apt-get download python3.X-doc`` (no root needed, nothing installed) or takes a ``.deb`` given by hand, and
extracts only ``_sources``: with ``dpkg-deb -x`` where it exists, else by reading the ``.deb`` itself (an
``ar`` archive holding ``debian-binary``, ``control.tar.*`` and ``data.tar.*``; the standard library reads
``.xz``, ``.gz`` and ``.bz2`` data members, not ``.zst``). The output folder holds the ``_sources`` tree and
``python-docs.json`` (where the files came from, how many, how many bytes); a folder holding that file is
replaced when the command runs again, any other non-empty folder is refused.

    python -m linattn.data.text python-docs --out data/python-docs              # the running Python's version
    python -m linattn.data.text python-docs --out data/python-docs --version 3.11 --deb python3.11-doc_*.deb
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

from linattn.errors import ConfigError, DataError, MissingFileError

PROVENANCE = "python-docs.json"
PATTERN = "*.rst.txt"


def default_version() -> str:
    """The running Python's ``major.minor``: the documentation that matches its standard library."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def sources_path(version: str) -> str:
    """Where the documentation's sources lie inside the package (and on a system that installed it)."""
    return f"usr/share/doc/python{version}/html/_sources"


def manual_steps(version: str) -> str:
    """How to get the files without this command's help, for error messages."""
    pkg = f"python{version}-doc"
    return (f"get them by hand: install the package (apt-get install {pkg}, as root) and rerun, or download "
            f"{pkg}_*.deb from https://packages.debian.org/{pkg} and rerun with --deb FILE, or run "
            f"'dpkg-deb -x FILE tmp && cp -r tmp/{sources_path(version)} OUT' yourself")


def read_ar(data: bytes, source: str = "archive") -> dict[str, bytes]:
    """The members of ``ar`` archive ``data`` (the format of a ``.deb``): name -> bytes; DataError naming
    ``source`` when it is not one."""
    if not data.startswith(b"!<arch>\n"):
        raise DataError(f"{source}: not an ar archive (a .deb starts with '!<arch>')")
    members, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        if header[58:60] != b"`\n":
            raise DataError(f"{source}: bad ar member header at byte {pos}")
        name = header[:16].decode("ascii", errors="replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise DataError(f"{source}: bad ar member size at byte {pos}") from None
        start = pos + 60
        if start + size > len(data):
            raise DataError(f"{source}: member {name!r} is cut short (truncated download?)")
        members[name] = data[start:start + size]
        pos = start + size + (size % 2)  # members start at even offsets
    return members


def _copy_tree(src: Path, dst: Path) -> None:
    """Regular files under ``src`` into ``dst`` (symlinks and other entries left out)."""
    for path in sorted(src.rglob("*")):
        if path.is_file() and not path.is_symlink():
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def extract_with_python(deb: Path, dst: Path, version: str) -> int:
    """The ``_sources`` files of ``deb`` into ``dst`` by reading the archive in Python; the files written."""
    members = read_ar(deb.read_bytes(), str(deb))
    names = [n for n in members if n.startswith("data.tar")]
    if len(names) != 1:
        raise DataError(f"{deb}: expected one data.tar.* member in the .deb, found {sorted(members)}")
    if names[0].endswith(".zst"):
        raise DataError(f"{deb}: its data member is {names[0]} (zstd), which Python's tarfile cannot read; install "
                        f"dpkg-deb (package dpkg) or {manual_steps(version)}")
    prefix = sources_path(version) + "/"
    written = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(members[names[0]]), mode="r:*") as tar:
            for member in tar:
                name = member.name[2:] if member.name.startswith("./") else member.name.lstrip("/")
                if not member.isfile() or not name.startswith(prefix):
                    continue
                rel = Path(name[len(prefix):])
                if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                    raise DataError(f"{deb}: unsafe path {member.name!r} in the archive")
                target = dst / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as f:
                    target.write_bytes(f.read())
                written += 1
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError, zlib.error) as exc:
        raise DataError(f"{deb}: cannot read its {names[0]} ({exc})") from exc
    return written


def extract_sources(deb: str | Path, dst: str | Path, version: str, dpkg_deb: str | None = "dpkg-deb") -> str:
    """The documentation's ``_sources`` of package file ``deb`` into folder ``dst``: with ``dpkg_deb`` where
    that program is found (None: never), else in Python. Returns the method used; DataError when the package
    holds no ``_sources`` for ``version``."""
    deb, dst = Path(deb), Path(dst)
    if not deb.is_file():
        raise MissingFileError(f"package file {deb} does not exist")
    dst.mkdir(parents=True, exist_ok=True)
    program = shutil.which(dpkg_deb) if dpkg_deb else None
    if program is not None:
        with tempfile.TemporaryDirectory(prefix="python-docs-") as tmp:
            done = subprocess.run([program, "-x", str(deb), tmp], capture_output=True, text=True)
            if done.returncode != 0:
                raise DataError(f"{program} -x {deb} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
            src = Path(tmp) / sources_path(version)
            if not src.is_dir():
                raise DataError(f"{deb} has no {sources_path(version)} (is it python{version}-doc?)")
            _copy_tree(src, dst)
        return "dpkg-deb"
    if extract_with_python(deb, dst, version) == 0:
        raise DataError(f"{deb} has no {sources_path(version)} (is it python{version}-doc?)")
    return "python"


def download_deb(version: str, folder: Path, apt_get: str = "apt-get") -> Path:
    """``apt-get download python{version}-doc`` run in ``folder``: the downloaded file. MissingFileError
    saying what failed (no apt-get, the download's error, no file)."""
    pkg = f"python{version}-doc"
    try:
        done = subprocess.run([apt_get, "download", pkg], cwd=folder, capture_output=True, text=True)
    except OSError as exc:
        raise MissingFileError(f"cannot run {apt_get!r} ({exc.strerror or exc})") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-500:]
        raise MissingFileError(f"'{apt_get} download {pkg}' failed with exit code {done.returncode}: {tail}")
    debs = sorted(folder.glob(f"{pkg}_*.deb"))
    if not debs:
        raise MissingFileError(f"'{apt_get} download {pkg}' left no {pkg}_*.deb in {folder}")
    return debs[-1]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _prepare_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / PROVENANCE).is_file():
        raise DataError(f"--out {out} is not empty and was not made by this command (no {PROVENANCE}); "
                        f"give an empty or new folder")


def fetch_python_docs(out: str | Path, version: str | None = None, deb: str | Path | None = None,
                      system_root: str | Path = "/", apt_get: str = "apt-get",
                      dpkg_deb: str | None = "dpkg-deb") -> dict:
    """The documentation sources of Python ``version`` (default: the running one) into folder ``out``: from
    ``deb`` when given, else from ``<system_root>/usr/share/doc/python{version}/html/_sources`` when present,
    else from the package ``apt-get download`` fetches. Returns (and writes to ``out/python-docs.json``) the
    folder, version, where the files came from, and the count and bytes of its ``*.rst.txt`` files.
    MissingFileError naming each way that failed and how to get the files by hand."""
    version = version or default_version()
    if not re.fullmatch(r"3\.\d+", str(version)):
        raise ConfigError(f"expected a Python 3 version as major.minor (e.g. 3.11), got {version!r}", field="version")
    out = Path(out)
    _prepare_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".python-docs-", dir=out.parent))
    try:
        installed = Path(system_root) / sources_path(version)
        if deb is not None:
            method = extract_sources(deb, staging, version, dpkg_deb)
            origin = {"deb": Path(deb).name, "sha256": _sha256(Path(deb)), "extracted_with": method}
        elif installed.is_dir():
            _copy_tree(installed, staging)
            origin = {"installed": str(installed)}
        else:
            with tempfile.TemporaryDirectory(prefix="python-docs-deb-") as tmp:
                try:
                    path = download_deb(version, Path(tmp), apt_get)
                except MissingFileError as exc:
                    raise MissingFileError(f"Python {version} documentation sources: {installed} does not exist, "
                                           f"and the download failed: {exc}; {manual_steps(version)}") from exc
                method = extract_sources(path, staging, version, dpkg_deb)
                origin = {"deb": path.name, "sha256": _sha256(path), "extracted_with": method}
        files = sorted(p for p in staging.rglob(PATTERN) if p.is_file())
        if not files:
            raise DataError(f"no {PATTERN} file in the documentation sources ({origin}); {manual_steps(version)}")
        summary = {"folder": str(out), "version": version, **origin, "files": len(files),
                   "bytes": sum(p.stat().st_size for p in files)}
        (staging / PROVENANCE).write_text(json.dumps(summary, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """``python -m linattn.data.text python-docs``: fetch, print the summary as JSON, return it."""
    p = argparse.ArgumentParser(prog="python -m linattn.data.text python-docs",
                                description="Fetch the Python documentation's *.rst.txt sources into a folder.")
    p.add_argument("--out", required=True, help="folder to write (new, empty, or made by this command before)")
    p.add_argument("--version", default=None, help=f"Python version, major.minor (default {default_version()})")
    p.add_argument("--deb", default=None, help="a python3.X-doc .deb downloaded by hand, instead of looking for "
                   "the installed files or downloading")
    a = p.parse_args(argv)
    summary = fetch_python_docs(a.out, a.version, a.deb)
    print(json.dumps(summary, indent=1))
    return summary
