"""Training batches of whole documents packed with cu_seqlens (linattn.data.packed): exact (every token an input
once per epoch, offsets at the document boundaries, targets the next token of the same document), a pure function
of (seed, index) split over ranks, and the loss of a packed batch is the sum of the per-document losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linattn.data.packed import IGNORE_INDEX, PackedDocuments, PackedInputs
from linattn.models import CausalLM, ModelConfig
from linattn.train.metrics import token_stats

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [7, 1, 0, 30, 12, 3, 50, 9, 4, 12]  # one longer than a batch (32 tokens), one empty


def _stream(seed: int = 0, batch_size: int = 4, seq_len: int = 8) -> PackedDocuments:
    offsets = np.concatenate([[0], np.cumsum(LENGTHS)])
    tokens = np.arange(offsets[-1], dtype=np.int64)  # a token's id is its position: batches show where they read
    return PackedDocuments(tokens, offsets, seq_len, batch_size, seed)


def _document_of(position: int) -> int:
    return int(np.searchsorted(np.cumsum(LENGTHS), position, side="right"))


def test_every_token_once_per_epoch_at_the_document_boundaries() -> None:
    stream = _stream()
    total, n = sum(LENGTHS), 32
    ends = set(np.cumsum(LENGTHS).tolist())
    starts = set(np.concatenate([[0], np.cumsum(LENGTHS)[:-1]]).tolist())
    seen = []
    for index in range(2 * total // n + 2):  # past two epochs (the last batch of an epoch runs into the next)
        x, y = stream.batch(index)
        assert isinstance(x, PackedInputs) and x.input_ids.shape == (1, n) and y.shape == (1, n)
        ids, cu, y = x.input_ids[0].tolist(), x.cu_seqlens.tolist(), y[0].tolist()
        assert x.cu_seqlens.dtype == torch.int32 and cu[0] == 0 and cu[-1] == n
        assert all(a < b for a, b in zip(cu[:-1], cu[1:]))
        for s, e in zip(cu[:-1], cu[1:]):
            piece = ids[s:e]
            # one run of consecutive tokens of one document, starting at its start or at the batch's start, ending
            # at its end or at the batch's end
            assert piece == list(range(piece[0], piece[0] + len(piece)))
            assert len({_document_of(p) for p in piece}) == 1
            assert piece[0] in starts or s == 0
            assert piece[-1] + 1 in ends or e == n
            for i, p in enumerate(piece):
                closes = p + 1 in ends
                assert y[s + i] == (IGNORE_INDEX if closes else p + 1)
        seen += ids
    for epoch in range(2):
        assert sorted(seen[epoch * total:(epoch + 1) * total]) == list(range(total))
    assert seen[:total] != seen[total:2 * total]  # each epoch its own order


def test_batches_are_pure_and_split_over_ranks() -> None:
    a, b = _stream(seed=3), _stream(seed=3)
    for index in (5, 0, 9):
        x, y = a.batch(index)
        x2, y2 = b.batch(index)
        assert torch.equal(x.input_ids, x2.input_ids) and torch.equal(x.cu_seqlens, x2.cu_seqlens)
        assert torch.equal(y, y2)
        parts = [a.batch(index, rank, 2) for rank in range(2)]
        assert torch.equal(torch.cat([p[0].input_ids for p in parts], dim=1), x.input_ids)
        assert torch.equal(torch.cat([p[1] for p in parts], dim=1), y)
    assert not torch.equal(_stream(seed=4).batch(0)[0].input_ids, a.batch(0)[0].input_ids)
    with pytest.raises(ValueError, match="divisible by the world size 3"):
        a.batch(0, 0, 3)


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "gla"])
def test_packed_loss_is_the_sum_of_the_documents_losses(mixer: str) -> None:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(mixer=mixer, d_model=16, n_layers=2, n_heads=2, vocab_size=200)).eval()
    x, y = _stream(seed=1).batch(2)
    with torch.no_grad():
        logits, _ = model(x.input_ids, cu_seqlens=x.cu_seqlens)
        ce, count, _ = token_stats(logits, y)
        total, labelled = torch.zeros(()), 0
        cu = x.cu_seqlens.tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            piece_logits, _ = model(x.input_ids[:, s:e], use_cache=False)
            piece_ce, piece_count, _ = token_stats(piece_logits, y[:, s:e])
            total, labelled = total + piece_ce, labelled + int(piece_count)
    assert int(count) == labelled == int((y != IGNORE_INDEX).sum())
    torch.testing.assert_close(ce, total, rtol=1e-5, atol=1e-5)


def test_bad_offsets_are_refused() -> None:
    from linattn.errors import DataError

    with pytest.raises(DataError, match="document offsets must run from 0"):
        PackedDocuments(np.arange(10), np.array([0, 4, 9]), 4, 2)
