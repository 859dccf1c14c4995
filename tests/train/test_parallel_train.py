"""Multi-process training on the CPU (2 gloo processes): DDP and FSDP2 give the 1-process loss curve for the
same global batch, and a checkpoint resumes on another number of processes with the uninterrupted curve."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

import pytest
import torch
from test_trainer import VOCAB, ShiftSum, TinyLM
from torch import nn

from linattn.data import TaskStream, make_task
from linattn.data.lra import LRABatches
from linattn.errors import ConfigError
from linattn.models import CausalLM, ModelConfig
from linattn.train import TrainConfig, Trainer, load_checkpoint, read_metrics
from linattn.train.distributed import MULTICAST_OFF, keep_multicast_off, per_rank_batch
from linattn.train.fsdp import shard_units

pytestmark = pytest.mark.usefixtures("one_thread")

STOP_AT = 6  # the batch index at which an interrupted run dies (its last checkpoint is step CHECKPOINT_EVERY)
CHECKPOINT_EVERY = 4


class BlockLM(TinyLM):
    """TinyLM with a list of residual blocks, so FSDP shards each block and then the root."""

    def __init__(self) -> None:
        super().__init__(dropout=0.0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB))
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        h, _ = super().forward(x)
        for block in self.blocks:
            h = h + block(h)
        return h, None


class Crash(RuntimeError):
    """Stands in for a killed job: raised by every process at the same batch, before that step's collectives."""


class CrashingShiftSum(ShiftSum):
    """ShiftSum that crashes at batch ``stop_at`` and notes each batch index rank 0 reads in ``log``, so a
    test can tell a resumed run from one that started over."""

    def __init__(self, stop_at: int, log: Path) -> None:
        super().__init__()
        self.stop_at, self.log = stop_at, log

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if rank == 0:
            with open(self.log, "a") as f:
                f.write(f"{index}\n")
        if index == self.stop_at:
            raise Crash(f"batch {index}")
        return super().batch(index, rank, world)


def _train(out_dir: Path, parallel: str = "ddp", stop_at: int = -1, param_dtype: str = "auto") -> None:
    """12 steps of BlockLM; an eval set of 65 rows in batches of 32, so under 2 processes one rank has a
    batch more than the other (FSDP's collective forward must not hang on it)."""
    torch.manual_seed(0)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = CrashingShiftSum(stop_at, out_dir / "batches.txt")
    cfg = TrainConfig(max_steps=12, batch_size=16, lr=3e-3, warmup_steps=3, eval_every=6, log_every=1,
                      eval_batch_size=32, checkpoint_every=CHECKPOINT_EVERY, progress=False, device="cpu",
                      seed=0, parallel=parallel, fsdp_param_dtype=param_dtype)
    trainer = Trainer(BlockLM(), data, cfg, eval_data=data.make(65, torch.Generator().manual_seed(99)),
                      out_dir=out_dir)
    try:
        trainer.fit()
    except Crash:
        assert stop_at >= 0


def _worker(rank: int, world: int, init_file: str, jobs: list[tuple[str, str, int, str]]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a hang fails the test instead of stalling it
    try:
        for out_dir, parallel, stop_at, param_dtype in jobs:
            _train(Path(out_dir), parallel, stop_at, param_dtype)
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, name: str, jobs: list[tuple]) -> None:
    """Run ``jobs``, each ``(out_dir, parallel, stop_at[, fsdp_param_dtype])``, in turn in 2 gloo processes."""
    import torch.multiprocessing as mp

    jobs = [(str(job[0]), *job[1:], *(("auto",) if len(job) == 3 else ())) for job in jobs]
    mp.spawn(_worker, args=(2, str(tmp_path / f"pg_{name}"), jobs), nprocs=2, join=True)


def _assert_same_curve(run: Path, ref: Path) -> None:
    got, want = read_metrics(run), read_metrics(ref)
    assert [(r["split"], r["step"]) for r in got] == [(r["split"], r["step"]) for r in want], run.name
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (run.name, a, b)
        if a["split"] == "eval":
            assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-6), (run.name, a, b)


