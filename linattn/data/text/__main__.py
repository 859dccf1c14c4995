"""Build (or find) the token shards of a text corpus and print what they hold.

    python -m linattn.data.text --out data/text                                   # the stdlib, bytes
    python -m linattn.data.text --out data/text --tokenizer bpe --vocab-size 4096
    python -m linattn.data.text --root /usr/share/doc/python3.11/html/_sources --include '*.rst.txt' --out data/text

Prints one JSON object: the shard folder, the tokenizer, per split the files, documents, tokens and bytes, and
the unigram entropy of the train split in bits per byte. A run config of kind ``lm`` with the same corpus,
tokenizer and ``cache_dir`` reuses the folder.
"""

from __future__ import annotations

import argparse
import json

from linattn.data.text.corpus import SPLITS, make_corpus
from linattn.data.text.score import unigram_entropy_bpb
from linattn.data.text.shards import build_shards
from linattn.data.text.tokenizer import TOKENIZERS


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, build the shards, print and return their summary."""
    p = argparse.ArgumentParser(prog="python -m linattn.data.text", description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None, help="corpus folder (default: the running Python's standard library)")
    p.add_argument("--include", action="append", default=None, help="file name pattern (repeatable; default *.txt, "
                   "or *.py for the standard library)")
    p.add_argument("--exclude", action="append", default=None,
                   help="folder/file name pattern to leave out (repeatable)")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--test-fraction", type=float, default=0.05)
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="bytes")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size")
    p.add_argument("--out", required=True, help="cache folder: the shards go to OUT/<key>/")
    a = p.parse_args(argv)
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
