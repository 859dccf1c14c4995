from __future__ import annotations

import sys

import numpy as np
import pytest

from linattn.data.text import BPETokenizer, ByteTokenizer, MissingDependencyError

SAMPLE = "def naïve(x):\n    return x ** 2  # ✓ — 漢字\n\ttabs\r\n"


def test_bytes_round_trip_and_byte_counts():
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert len(ids) == len(SAMPLE.encode("utf-8"))
    assert tok.token_bytes()[ids].sum() == len(SAMPLE.encode("utf-8"))
    assert np.array_equal(tok.encode_array(SAMPLE), np.array(ids, dtype=np.uint8))


def test_bpe_round_trip_and_byte_counts(tmp_path):
    pytest.importorskip("tokenizers")
    texts = ["def f(x):\n    return x + 1\n" * 30, "class A:\n    pass\n" * 30, "hello world " * 40]
    tok = BPETokenizer.train(texts, 300)
    assert 256 < tok.vocab_size <= 300  # fewer when the texts run out of pairs to merge
    for text in [SAMPLE, *texts]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.token_bytes()[ids].sum() == len(text.encode("utf-8"))
    assert len(tok.encode(texts[0])) < len(texts[0])  # merges were learned
    tok.save(tmp_path / "tokenizer.json")
    again = BPETokenizer.load(tmp_path / "tokenizer.json")
    assert again.encode(SAMPLE) == tok.encode(SAMPLE)


def test_missing_tokenizers_names_the_extra(monkeypatch):
    # a None entry in sys.modules makes `import tokenizers` raise ImportError, as when it is not installed
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'linattn\[text\]'"):
        BPETokenizer.train(["abc"], 300)
    assert ByteTokenizer().decode(ByteTokenizer().encode("still works")) == "still works"