RESUMED = ("ddp_2to1", "ddp_2to2", "fsdp_2to1", "fsdp_2to2", "fsdp_1to2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every run of this module, with one start of 2 processes (starting them costs more than training):
    uninterrupted under 1 process, 2 with DDP and 2 with FSDP; and runs that crash after their step-4
    checkpoint and resume: saved under 2 processes resumed under 1 and 2 (DDP, FSDP), saved alone resumed
    under 2 (FSDP). Each 2to1 run's checkpoint is copied at the crash as ``saved.pt``."""
    root = tmp_path_factory.mktemp("parallel")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # set up before the function-scoped one_thread fixture; restored below
    _train(root / "one")
    _train(root / "fsdp_1to2", "fsdp", STOP_AT)
    jobs = [(root / "ddp", "ddp", -1), (root / "fsdp", "fsdp", -1), (root / "fsdp_bf16", "fsdp", -1, "bf16")]
    for parallel in ("ddp", "fsdp"):
        jobs += [(root / f"{parallel}_2to1", parallel, STOP_AT), (root / f"{parallel}_2to2", parallel, STOP_AT),
                 (root / f"{parallel}_2to2", parallel, -1)]
    _spawn(root, "all", jobs + [(root / "fsdp_1to2", "fsdp", -1)])
    for parallel in ("ddp", "fsdp"):
        out = root / f"{parallel}_2to1"
        shutil.copy(out / "checkpoint.pt", out / "saved.pt")
        _train(out, parallel)
    torch.set_num_threads(threads)
    return root


def test_two_processes_ddp_and_fsdp_match_one_process(runs):
    for name in ("ddp", "fsdp"):
        _assert_same_curve(runs / name, runs / "one")
        # throughput counts the global batch's input tokens (16 rows x 12) over the training steps' time
        assert all(r["tokens_per_s"] > 0 for r in read_metrics(runs / name) if r["split"] == "train")
    # the checkpoint is full, unsharded state whatever the strategy
    one, fsdp = (load_checkpoint(runs / name / "checkpoint.pt") for name in ("one", "fsdp"))
    assert fsdp["world"] == 2 and set(fsdp["model"]) == set(one["model"])
    for name, value in one["model"].items():
        assert fsdp["model"][name].shape == value.shape
        torch.testing.assert_close(fsdp["model"][name], value, rtol=1e-4, atol=1e-5)
    assert fsdp["optimizer"]["state"].keys() == one["optimizer"]["state"].keys()
    assert fsdp["optimizer"]["param_groups"] == one["optimizer"]["param_groups"]
    for i, state in one["optimizer"]["state"].items():
        torch.testing.assert_close(fsdp["optimizer"]["state"][i]["exp_avg_sq"], state["exp_avg_sq"],
                                   rtol=1e-3, atol=1e-9)


def test_fsdp_computes_in_bf16_and_keeps_float32_weights(runs):
    """fsdp_param_dtype bf16: blocks compute with bf16 copies (the loss moves off the float32 curve, but
    not far), while the sharded weights and the optimizer state, hence checkpoints, stay float32."""
    got, want = read_metrics(runs / "fsdp_bf16"), read_metrics(runs / "one")
    diffs = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, want)]
    assert len(got) == len(want) and 0 < max(diffs) < 0.02, diffs
    ckpt = load_checkpoint(runs / "fsdp_bf16" / "checkpoint.pt")
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values())
    assert all(s["exp_avg"].dtype == torch.float32 for s in ckpt["optimizer"]["state"].values())


