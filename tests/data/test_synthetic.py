"""Invariants of the synthetic task generators (linattn.data)."""

from __future__ import annotations

import pytest
import torch

from linattn.data import (
    IGNORE_INDEX,
    InContextNGram,
    InductionHeads,
    LongRangeCopy,
    MultiQueryAR,
    Parity,
    S5Composition,
    SelectiveCopy,
    StackedAR,
    TaskStream,
    eval_set,
    list_tasks,
    make_task,
)
from linattn.data.state_tracking import s5_tables


def _mqar_pairs(task, x):
    n = task.num_kv_pairs
    if isinstance(task, StackedAR):
        tok = x[:n] - task.vocab
        keys = tok // task.num_values + 1
        values = tok % task.num_values + task.vocab // 2
        return keys, values
    return x[:2 * n:2], x[1:2 * n:2]


@pytest.mark.parametrize("cls", [MultiQueryAR, StackedAR])
@pytest.mark.parametrize("random_non_queries", [True, False])
def test_recall_invariants(cls, random_non_queries):
    task = cls(vocab=32, seq_len=64, num_kv_pairs=6, power_a=0.1, random_non_queries=random_non_queries)
    x, y = task.sample(50, seed=3)
    assert x.shape == y.shape == (50, 64) and x.dtype == y.dtype == torch.long
    assert 0 <= int(x.min()) and int(x.max()) < task.vocab_size
    half = task.vocab // 2
    for xi, yi in zip(x, y):
        keys, values = _mqar_pairs(task, xi)
        assert len(set(keys.tolist())) == task.num_kv_pairs, "keys unique per sequence"
        assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < task.vocab)).all()
        lookup = dict(zip(keys.tolist(), values.tolist()))
        pos = (yi != IGNORE_INDEX).nonzero().flatten()
        assert len(pos) == task.num_kv_pairs, "each key queried exactly once"
        assert (pos >= task.context_len).all(), "labels only after the context"
        queried = xi[pos].tolist()
        assert sorted(queried) == sorted(lookup), "the labelled positions hold the context keys"
        for p in pos.tolist():
            assert int(yi[p]) == lookup[int(xi[p])], "label = the value bound to the queried key"
            assert int(xi[p + 1]) == int(yi[p]), "the value follows its query in the input"
        if not random_non_queries:
            rest = torch.ones(task.seq_len, dtype=torch.bool)
            rest[:task.context_len] = False
            rest[pos] = False
            rest[pos + 1] = False
            assert (xi[rest] == 0).all()


def test_recall_gaps_follow_power_law():
    x, y = MultiQueryAR(vocab=64, seq_len=256, num_kv_pairs=4, power_a=0.01).sample(400, seed=0)
    slot = ((y != IGNORE_INDEX).nonzero()[:, 1] - 8) // 2
    near, far = (slot < 10).float().mean(), (slot >= 100).float().mean()
    assert near > 3 * far, "short gaps must be much more likely than long ones"


def test_stacked_pairs_are_single_tokens():
    task = StackedAR(vocab=16, seq_len=32, num_kv_pairs=4)
    assert task.vocab_size == 16 + 7 * 8
    x, _ = task.sample(20, seed=1)
    assert (x[:, :4] >= 16).all() and (x[:, 4:] < 16).all()


@pytest.mark.parametrize("name", list_tasks())
def test_deterministic_per_seed(name):
    task = make_task(name)
    a, b, c = task.sample(8, seed=5), task.sample(8, seed=5), task.sample(8, seed=6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert a[0].shape == (8, task.seq_len) and int(a[0].max()) < task.vocab_size
    assert int(a[1].max()) < task.vocab_size and ((a[1] >= 0) | (a[1] == IGNORE_INDEX)).all()


def test_stream_batches_are_random_access_and_split_by_rank():
    stream = TaskStream(make_task("mqar", vocab=32, seq_len=32, num_kv_pairs=4), batch_size=8, seed=1)
    x3, y3 = stream.batch(3)
    assert torch.equal(stream.batch(3)[0], x3) and not torch.equal(stream.batch(4)[0], x3)
    halves = [stream.batch(3, rank=r, world=2) for r in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]).sort(0).values, x3.sort(0).values)
    assert torch.equal(halves[1][1], y3[1::2])
    ex, _ = eval_set(stream.task, 8, seed=1)
    assert not torch.equal(ex, x3) and not torch.equal(ex, stream.batch(0)[0])
    with pytest.raises(ValueError, match="divisible"):
        stream.batch(0, rank=0, world=3)


def test_copy_tasks():
    x, y = SelectiveCopy(vocab=10, seq_len=20, num_tokens=4).sample(30, seed=0)
    for xi, yi in zip(x, y):
        data = xi[:16][xi[:16] >= 2]
        assert torch.equal(yi[16:], data) and (xi[16:] == 1).all() and (yi[:16] == IGNORE_INDEX).all()
    task = LongRangeCopy(vocab=10, num_tokens=3, gap=5)
    x, y = task.sample(4, seed=0)
    assert task.seq_len == 11 and torch.equal(y[:, -3:], x[:, :3]) and (x[:, 3:8] == 0).all()
    x, y = InductionHeads(vocab=8, seq_len=16).sample(30, seed=0)
    for xi, yi in zip(x, y):
        first = int((xi == 7).nonzero()[0])
        assert (xi == 7).sum() == 2 and int(yi[-1]) == int(xi[first + 1]) and (yi[:-1] == IGNORE_INDEX).all()


def test_ngram_follows_its_table():
    x, y = InContextNGram(vocab=6, seq_len=40, n=3, branching=1).sample(10, seed=0)
    assert torch.equal(y[:, 1:-1], x[:, 2:]) and (y[:, -1] == IGNORE_INDEX).all()
    for xi in x.tolist():
        seen = {}
        for t in range(2, len(xi)):
            ctx = (xi[t - 2], xi[t - 1])
            assert seen.setdefault(ctx, xi[t]) == xi[t], "branching=1: a context always has one successor"


def test_state_tracking_targets():
    x, y = Parity(seq_len=12).sample(5, seed=0)
    for xi, yi in zip(x.tolist(), y.tolist()):
        acc = 0
        for a, b in zip(xi, yi):
            acc ^= a
            assert b == acc
    perms, _ = s5_tables()
    x, y = S5Composition(seq_len=6).sample(4, seed=0)
    for xi, yi in zip(x, y):
        state = torch.arange(5)
        for a, b in zip(xi, yi):
            state = perms[a][state]
            assert torch.equal(perms[b], state)


@pytest.mark.parametrize("name, params, exc, match", [
    ("mqar", {"num_kv_pairs": 40}, ValueError, "num_kv_pairs"),
    ("mqar", {"seq_len": 20, "num_kv_pairs": 8}, ValueError, "seq_len"),
    ("mqar", {"vocab": 32.0}, TypeError, "vocab"),
    ("mqar", {"power_a": 2.0}, ValueError, "power_a"),
    ("mqar", {"bogus": 1}, ValueError, "bogus"),
    ("nope", {}, ValueError, "task must be one of"),
    ("selective_copy", {"seq_len": 10, "num_tokens": 8}, ValueError, "seq_len"),
    ("ngram", {"vocab": 64, "n": 5}, ValueError, "contexts"),
])
def test_bad_parameters(name, params, exc, match):
    with pytest.raises(exc, match=match):
        make_task(name, **params)
