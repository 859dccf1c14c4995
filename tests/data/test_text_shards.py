from __future__ import annotations

import numpy as np
import pytest
from text_fixtures import write_corpus

from linattn.data.text import SPLITS, ByteTokenizer, TextCorpus, build_shards


def _corpus(tmp_path):
    return TextCorpus(str(write_corpus(tmp_path / "corpus")), ("*.txt",), ("skip",), 0.2, 0.2)


@pytest.mark.parametrize("tokenizer,vocab", [("bytes", None), ("bpe", 300)])
def test_shards_exact_and_reused(tmp_path, tokenizer, vocab):
    if tokenizer == "bpe":
        pytest.importorskip("tokenizers")
    corpus = _corpus(tmp_path)
    shards = build_shards(corpus, tmp_path / "cache", tokenizer, vocab)
    tok = shards.tokenizer()
    for split in SPLITS:
        tokens, offsets = shards.tokens(split), shards.offsets(split)
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
        docs = list(corpus.documents(split))
        assert len(offsets) == len(docs) + 1 and offsets[-1] == len(tokens)
        for d, (_, text) in enumerate(docs):
            ids = tokens[offsets[d]:offsets[d + 1]]
            assert ids.tolist() == tok.encode(text)
            assert tok.decode(ids.tolist()) == text
        assert shards.num_bytes(split) == sum(len(t.encode()) for _, t in docs)
        assert shards.token_bytes()[np.asarray(tokens)].sum() == shards.num_bytes(split)
    # built once: a second call opens the same folder without rewriting it
    stamp = (shards.folder / "train.tokens.npy").stat().st_mtime_ns
    again = build_shards(_corpus(tmp_path), tmp_path / "cache", tokenizer, vocab)
    assert again.folder == shards.folder and (again.folder / "train.tokens.npy").stat().st_mtime_ns == stamp
    if tokenizer == "bpe":
        assert (shards.folder / "tokenizer.json").is_file()
    else:
        assert isinstance(tok, ByteTokenizer)


def test_cache_key_changes_with_the_text(tmp_path):
    corpus = _corpus(tmp_path)
    first = build_shards(corpus, tmp_path / "cache")
    (tmp_path / "corpus" / "a.txt").write_text("different text\n")
    second = build_shards(TextCorpus(corpus.root, corpus.include, corpus.exclude, 0.2, 0.2), tmp_path / "cache")
    assert first.folder != second.folder
