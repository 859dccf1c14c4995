"""Token shards: a corpus tokenized once into memory-mapped numpy files, reused by every run that asks again.

A shard folder ``<cache_root>/<key>/`` (``key``: a hash of the corpus fingerprint, the tokenizer and its
settings, and :data:`FORMAT`) holds::

    meta.json                 corpus settings (of each source, for a corpus of several), tokenizer, per split:
                              files, documents, tokens, bytes
    tokenizer.json            the BPE tokenizer (trained on the train split; bpe only)
    token_bytes.npy           int64 [vocab]: UTF-8 bytes per id
    <split>.tokens.npy        uint16 (vocabulary <= 65536) or uint32 [N]: the split's documents back to back
    <split>.offsets.npy       int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]]

Documents are packed with no separator token (so every token stands for bytes of the text); the offsets keep
their boundaries for models that reset their state there. A folder is built in a temporary folder and
renamed into place, under a lock file, so parallel runs build it once and never see it half written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from linattn.data.text.corpus import SPLITS, MultiCorpus, TextCorpus
from linattn.data.text.tokenizer import TOKENIZERS, BPETokenizer, ByteTokenizer, Tokenizer
from linattn.errors import ConfigError, DataError

FORMAT = 1
META = "meta.json"


def make_tokenizer(name: str, corpus: TextCorpus | MultiCorpus, vocab_size: int | None = None) -> Tokenizer:
    """``bytes``, or BPE of ``vocab_size`` ids trained on the corpus's train split."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "bpe":
        if vocab_size is None:
            raise ConfigError("tokenizer 'bpe' needs a vocab_size", field="vocab_size")
        return BPETokenizer.train((text for _, text in corpus.documents("train")), vocab_size)
    raise ConfigError(f"expected one of {list(TOKENIZERS)}, got {name!r}", field="tokenizer")


def shard_key(corpus: TextCorpus | MultiCorpus, tokenizer: str, vocab_size: int | None) -> str:
    settings = {"corpus": corpus.fingerprint(), "tokenizer": tokenizer,
                "vocab_size": vocab_size if tokenizer == "bpe" else 256, "format": FORMAT}
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _encode(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    if isinstance(tok, ByteTokenizer):
        return [tok.encode_array(t) for t in texts]
    return [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(texts)]


def write_shards(folder: Path, corpus: TextCorpus | MultiCorpus, tokenizer: str, vocab_size: int | None) -> None:
    """Tokenize every split of ``corpus`` into ``folder`` (which must exist and be empty)."""
    tok = make_tokenizer(tokenizer, corpus, vocab_size)
    if isinstance(tok, BPETokenizer):
        tok.save(folder / "tokenizer.json")
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    table = tok.token_bytes()
    np.save(folder / "token_bytes.npy", table)
    meta = {"format": FORMAT, **corpus.describe(), "tokenizer": tokenizer,
            "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name, "splits": {}}
    for split in SPLITS:
        docs = list(corpus.documents(split))
        if not docs:
            raise DataError(f"corpus {corpus.root}: split {split!r} has no non-empty file; add files or raise "
                            f"its fraction")
        ids = _encode(tok, [text for _, text in docs])
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(a) for a in ids])
        tokens = np.concatenate(ids).astype(dtype)
        np.save(folder / f"{split}.tokens.npy", tokens)
        np.save(folder / f"{split}.offsets.npy", offsets)
        n_bytes = sum(len(text.encode("utf-8")) for _, text in docs)
        meta["splits"][split] = {"files": [rel for rel, _ in docs], "documents": len(docs), "tokens": int(offsets[-1]),
                                 "bytes": int(n_bytes)}
    (folder / META).write_text(json.dumps(meta, indent=1))


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (a no-op where fcntl is missing: building twice is only wasted work)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass
class TokenShards:
    """The shard folder of one corpus and tokenizer: memory-mapped tokens and document offsets per split."""

    folder: Path
    meta: dict

    @classmethod
    def open(cls, folder: str | Path) -> TokenShards:
        folder = Path(folder)
        if not (folder / META).is_file():
            raise DataError(f"{folder} is not a token shard folder (no {META})")
        return cls(folder, json.loads((folder / META).read_text()))

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens, memory-mapped (read only)."""
        return np.load(self.folder / f"{split}.tokens.npy", mmap_mode="r")

    def offsets(self, split: str) -> np.ndarray:
        return np.load(self.folder / f"{split}.offsets.npy")

    def token_bytes(self) -> np.ndarray:
        return np.load(self.folder / "token_bytes.npy")

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def num_bytes(self, split: str) -> int:
        return int(self.meta["splits"][split]["bytes"])

    def tokenizer(self) -> Tokenizer:
        if self.meta["tokenizer"] == "bytes":
            return ByteTokenizer()
        return BPETokenizer.load(self.folder / "tokenizer.json")


def build_shards(corpus: TextCorpus | MultiCorpus, cache_root: str | Path, tokenizer: str = "bytes",
                 vocab_size: int | None = None) -> TokenShards:
    """The shards of ``corpus`` under ``tokenizer``: read from ``cache_root/<key>`` when built before,
    otherwise built there once (atomically, one builder at a time)."""
    if tokenizer not in TOKENIZERS:
        raise ConfigError(f"expected one of {list(TOKENIZERS)}, got {tokenizer!r}", field="tokenizer")
    root = Path(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / shard_key(corpus, tokenizer, vocab_size)
    with _lock(root / ".lock"):
        if not (target / META).is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".shards-", dir=root))
            try:
                write_shards(tmp, corpus, tokenizer, vocab_size)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return TokenShards.open(target)
