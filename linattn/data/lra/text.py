"""Text (IMDB sentiment, byte level) and Retrieval (AAN citation pairs, byte level) loaders.

Text reads the raw IMDB release ``<data_dir>/aclImdb/{train,test}/{pos,neg}/*.txt`` (label 1 = pos),
files in sorted order; LRA evaluates on the test split, so ``val`` and ``test`` both read ``test``.
Each review is its UTF-8 bytes, cut at 4096.

Retrieval reads ``<data_dir>/tsv_data/new_aan_pairs.{train,eval,test}.tsv`` (val = eval), rows
``label, id1, id2, text1, text2`` without header; texts may be Python bytes literals (``b'...'``) as in
the release. Each document is its bytes, cut at 4000; an item holds both (dual encoder).
"""

from __future__ import annotations

import ast
import csv
import sys
from pathlib import Path

import numpy as np

from linattn.data.base import check_int
from linattn.errors import DataError, MissingFileError
from linattn.validation import is_number

from .dataset import LRADataset
from .files import RELEASE, check_not_empty, check_split, parse_label, require
from .vocab import BYTE_VOCAB

TEXT_MAX_LEN = 4096
RETRIEVAL_MAX_LEN = 4000
RETRIEVAL_SPLIT_FILES = {"train": "train", "val": "eval", "test": "test"}
NUM_CLASSES = 2  # both tasks: neg/pos, no citation/citation


def encode_bytes(data: bytes, max_len: int) -> np.ndarray:
    """The first ``max_len`` bytes of ``data`` as byte-vocabulary ids."""
    return BYTE_VOCAB.encode_values(np.frombuffer(data[:max_len], dtype=np.uint8))


def load_text(data_dir: str | Path, split: str = "train", max_len: int = TEXT_MAX_LEN) -> LRADataset:
    """IMDB reviews at byte level; 2 classes (neg 0, pos 1)."""
    split = check_split(split)
    check_int("max_len", max_len, 1)
    folder = Path(data_dir) / "aclImdb" / ("train" if split == "train" else "test")
    dirs = [folder / "neg", folder / "pos"]
    require("text", dirs, f"Unpack the IMDB release aclImdb_v1.tar.gz (https://ai.stanford.edu/~amaas/data/"
            f"sentiment/) so that {Path(data_dir) / 'aclImdb'}/{{train,test}}/{{pos,neg}}/*.txt exist.")
    seqs, labels = [], []
    for label, d in enumerate(dirs):
        for path in sorted(d.glob("*.txt")):
            seqs.append(encode_bytes(path.read_bytes(), max_len))
            labels.append(label)
    if not seqs:
        raise MissingFileError(f"LRA task 'text': no *.txt reviews in {dirs[0]} or {dirs[1]}")
    return LRADataset("text", split, BYTE_VOCAB, NUM_CLASSES, labels, seqs=seqs)


def _document(field: str) -> bytes:
    """A release text field: a Python bytes literal ``b'...'`` or plain text."""
    if len(field) >= 3 and field[0] == "b" and field[1] in "'\"" and field[-1] == field[1]:
        value = ast.literal_eval(field)
        if isinstance(value, bytes):
            return value
    return field.encode("utf-8")


def load_retrieval(data_dir: str | Path, split: str = "train", max_len: int = RETRIEVAL_MAX_LEN) -> LRADataset:
    """AAN document pairs at byte level (``input_ids``, ``input_ids2``); 2 classes (1 = cites). DataError
    naming the file and line for a malformed row or a label other than 0/1, or a file without pairs."""
    split = check_split(split)
    check_int("max_len", max_len, 1)
    path = Path(data_dir) / "tsv_data" / f"new_aan_pairs.{RETRIEVAL_SPLIT_FILES[split]}.tsv"
    require("retrieval", [path], f"Put the release's tsv_data/new_aan_pairs.{{train,eval,test}}.tsv under "
            f"{data_dir} (from {RELEASE}).")
    seqs, seqs2, labels = [], [], []
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, newline="", encoding="utf-8") as f:
        for n, row in enumerate(csv.reader(f, delimiter="\t"), start=1):
            if len(row) != 5:
                raise DataError(f"{path}, line {n}: expected 5 tab-separated fields "
                                f"(label, id1, id2, text1, text2), got {len(row)}")
            if n == 1 and not is_number(row[0]):  # a header row
                continue
            labels.append(parse_label(row[0], NUM_CLASSES, f"{path}, line {n}"))
            seqs.append(encode_bytes(_document(row[3]), max_len))
            seqs2.append(encode_bytes(_document(row[4]), max_len))
    check_not_empty(len(labels), path, "document pairs (the file is empty or a header alone)")
    return LRADataset("retrieval", split, BYTE_VOCAB, NUM_CLASSES, labels, seqs=seqs, seqs2=seqs2)

