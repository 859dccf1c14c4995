"""A tiny text corpus in a temporary folder, shared by the text-data tests."""

from __future__ import annotations

from pathlib import Path

TEXTS = {
    "a.txt": "hello world\n" * 20,
    "b.txt": "héllo wörld — ünïcode ✓\n" * 10,
    "sub/c.txt": "def f(x):\n    return x + 1\n" * 15,
    "sub/d.rst.txt": "Title\n=====\n\nSome *text*.\n" * 12,
    "sub/e.py": "print('ignored by *.txt')\n",
    "skip/f.txt": "in an excluded folder\n",
}


def write_corpus(root: Path, n_extra: int = 40) -> Path:
    """The files of TEXTS plus ``n_extra`` numbered ones (so that every split gets files)."""
    for rel, text in TEXTS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    for i in range(n_extra):
        (root / f"n/{i:03d}.txt").parent.mkdir(parents=True, exist_ok=True)
        (root / f"n/{i:03d}.txt").write_text(f"document {i}: " + "lorem ipsum dolor sit amet " * (5 + i % 7) + "\n")
    (root / "bad.txt").write_bytes(b"valid \xff\xfe invalid\n")
    (root / "empty.txt").write_bytes(b"")
    return root
