"""Tokenizers of text corpora: UTF-8 bytes (always available) and byte-level BPE (the ``text`` extra).

Both map a str to ids and back exactly, and give ``token_bytes``: the number of UTF-8 bytes each id stands
for, so the bytes of any run of tokens (the denominator of bits per byte) is a table lookup.

- ``bytes``: ids 0-255 are the UTF-8 bytes of the text (vocabulary 256).
- ``bpe``: byte-level BPE of the ``tokenizers`` library trained on the training split (``vocab_size``
  ids, the 256 byte symbols always among them, no special tokens), saved as ``tokenizer.json``. Every
  token is a sequence of whole bytes, so decoding the ids of a text gives the text back.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from linattn.errors import ConfigError, UserError

TOKENIZERS = ("bytes", "bpe")


class MissingDependencyError(UserError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that provides it."""


class Tokenizer(Protocol):
    name: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_bytes(self) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as ids."""

    name = "bytes"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """The ids as a uint8 array, without a Python list in between."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)


def _tokenizers():
    try:
        import tokenizers
    except ImportError as exc:
        raise MissingDependencyError("the BPE tokenizer needs the `tokenizers` library: pip install "
                                     "'linattn[text]' (or use tokenizer: bytes)") from exc
    return tokenizers


class BPETokenizer:
    """Byte-level BPE around a ``tokenizers.Tokenizer``; build with :meth:`train` or :meth:`load`."""

    name = "bpe"

    def __init__(self, tok: object) -> None:
        self.tok = tok
        self._bytes = self._token_bytes()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Byte-level BPE of ``vocab_size`` ids (>= 256: the byte symbols) trained on ``texts``."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 256 < vocab_size <= 2**20:
            raise ConfigError(f"expected an int in (256, 2**20], got {vocab_size!r}", field="vocab_size")
        tk = _tokenizers()
        tok = tk.Tokenizer(tk.models.BPE())
        # byte-level: every text is bytes first, so nothing is unknown and decoding is exact
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                         special_tokens=[], show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        tk = _tokenizers()
        return cls(tk.Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def _token_bytes(self) -> np.ndarray:
        # a byte-level token is written in the 256-symbol byte alphabet: one character per byte
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self.tok.get_vocab().items():
            out[i] = len(token)
        return out

    def token_bytes(self) -> np.ndarray:
        return self._bytes.copy()
