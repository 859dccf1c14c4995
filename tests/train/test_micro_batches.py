"""train.micro_batches (gradient accumulation): one step in 1, 2 or 3 micro-batches, even or uneven, gives the
one-batch gradient, weights and logged loss (the loss divided by the whole step's labelled targets, which the
ignored targets spread unevenly over the parts test), alone and in 2 DDP or FSDP processes, where DDP all-reduces
once a step; bad settings are named."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from linattn.data import IGNORE_INDEX
from linattn.data.packed import PackedInputs
from linattn.errors import ConfigError
from linattn.models import CausalLM, ModelConfig, SequenceClassifier
from linattn.models.padded import PaddedClassifier
from linattn.train import TrainConfig, Trainer, load_checkpoint, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, T, CLASSES = 11, 12, 3
TOL = dict(rtol=1e-5, atol=1e-6)


def _model_config() -> ModelConfig:
    return ModelConfig(mixer="gated_delta_rule", d_model=16, n_layers=1, n_heads=2, vocab_size=VOCAB)


def _lm() -> CausalLM:
    return CausalLM(_model_config())


def _classifier() -> PaddedClassifier:
    """A bidirectional Gated DeltaNet classifier on right-padded ids (pad 0), as the LRA runs train it."""
    return PaddedClassifier(SequenceClassifier(_model_config(), CLASSES, bidirectional=True), pad_id=0)


class FixedBatch:
    """The same batch at every index, rows r::world on rank r. Targets are ignored unevenly (LM: 0, 1, 12, 2, 6, 9
    labelled per row; classifier: none in the first two rows), so the parts of every split here, and the ranks, hold
    different counts (the classifier's first of three parts none)."""

    def __init__(self, kind: str, rows: int) -> None:
        gen = torch.Generator().manual_seed(rows)
        lengths = torch.randint(3, T + 1, (rows,), generator=gen)
        self.x = torch.randint(1, VOCAB, (rows, T), generator=gen)
        self.x[torch.arange(T)[None] >= lengths[:, None]] = 0  # right padding, read by the classifier only
        if kind == "lm":
            self.y = torch.randint(0, VOCAB, (rows, T), generator=gen)
            labelled = torch.arange(T)[None] < torch.tensor([0, 1, T, 2, T // 2, 9, 5][:rows])[:, None]
            self.y[~labelled] = IGNORE_INDEX
        else:
            self.y = torch.randint(0, CLASSES, (rows, 1), generator=gen)  # PaddedClassifier's logits: [B, 1, C]
            self.y[:2] = IGNORE_INDEX

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[rank::world], self.y[rank::world]


def _config(micro_batches: int, batch_size: int, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(max_steps=1, batch_size=batch_size, micro_batches=micro_batches, lr=1e-2,
                                 warmup_steps=0, log_every=1, grad_clip=0.0, progress=False, device="cpu"), **kw})


def _one_step(kind: str, rows: int, micro_batches: int, out_dir) -> tuple[dict, dict, dict]:
    """(weights, gradients, logged train record) after one step from the seed-0 initial weights."""
    torch.manual_seed(0)
    model = _lm() if kind == "lm" else _classifier()
    Trainer(model, FixedBatch(kind, rows), _config(micro_batches, rows), out_dir=out_dir).fit()
    record = next(r for r in read_metrics(out_dir) if r["split"] == "train")
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    # the trainer zeroes gradients at the start of a step: after the last one they are that step's
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return weights, grads, record


@pytest.mark.parametrize("rows", [6, 5])
@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_micro_batches_give_the_one_batch_step(kind, rows, tmp_path):
    ref_weights, ref_grads, ref = _one_step(kind, rows, 1, tmp_path / "1")
    for micro_batches in (2, 3):
        weights, grads, record = _one_step(kind, rows, micro_batches, tmp_path / str(micro_batches))
        # mappings: a failure names the parameter
        torch.testing.assert_close(grads, ref_grads, **TOL)
        torch.testing.assert_close(weights, ref_weights, **TOL)
        assert record["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert record["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


def test_a_batch_with_fewer_rows_than_micro_batches_is_refused_before_any_compute(tmp_path):
    torch.manual_seed(0)
    model = _lm()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(model, FixedBatch("lm", 2), _config(3, 2))
    with pytest.raises(ConfigError, match=r"train.micro_batches: this process's batch has 2 rows, fewer than the 3 "
                                          r"micro-batches"):
        trainer.fit()
    assert trainer.step == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_packed_batches_are_not_split(tmp_path):
    class Packed:
        def batch(self, index, rank=0, world=1):
            ids = torch.randint(0, VOCAB, (1, 10))
            return PackedInputs(ids, torch.tensor([0, 4, 10], dtype=torch.int32)), ids

    with pytest.raises(ConfigError, match=r"train.micro_batches: packed batches .* are not split into micro-batches"):
        Trainer(_lm(), Packed(), _config(2, 1)).fit()
    assert Trainer(_lm(), Packed(), _config(1, 1)).fit().status == "completed", "one part is the packed batch"


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_micro_batches_must_be_a_positive_int(value):
    with pytest.raises(ConfigError, match=r"micro_batches: expected an int >= 1, got"):
        TrainConfig(micro_batches=value)


def _two_process_worker(rank: int, world: int, init_file: str, out: str, parallel: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _train_two_process_rank(rank, out, parallel)
        gc.collect()  # and whatever a reference cycle kept, while the group lives
    finally:
        dist.destroy_process_group()


def _train_two_process_rank(rank: int, out: str, parallel: str) -> None:
    """One rank's run. A function of its own so that the trainer, whose DDP reducer holds the process group, is
    freed before the group is destroyed: freed after, the group's destructor joins gloo threads that wait for the
    GIL the freeing thread holds (a deadlock seen with torch 2.13)."""
    torch.manual_seed(0)
    trainer = Trainer(_lm(), FixedBatch("lm", 6), _config(3, 6, max_steps=2, parallel=parallel), out_dir=out)
    calls = []
    if parallel == "ddp":
        def counting_allreduce(state, bucket):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)

        trainer.ddp.register_comm_hook(None, counting_allreduce)
    trainer.fit()
    if rank == 0:
        torch.save(calls, f"{out}/allreduce_calls.pt")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_with_micro_batches_give_the_one_batch_steps(parallel, tmp_path):
    """Two gloo processes of 3 rows each, in 3 micro-batches of a row (the ranks' labelled counts differ): the
    single-process one-batch losses and weights; DDP all-reduces each gradient bucket once a step."""
    import torch.multiprocessing as mp

    mp.spawn(_two_process_worker, args=(2, str(tmp_path / "pg"), str(tmp_path / "two"), parallel), nprocs=2,
             join=True)
    torch.manual_seed(0)
    Trainer(_lm(), FixedBatch("lm", 6), _config(1, 6, max_steps=2), out_dir=tmp_path / "one").fit()
    if parallel == "ddp":
        calls = torch.load(tmp_path / "two" / "allreduce_calls.pt")
        buckets = len(set(calls))
        assert len(calls) == 2 * buckets, f"all-reduces {calls} for 2 steps of {buckets} bucket(s)"
    two, one = (load_checkpoint(tmp_path / name / "checkpoint.pt")["model"] for name in ("two", "one"))
    torch.testing.assert_close(two, one, **TOL)
    two, one = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2]
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)


def test_a_run_resumes_with_another_number_of_micro_batches():
    """The same gradient in more parts: a run that ran out of memory continues with more micro-batches."""
    from linattn.train.resume import resume_changes

    saved = {"config": TrainConfig().to_dict()}
    assert resume_changes(saved, TrainConfig(micro_batches=4).to_dict(), None) == []