@pytest.mark.parametrize("name", RESUMED)
def test_checkpoint_resumes_on_another_number_of_processes(runs, name):
    _assert_same_curve(runs / name, runs / "one")
    if name.endswith("2to1"):
        saved = load_checkpoint(runs / name / "saved.pt")
        assert saved["step"] == CHECKPOINT_EVERY and saved["world"] == 2, "it resumed mid-run from 2 processes"
    assert load_checkpoint(runs / name / "checkpoint.pt")["step"] == 12
    batches = [int(line) for line in (runs / name / "batches.txt").read_text().split()]
    assert batches == list(range(STOP_AT + 1)) + list(range(CHECKPOINT_EVERY, 12)), "resumed at its checkpoint"


def test_fsdp_shards_each_block_of_a_causal_lm():
    model = CausalLM(ModelConfig(mixer="gla", d_model=16, n_layers=3, n_heads=2, vocab_size=8, mlp=False))
    assert shard_units(model) == list(model.blocks)
    assert shard_units(TinyLM()) == []


class Numbered:
    """A map-style data set whose item ``i`` carries ``i`` as its label, so batches show which items they hold."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([i, i]), "label": torch.tensor(i)}


def test_each_process_reads_a_disjoint_shard_of_every_epoch():
    """Data sources shard each global batch over processes (rank r: rows r::world): in an epoch of an
    epoch-based source no item reaches two processes or one process twice, and the ranks together read
    exactly the single-process batches."""
    source = LRABatches(Numbered(), 8, seed=0)  # 5 batches an epoch
    for epoch in range(2):
        seen: list[int] = []
        for j in range(epoch * 5, epoch * 5 + 5):
            shards = [source.batch(j, rank, 2)[1][:, 0].tolist() for rank in range(2)]
            assert [len(shard) for shard in shards] == [4, 4]
            assert sorted(shards[0] + shards[1]) == sorted(source.batch(j)[1][:, 0].tolist())
            seen += shards[0] + shards[1]
        assert sorted(seen) == list(range(40)), f"epoch {epoch}: every item once"
    stream = TaskStream(make_task("mqar", vocab=16, seq_len=16, num_kv_pairs=2), 8, seed=0)
    whole = stream.batch(3)[0]
    halves = [stream.batch(3, rank, 2)[0] for rank in range(2)]
    assert torch.equal(torch.stack(halves, dim=1).reshape(whole.shape), whole)


def test_global_batch_must_split_evenly_over_processes():
    assert per_rank_batch(16, 2) == 8
    with pytest.raises(ConfigError, match=r"train.batch_size: 15 is not divisible by the number of processes 2"):
        per_rank_batch(15, 2)


@pytest.mark.parametrize("field, value", [("parallel", "zero3"), ("fsdp_param_dtype", "fp16"),
                                          ("fsdp_reduce_dtype", "auto")])
def test_parallel_fields_are_checked_strictly(field, value):
    with pytest.raises(ConfigError, match=rf"{field}: expected one of .*, got '{value}'"):
        TrainConfig(**{field: value})


def test_multicast_stays_off_unless_set():
    env = {"NCCL_NVLS_ENABLE": "1"}
    added = keep_multicast_off(env)
    assert env["NCCL_NVLS_ENABLE"] == "1", "an explicit choice is kept"
    assert added == {k: v for k, v in MULTICAST_OFF.items() if k != "NCCL_NVLS_ENABLE"}
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_checkpoint_older_than_the_parallel_fields_resumes():
    """A checkpoint written before TrainConfig had parallel/fsdp_* ran at their defaults: no change to refuse,
    while a non-default value is one."""
    from linattn.train.resume import resume_changes

    saved = TrainConfig().to_dict()
    for key in ("parallel", "fsdp_param_dtype", "fsdp_reduce_dtype"):
        del saved[key]
    assert resume_changes({"config": saved}, TrainConfig().to_dict(), None) == []
    assert resume_changes({"config": saved}, TrainConfig(parallel="fsdp").to_dict(), None) == []  # free to differ
    assert resume_changes({"config": saved}, TrainConfig(fsdp_reduce_dtype="bf16").to_dict(), None) == [
        ("train.fsdp_reduce_dtype", "fp32", "bf16")]
