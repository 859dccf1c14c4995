"""A corpus: the text files of one folder, read in a fixed order and split into train / validation / test by file.

How a corpus is built (the same on every machine given the same files):

- files: every regular file under ``root`` whose path relative to ``root`` (POSIX form) matches one of
  ``include`` (``fnmatch`` patterns on the file name, e.g. ``*.py``, ``*.rst.txt``) and no ``exclude``
  pattern (``fnmatch`` on any folder name of the relative path, e.g. ``site-packages``), symlinks not
  followed; sorted by relative path (byte order of the UTF-8 path);
- text: each file's bytes decoded as UTF-8 with ``errors="replace"`` (an invalid byte becomes U+FFFD), so
  every tokenizer sees the same text and "bytes" always means the UTF-8 bytes of that text; empty files
  are left out;
- split: by file, from the first 8 bytes of SHA-1 of the relative path read as a number u in [0, 1):
  test if u < test_fraction, validation if u < test_fraction + val_fraction, train otherwise. A file's
  split depends on its path only, so adding files never moves another file between splits.

The default corpus (:func:`stdlib_corpus`) is the running Python's standard library sources
(``sysconfig.get_paths()["stdlib"]``), ``*.py`` files, leaving out third-party packages
(``site-packages``, ``dist-packages``), the test suites (``test``, ``tests``, ``idle_test``), byte-code
caches and the build-specific ``_sysconfigdata_*`` module.

A corpus of several sources (:class:`MultiCorpus`, :func:`make_sources_corpus`): each source is a folder read
as above under a name; a file's path in the corpus is ``<name>/<relative path>``, so two sources cannot give
the same path, and the split is :func:`split_of` of that prefixed path (still a function of the path only).
:func:`stdlib_docs_sources` is the standard library's ``*.py`` plus the Python documentation's ``*.rst.txt``
(the reStructuredText sources Debian's ``python3.X-doc`` ships; ``python -m linattn.data.text python-docs``
fetches them).
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from linattn.errors import ConfigError, DataError, MissingFileError

SPLITS = ("train", "val", "test")
STDLIB_INCLUDE = ("*.py",)
STDLIB_EXCLUDE = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                  "_sysconfigdata_*")


def split_of(relpath: str, val_fraction: float, test_fraction: float) -> str:
    """The split of the file at ``relpath`` (POSIX, relative to the corpus root): a pure function of the path."""
    u = int.from_bytes(hashlib.sha1(relpath.encode("utf-8")).digest()[:8], "big") / 2.0**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


class _Splits:
    """What a corpus derives from its ``files()`` (sorted paths), ``read(path)`` and split fractions."""

    def split_files(self, split: str) -> list[str]:
        """The paths of ``split`` ("train", "val" or "test"), in corpus order."""
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {list(SPLITS)}, got {split!r}")
        return [f for f in self.files() if split_of(f, self.val_fraction, self.test_fraction) == split]

    def documents(self, split: str) -> Iterator[tuple[str, str]]:
        """(path, text) of every non-empty file of ``split``, in corpus order."""
        for path in self.split_files(split):
            text = self.read(path)
            if text:
                yield path, text


@dataclass(frozen=True)
class TextCorpus(_Splits):
    """The text files under ``root`` matching ``include`` and no ``exclude`` (module docstring), split by file."""

    root: str
    include: tuple[str, ...] = ("*.txt",)
    exclude: tuple[str, ...] = ()
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    _files: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        if not self.include or not all(isinstance(p, str) and p for p in self.include):
            raise ConfigError(f"expected a non-empty list of file name patterns, got {self.include!r}",
                              field="include")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(f"expected a fraction in [0, 1), got {value!r}", field=name)
        if self.val_fraction + self.test_fraction >= 1:
            raise ConfigError(f"val_fraction + test_fraction must be < 1 (the train split needs files), got "
                              f"{self.val_fraction} + {self.test_fraction}")

    def _excluded(self, rel: Path) -> bool:
        return any(fnmatch.fnmatchcase(part, pat) for part in rel.parts for pat in self.exclude)

    def files(self) -> list[str]:
        """Every file's relative POSIX path, sorted; MissingFileError for a missing root, DataError for no file."""
        if self._files:
            return list(self._files)
        root = Path(self.root)
        if not root.is_dir():
            raise MissingFileError(f"corpus folder {root} does not exist (or is not a folder)")
        found = []
        for path in root.rglob("*"):
            rel = path.relative_to(root)
            if path.is_symlink() or not path.is_file() or self._excluded(rel):
                continue
            if any(fnmatch.fnmatchcase(rel.name, pat) for pat in self.include):
                found.append(rel.as_posix())
        found.sort(key=lambda p: p.encode("utf-8"))
        if not found:
            raise DataError(f"corpus folder {root} has no file matching {list(self.include)} "
                            f"(excluding {list(self.exclude)})")
        self._files.extend(found)
        return found

    def read(self, relpath: str) -> str:
        """The text of one file: UTF-8, invalid bytes replaced by U+FFFD."""
        return (Path(self.root) / relpath).read_bytes().decode("utf-8", errors="replace")

    def describe(self) -> dict:
        """The settings, as a shard folder's meta.json records them."""
        return {"root": self.root, "include": list(self.include), "exclude": list(self.exclude),
                "val_fraction": self.val_fraction, "test_fraction": self.test_fraction}

    def fingerprint(self) -> str:
        """A hash of the settings, the file list and every file's bytes: the key of caches built from it."""
        h = hashlib.sha1(repr((self.include, self.exclude, self.val_fraction, self.test_fraction)).encode())
        for rel in self.files():
            data = (Path(self.root) / rel).read_bytes()
            h.update(rel.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0" + data)
        return h.hexdigest()[:20]


def stdlib_root() -> str:
    """The running Python's standard library folder."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_corpus(val_fraction: float = 0.05, test_fraction: float = 0.05) -> TextCorpus:
    """The default corpus: the running Python's standard library ``*.py`` sources (module docstring)."""
    return TextCorpus(stdlib_root(), STDLIB_INCLUDE, STDLIB_EXCLUDE, val_fraction, test_fraction)


def make_corpus(root: str | None = None, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
                val_fraction: float = 0.05, test_fraction: float = 0.05) -> TextCorpus:
    """The corpus of ``root`` (None: the standard library, with its include/exclude defaults unless given)."""
    if root is None:
        return TextCorpus(stdlib_root(), tuple(include or STDLIB_INCLUDE),
                          tuple(STDLIB_EXCLUDE if exclude is None else exclude), val_fraction, test_fraction)
    return TextCorpus(root, tuple(include or ("*.txt",)), tuple(exclude or ()), val_fraction, test_fraction)


SOURCE_KEYS = ("name", "root", "include", "exclude")
DOCS_INCLUDE = ("*.rst.txt",)


@dataclass(frozen=True)
class MultiCorpus(_Splits):
    """Several folders as one corpus: ``sources`` are (name, TextCorpus) pairs; a file's path is
    ``<name>/<path in its source>`` and its split :func:`split_of` of that path (each source's own fractions
    are unused). Files are sorted by that path, so the order, the splits and the fingerprint do not depend on
    the order the sources are listed in."""

    sources: tuple[tuple[str, TextCorpus], ...]
    val_fraction: float = 0.05
    test_fraction: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple((str(n), c) for n, c in self.sources))
        names = [n for n, _ in self.sources]
        if not names:
            raise ConfigError("expected at least one source", field="sources")
        for name in names:
            # the name is the first folder of every path: one path component, file-safe
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
                raise ConfigError(f"a source name must match [A-Za-z0-9_.-]+, got {name!r}", field="sources")
        if len(set(names)) != len(names):
            raise ConfigError(f"source names must differ, got {names}", field="sources")
        # the checks of a single corpus (fractions in [0, 1), their sum < 1)
        TextCorpus(".", val_fraction=self.val_fraction, test_fraction=self.test_fraction)

    @property
    def root(self) -> str:
        """The sources, for messages: ``name=root; ...``."""
        return "; ".join(f"{n}={c.root}" for n, c in self.sources)

    def _source(self, path: str) -> tuple[TextCorpus, str]:
        name, _, rel = path.partition("/")
        for n, c in self.sources:
            if n == name and rel:
                return c, rel
        raise DataError(f"{path!r} is not a file of this corpus (sources {[n for n, _ in self.sources]})")

    def files(self) -> list[str]:
        """Every file's ``<source>/<relative path>``, sorted (byte order); errors as each source's files()."""
        found = [f"{n}/{rel}" for n, c in self.sources for rel in c.files()]
        return sorted(found, key=lambda p: p.encode("utf-8"))

    def read(self, path: str) -> str:
        """The text of the file at ``<source>/<relative path>`` (UTF-8, invalid bytes replaced)."""
        corpus, rel = self._source(path)
        return corpus.read(rel)

    def describe(self) -> dict:
        """The settings, as a shard folder's meta.json records them."""
        return {"sources": [{"name": n, "root": c.root, "include": list(c.include), "exclude": list(c.exclude)}
                            for n, c in self.sources],
                "val_fraction": self.val_fraction, "test_fraction": self.test_fraction}

    def fingerprint(self) -> str:
        """A hash of every source's settings, the file list and every file's bytes (the key of its caches);
        it starts from a tag no single corpus has, so the two kinds never share a cache folder."""
        settings = sorted((n, c.include, c.exclude) for n, c in self.sources)
        h = hashlib.sha1(repr(("sources", settings, self.val_fraction, self.test_fraction)).encode())
        for path in self.files():
            corpus, rel = self._source(path)
            data = (Path(corpus.root) / rel).read_bytes()
            h.update(path.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0" + data)
        return h.hexdigest()[:20]


def make_sources_corpus(sources: Sequence[dict], val_fraction: float = 0.05,
                        test_fraction: float = 0.05) -> MultiCorpus:
    """The corpus of ``sources``, each ``{name, root, include, exclude}`` read as :func:`make_corpus` reads
    them (``root`` None: the standard library with its defaults)."""
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
        raise ConfigError(f"expected a non-empty list of sources, got {sources!r}", field="sources")
    parts = []
    for i, src in enumerate(sources):
        if not isinstance(src, dict) or "name" not in src or set(src) - set(SOURCE_KEYS):
            raise ConfigError(f"expected a mapping with keys name and (optional) root, include, exclude; got "
                              f"{src!r}", field=f"sources[{i}]")
        parts.append((src["name"], make_corpus(src.get("root"), src.get("include"), src.get("exclude"),
                                               val_fraction, test_fraction)))
    return MultiCorpus(tuple(parts), val_fraction, test_fraction)


def stdlib_docs_sources(docs_root: str) -> list[dict]:
    """The sources of the standard library ``*.py`` (as :func:`stdlib_corpus`) plus the ``*.rst.txt`` files
    under ``docs_root`` (the Python documentation's ``_sources`` folder)."""
    return [{"name": "stdlib", "root": None, "include": None, "exclude": None},
            {"name": "docs", "root": str(docs_root), "include": list(DOCS_INCLUDE), "exclude": None}]
