"""ListOps loader: ``<data_dir>/listops-1000/basic_{train,val,test}.tsv`` (LRA release layout).

Each row is ``Source<TAB>Target`` after a header. Tokens are split on whitespace; the parentheses are
dropped (as LRA's tokenizer does), ``]`` is a token. Sequences longer than ``max_len`` (2000) are cut.
"""

from __future__ import annotations

import csv
from pathlib import Path

from linattn.data.base import check_int
from linattn.errors import DataError

from .dataset import LRADataset
from .files import RELEASE, check_not_empty, check_split, parse_label, require
from .listops_gen import RELEASE_DIR
from .vocab import LISTOPS_VOCAB

MAX_LEN = 2000
NUM_CLASSES = 10


def listops_tokens(source: str) -> list[str]:
    """The tokens of a source string: whitespace-split (brackets padded), parentheses dropped."""
    # a parenthesis becomes a space: the same as padding it and dropping its token, without a pass over the tokens
    return source.replace("(", " ").replace(")", " ").replace("]", " ] ").split()


def load_listops(data_dir: str | Path, split: str = "train", max_len: int = MAX_LEN) -> LRADataset:
    """The ListOps ``split`` (train / val / test); 10 classes (the value 0-9 of the tree). DataError naming
    the file and line for a malformed row or a label outside 0-9, or a file without examples."""
    split = check_split(split)
    check_int("max_len", max_len, 1)
    path = Path(data_dir) / RELEASE_DIR / f"basic_{split}.tsv"
    require("listops", [path], f"Put the release's {RELEASE_DIR}/basic_{{train,val,test}}.tsv under {data_dir} "
            f"(from {RELEASE}) or generate them: linattn.data.lra.write_listops({str(data_dir)!r}).")
    seqs, labels = [], []
    with open(path, newline="") as f:
        rows = csv.reader(f, delimiter="\t")
        header = next(rows, None)
        if header != ["Source", "Target"]:
            raise DataError(f"{path}: the first row must be the header Source<TAB>Target, got {header}")
        for n, row in enumerate(rows, start=2):
            if len(row) != 2:
                raise DataError(f"{path}, line {n}: expected 2 tab-separated fields, got {len(row)}")
            labels.append(parse_label(row[1], NUM_CLASSES, f"{path}, line {n}"))
            seqs.append(LISTOPS_VOCAB.encode(listops_tokens(row[0])[:max_len]))
    check_not_empty(len(labels), path, "examples after the header")
    return LRADataset("listops", split, LISTOPS_VOCAB, NUM_CLASSES, labels, seqs=seqs)
