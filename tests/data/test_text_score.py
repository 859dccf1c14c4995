from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from linattn.data.text import bits_per_byte, eval_windows, mean_loss_to_bpb, unigram_entropy_bpb
from linattn.data.text.windows import TokenWindows
from linattn.errors import DataError


def test_bits_per_byte_hand_checked():
    # 4 tokens each given probability 1/2 (ln 2 nats each) standing for 8 bytes: 4 bits / 8 bytes
    assert bits_per_byte(4 * math.log(2), 8) == pytest.approx(0.5)
    assert mean_loss_to_bpb(math.log(2), 4, 8) == pytest.approx(0.5)
    # uniform over 256 bytes, one byte per token: 8 bits per byte
    assert mean_loss_to_bpb(math.log(256), 100, 100) == pytest.approx(8.0)
    with pytest.raises(DataError):
        bits_per_byte(1.0, 0)


def test_unigram_entropy_hand_checked():
    # tokens 0 (1 byte) and 1 (3 bytes), each half of the time: 1 bit per token, 2 bytes per token
    tokens = np.array([0, 1, 0, 1])
    assert unigram_entropy_bpb(tokens, np.array([1, 3, 2])) == pytest.approx(0.5)
    assert unigram_entropy_bpb(np.array([5, 5, 5]), np.ones(8, dtype=np.int64)) == pytest.approx(0.0)


def test_eval_windows_disjoint_and_bytes_counted():
    tokens = np.arange(100, dtype=np.uint16)
    table = np.arange(100, dtype=np.int64) % 3
    ev = eval_windows(tokens, table, seq_len=10, max_windows=4)
    assert ev.inputs.shape == (4, 10) and torch.equal(ev.targets, ev.inputs + 1)
    assert len(set(ev.targets.flatten().tolist())) == 40  # no target counted twice
    assert ev.num_bytes == int(table[ev.targets.numpy()].sum()) and ev.num_tokens == 40
    with pytest.raises(DataError):
        eval_windows(tokens[:5], table, seq_len=10, max_windows=1)


def test_training_windows_deterministic_and_shifted():
    tokens = np.arange(1000, dtype=np.uint16)
    stream = TokenWindows(tokens, seq_len=16, batch_size=4, seed=3)
    x, y = stream.batch(7)
    assert torch.equal(y, x + 1) and x.shape == (4, 16)
    assert torch.equal(stream.batch(7)[0], x) and not torch.equal(stream.batch(8)[0], x)
    x0, _ = stream.batch(7, rank=1, world=2)
    assert torch.equal(x0, x[1::2])
