"""Build (or find) the token shards of a text corpus and print what they hold.

    python -m linattn.data.text --out data/text                                   # the stdlib, bytes
    python -m linattn.data.text --out data/text --tokenizer bpe --vocab-size 4096
    python -m linattn.data.text --root /usr/share/doc/python3.11/html/_sources --include '*.rst.txt' --out data/text
    python -m linattn.data.text --python-docs data/python-docs --tokenizer bpe --vocab-size 4096 --out data/text
    python -m linattn.data.text python-docs --out data/python-docs       # fetch the documentation sources

``--python-docs DIR`` builds the corpus of the lm study's ``full-docs`` preset: the standard library's
``*.py`` files plus DIR's ``*.rst.txt`` (DIR as the ``python-docs`` command writes it), one corpus with
source-prefixed paths (:class:`linattn.data.text.corpus.MultiCorpus`).

Prints one JSON object: the shard folder, the tokenizer, per split the files, documents, tokens and bytes, and
the unigram entropy of the train split in bits per byte. A run config of kind ``lm`` with the same corpus,
tokenizer and ``cache_dir`` reuses the folder.
"""

from __future__ import annotations

import argparse
import json
import sys

from linattn.data.text.corpus import SPLITS, make_corpus, make_sources_corpus, stdlib_docs_sources
from linattn.data.text.score import unigram_entropy_bpb
from linattn.data.text.shards import build_shards
from linattn.data.text.tokenizer import TOKENIZERS


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, build the shards, print and return their summary (``python-docs ...``: fetch the
    documentation sources, :mod:`linattn.data.text.python_docs`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["python-docs"]:
        from linattn.data.text.python_docs import main as python_docs_main

        return python_docs_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m linattn.data.text", description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None, help="corpus folder (default: the running Python's standard library)")
    p.add_argument("--include", action="append", default=None, help="file name pattern (repeatable; default *.txt, "
                   "or *.py for the standard library)")
    p.add_argument("--exclude", action="append", default=None,
                   help="folder/file name pattern to leave out (repeatable)")
    p.add_argument("--python-docs", default=None, metavar="DIR",
                   help="the standard library's *.py plus DIR's *.rst.txt (the lm study's full-docs corpus); "
                        "not with --root/--include/--exclude")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--test-fraction", type=float, default=0.05)
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="bytes")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size")
    p.add_argument("--out", required=True, help="cache folder: the shards go to OUT/<key>/")
    a = p.parse_args(argv)
    if a.python_docs is not None:
        if a.root is not None or a.include or a.exclude:
            p.error("--python-docs fixes the corpus; leave out --root, --include and --exclude")
        corpus = make_sources_corpus(stdlib_docs_sources(a.python_docs), a.val_fraction, a.test_fraction)
    else:
        corpus = make_corpus(a.root, a.include, a.exclude, a.val_fraction, a.test_fraction)
    shards = build_shards(corpus, a.out, a.tokenizer, a.vocab_size)
    splits = {s: {k: v for k, v in shards.meta["splits"][s].items() if k != "files"} for s in SPLITS}
    for s in SPLITS:
        splits[s]["files"] = len(shards.meta["splits"][s]["files"])
    summary = {"folder": str(shards.folder), "root": corpus.root, "tokenizer": a.tokenizer,
               "vocab_size": shards.vocab_size, "splits": splits,
               "unigram_bpb": float(unigram_entropy_bpb(shards.tokens("train"), shards.token_bytes()))}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
