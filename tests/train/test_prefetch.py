"""Prefetching the next batch on a thread: the same batches in the same order, errors where they belong,
and the same training numbers as without it."""

from __future__ import annotations

import threading

import pytest
import torch
from test_trainer import ShiftSum, TinyLM

from linattn.train import TrainConfig, Trainer, read_metrics
from linattn.train.prefetch import Prefetcher

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorded(ShiftSum):
    """ShiftSum noting which thread built each batch; batch ``bad`` raises."""

    def __init__(self, bad: int = -1) -> None:
        super().__init__()
        self.bad, self.threads = bad, []

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        self.threads.append(threading.current_thread().name)
        if index == self.bad:
            raise KeyError(f"no batch {index}")
        return super().batch(index, rank, world)


def test_prefetcher_gives_the_source_batches_and_restarts_after_a_jump():
    source, plain = Recorded(), ShiftSum()
    prefetch = Prefetcher(source, rank=1, world=2)
    try:
        for index in (0, 1, 2, 7, 8, 3):  # 7 and 3: jumps, as a resume makes
            x, y = prefetch.get(index)
            want_x, want_y = plain.batch(index, 1, 2)
            assert torch.equal(x, want_x) and torch.equal(y, want_y), index
    finally:
        prefetch.close()
    assert all(name.startswith("linattn-prefetch") for name in source.threads), "built on the thread"


def test_prefetcher_raises_the_error_of_the_batch_asked_for():
    prefetch = Prefetcher(Recorded(bad=2), rank=0, world=1)
    try:
        prefetch.get(0)
        prefetch.get(1)  # batch 2 fails in the background: not this call's business
        with pytest.raises(KeyError, match="no batch 2"):
            prefetch.get(2)
    finally:
        prefetch.close()


def test_training_with_prefetch_gives_the_same_numbers(tmp_path):
    def run(out, prefetch: bool, deadline=None):
        torch.manual_seed(0)
        data = ShiftSum()
        cfg = TrainConfig(max_steps=12, batch_size=16, lr=3e-3, warmup_steps=3, eval_every=6, log_every=2,
                          progress=False, device="cpu", seed=0, prefetch=prefetch)
        return Trainer(TinyLM(), data, cfg, eval_data=data.make(32, torch.Generator().manual_seed(9)),
                       out_dir=out).fit(deadline)

    plain = run(tmp_path / "plain", False)
    assert run(tmp_path / "prefetched", True).metrics == plain.metrics
    assert run(tmp_path / "resumed", True, deadline=0.0).status == "interrupted"  # stops after step 1
    assert run(tmp_path / "resumed", False).metrics == plain.metrics, "prefetch is free to change on resume"
    for name in ("prefetched", "resumed"):
        got, want = read_metrics(tmp_path / name), read_metrics(tmp_path / "plain")
        assert [(r["step"], r["loss"]) for r in got] == [(r["step"], r["loss"]) for r in want]
