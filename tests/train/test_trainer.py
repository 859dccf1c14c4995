"""The Trainer: learns, resumes exactly after kill -9, reports bad checkpoints and NaNs, DDP = 1 process."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import linattn.train.trainer as trainer_module
from linattn.data import IGNORE_INDEX, TaskStream, eval_set, make_task
from linattn.train import (
    CheckpointError,
    NonFiniteLossError,
    TrainConfig,
    Trainer,
    load_checkpoint,
    read_metrics,
)
from linattn.train.checkpoint import MAGIC
from linattn.train.schedule import warmup_cosine

VOCAB = 8


pytestmark = pytest.mark.usefixtures("one_thread")


class TinyLM(nn.Module):
    """Embeds x_t and x_{t-1}, an MLP, logits: enough for tasks that read the previous token."""

    def __init__(self, vocab: int = VOCAB, d: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab + 1, d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, 64), nn.GELU(), nn.Dropout(dropout), nn.Linear(64, vocab))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        if (x < 0).any():  # the tests' poison pill: a NaN forward
            return torch.full((*x.shape, VOCAB), float("nan")), None
        prev = torch.nn.functional.pad(x, (1, 0), value=VOCAB)[:, :-1]
        return self.mlp(torch.cat([self.emb(x), self.emb(prev)], dim=-1)), None


class ShiftSum:
    """y_t = (x_t + x_{t-1}) mod VOCAB from t=1; a trivially learnable task. Batch ``kill_at`` SIGKILLs
    this process (once, when a marker file is absent); batch ``poison_at`` carries a NaN pill."""

    def __init__(self, seed: int = 0, batch_size: int = 16, kill_at: int = -1, marker: str = "",
                 poison_at: int = -1) -> None:
        self.seed, self.batch_size, self.kill_at, self.marker, self.poison_at = \
            seed, batch_size, kill_at, marker, poison_at

    def make(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, VOCAB, (n, 12), generator=gen)
        y = (x + torch.nn.functional.pad(x, (1, 0))[:, :-1]) % VOCAB
        y[:, 0] = IGNORE_INDEX
        return x, y

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if index == self.kill_at and not Path(self.marker).exists():
            Path(self.marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = self.make(self.batch_size, torch.Generator().manual_seed(self.seed * 100003 + index))
        if index == self.poison_at:
            x[0, 0] = -1
        return x[rank::world], y[rank::world]


def _config(**kw) -> TrainConfig:
    base = dict(max_steps=40, batch_size=16, lr=3e-3, warmup_steps=5, eval_every=10, log_every=5,
                progress=False, device="cpu", seed=0)
    return TrainConfig(**{**base, **kw})


def _run(out_dir, deadline=None, **data_kw):
    torch.manual_seed(0)
    model = TinyLM()
    data = ShiftSum(**data_kw)
    trainer = Trainer(model, data, _config(), eval_data=data.make(64, torch.Generator().manual_seed(99)),
                      out_dir=out_dir)
    return trainer.fit(deadline=deadline), model


def test_learns_a_trivial_task(tmp_path):
    torch.manual_seed(0)
    data = ShiftSum()
    cfg = _config(max_steps=300, eval_every=25, lr=1e-2, target_value=0.99)
    result = Trainer(TinyLM(), data, cfg, eval_data=data.make(128, torch.Generator().manual_seed(1)),
                     out_dir=tmp_path).fit()
    assert result.status == "target_reached" and result.metrics["accuracy"] >= 0.99
    assert result.step < 300, "early stopping at the target"
    records = read_metrics(tmp_path)
    evals = [r for r in records if r["split"] == "eval"]
    assert evals[0]["loss"] > evals[-1]["loss"] and evals[-1]["step"] == result.step
    assert {"loss", "lr", "grad_norm"} <= set(next(r for r in records if r["split"] == "train"))


def test_learns_mqar_stream_with_classifier_shaped_targets(tmp_path):
    """TaskStream + eval_set plug straight in; [B, C] logits with [B] targets work too."""
    task = make_task("mqar", vocab=16, seq_len=16, num_kv_pairs=2)

    class LastToken(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.out(self.emb(x[:, 0]))

    class FirstValue:
        def batch(self, index, rank=0, world=1):
            x, _ = TaskStream(task, 32, seed=0).batch(index, rank, world)
            return x, x[:, 1]

    x, _ = eval_set(task, 64, seed=0)
    torch.manual_seed(0)
    res = Trainer(LastToken(), FirstValue(), _config(max_steps=5), eval_data=(x, x[:, 1])).fit()
    assert res.status == "completed" and 0.0 <= res.metrics["accuracy"] <= 1.0


def test_schedule_warmup_then_cosine():
    assert warmup_cosine(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)


def _worker_cmd(out_dir: Path, kill_at: int, marker: Path) -> list[str]:
    code = (f"import sys, json, torch; torch.set_num_threads(1); sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"import test_trainer as t; r, _ = t._run({str(out_dir)!r}, kill_at={kill_at}, marker={str(marker)!r}); "
            "print(json.dumps(r.metrics))")
    return [sys.executable, "-c", code]


def test_kill9_then_resume_matches_uninterrupted(tmp_path):
    ref, ref_model = _run(tmp_path / "ref")
    marker = tmp_path / "killed"
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(_worker_cmd(run_dir, 25, marker), capture_output=True, text=True, env=env)
    assert first.returncode == -signal.SIGKILL, first.stderr
    # the checksummed format: load_checkpoint verifies the payload's sha256 against the header
    assert (run_dir / "checkpoint.pt").read_bytes().startswith(MAGIC)
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == 20
    second = subprocess.run(_worker_cmd(run_dir, 25, marker), capture_output=True, text=True, env=env)
    assert second.returncode == 0, second.stderr
    resumed = eval(second.stdout.strip().splitlines()[-1])
    assert resumed == ref.metrics
    assert (run_dir / "checkpoint.pt").read_bytes().startswith(MAGIC)
    ckpt = load_checkpoint(run_dir / "checkpoint.pt")
    for name, p in ref_model.state_dict().items():
        assert torch.equal(ckpt["model"][name], p), name
    steps = [(r["split"], r["step"]) for r in read_metrics(run_dir)]
    assert steps == [(r["split"], r["step"]) for r in read_metrics(tmp_path / "ref")], "no duplicate records"


def test_deadline_interrupts_and_resume_finishes(tmp_path):
    res, _ = _run(tmp_path, deadline=0.0)
    assert res.status == "interrupted" and res.step == 1
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 1
    res, _ = _run(tmp_path)
    ref, _ = _run(tmp_path / "ref")
    assert res.status == "completed" and res.metrics == ref.metrics


def test_corrupt_checkpoint_gives_clear_error(tmp_path):
    _run(tmp_path)
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        _run(tmp_path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path)
    torch.save({"model": {}}, path)
    with pytest.raises(CheckpointError, match="lacks"):
        load_checkpoint(path)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    _run(tmp_path)
    data = ShiftSum()
    with pytest.raises(CheckpointError, match="does not match"):
        Trainer(TinyLM(d=16), data, _config(), out_dir=tmp_path).fit()


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(nan\) at step 13.*step 10\) is kept"):
        _run(tmp_path, poison_at=12)
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["step"] == 10
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_steps"):
        TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="unknown train config"):
        TrainConfig.from_dict({"lr": 1e-3, "learning_rate": 1})
    with pytest.raises(TypeError, match="model"):
        Trainer("nope", ShiftSum(), _config())
    with pytest.raises(TypeError, match="train_data"):
        Trainer(TinyLM(), object(), _config())
    with pytest.raises(ValueError, match="target_metric"):
        Trainer(TinyLM(), ShiftSum(), _config(max_steps=10, target_value=0.5, target_metric="f1"),
                eval_data=ShiftSum().make(8, torch.Generator().manual_seed(0))).fit()


def test_tensorboard_flag(tmp_path):
    data = ShiftSum()
    trainer = None
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            Trainer(TinyLM(), data, _config(max_steps=2, tensorboard=True), out_dir=tmp_path).fit()
        return
    trainer = Trainer(TinyLM(), data, _config(max_steps=2, tensorboard=True), out_dir=tmp_path)
    trainer.fit()
    assert any((tmp_path / "tensorboard").iterdir())


def _ddp_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        data = ShiftSum()
        cfg = _config(max_steps=12, log_every=1, eval_every=6)
        Trainer(TinyLM(dropout=0.0), data, cfg, eval_data=data.make(64, torch.Generator().manual_seed(99)),
                out_dir=out).fit()
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_matches_one_process(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "pg"), str(tmp_path / "ddp")), nprocs=2, join=True)
    _ddp_worker_single = tmp_path / "single"
    torch.manual_seed(0)
    data = ShiftSum()
    Trainer(TinyLM(dropout=0.0), data, _config(max_steps=12, log_every=1, eval_every=6),
            eval_data=data.make(64, torch.Generator().manual_seed(99)), out_dir=_ddp_worker_single).fit()
    two, one = read_metrics(tmp_path / "ddp"), read_metrics(_ddp_worker_single)
    assert [(r["split"], r["step"]) for r in two] == [(r["split"], r["step"]) for r in one]
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)


def test_compiled_training_gives_the_eager_losses(tmp_path, monkeypatch):
    """train.compile: the training forward goes through torch.compile in that mode (on the CPU with the aot_eager
    backend: the wiring, not inductor) and trains to the eager run's losses; evaluation stays eager."""
    real, modes = torch.compile, []

    def spy(model, mode=None):
        modes.append(mode)
        return real(model, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", spy)
    runs = {}
    for mode in ("off", "reduce-overhead"):
        torch.manual_seed(0)
        data = ShiftSum()
        trainer = Trainer(TinyLM(dropout=0.0), data, _config(max_steps=6, log_every=1, eval_every=3, compile=mode),
                          eval_data=data.make(64, torch.Generator().manual_seed(99)), out_dir=tmp_path / mode)
        assert (trainer.forward is trainer.model) == (mode == "off")
        trainer.fit()
        runs[mode] = read_metrics(tmp_path / mode)
    assert modes == ["reduce-overhead"]
    assert [(r["split"], r["step"]) for r in runs["off"]] == [(r["split"], r["step"]) for r in runs["reduce-overhead"]]
    for a, b in zip(runs["off"], runs["reduce-overhead"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)


class CachingLM(TinyLM):
    """TinyLM with a decoding-cache switch, as CausalLM has: records what each call asked for."""

    def __init__(self) -> None:
        super().__init__(dropout=0.0)
        self.asked: list[bool] = []

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> tuple[torch.Tensor, None]:
        self.asked.append(use_cache)
        return super().forward(x)


def test_training_asks_for_no_decoding_cache(tmp_path):
    """A model that can return a decoding cache (CausalLM's use_cache) is asked for none in training steps and
    evaluation; models without the switch are called as they are (TinyLM above)."""
    torch.manual_seed(0)
    model, data = CachingLM(), ShiftSum()
    Trainer(model, data, _config(max_steps=3, eval_every=3), eval_data=data.make(32, torch.Generator().manual_seed(1)),
            out_dir=tmp_path).fit()
    assert len(model.asked) > 3 and not any(model.asked)


class NaNGradientLM(TinyLM):
    """TinyLM whose training forward number ``nan_at`` (0-based) makes the gradient of its logits NaN in
    backward; the loss of that step stays finite."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.nan_at, self.train_calls = nan_at, 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, _ = super().forward(x)
        if self.training:
            if self.train_calls == self.nan_at:
                logits.register_hook(lambda g: torch.full_like(g, float("nan")))
            self.train_calls += 1
        return logits, None


def test_non_finite_gradient_with_a_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = NaNGradientLM(nan_at=12)
    data = ShiftSum()
    trainer = Trainer(model, data, _config(), eval_data=data.make(64, torch.Generator().manual_seed(99)),
                      out_dir=tmp_path)
    with pytest.raises(NonFiniteLossError, match=r"non-finite gradient norm \(nan\) at step 13.*step 10\) is kept"):
        trainer.fit()
    assert trainer.step == 12, "the bad step did not count"
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the NaN gradient was not applied"
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["step"] == 10
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    train_rows = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [5, 10] and all(math.isfinite(r["loss"]) for r in train_rows)


def _fused_checks_on_device(monkeypatch) -> None:
    """The CUDA path, on the CPU: the fused AdamW, which skips a non-finite step's update on the device, and each
    step's values read once the next step is queued."""
    monkeypatch.setattr(trainer_module, "fused_optimizer", lambda device, sharded: True)


def _nan_gradient_fit(out_dir, nan_at: int, max_steps: int = 40, device: str = "cpu"
                      ) -> tuple[Trainer, NaNGradientLM]:
    torch.manual_seed(0)
    model = NaNGradientLM(nan_at=nan_at)
    data = ShiftSum()
    trainer = Trainer(model, data, _config(max_steps=max_steps, device=device),
                      eval_data=data.make(64, torch.Generator().manual_seed(99)), out_dir=out_dir)
    return trainer, model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_checks_on_device_read_a_step_late_and_stop_with_the_last_good_parameters(tmp_path, monkeypatch, device):
    if device == "cpu":
        _fused_checks_on_device(monkeypatch)
    trainer, model = _nan_gradient_fit(tmp_path, nan_at=12, device=device)
    after_12 = []  # the parameters step 13's forward sees: those after step 12

    def snapshot(module, args):
        if module.training and module.train_calls == 12:
            after_12.extend(p.detach().clone() for p in module.parameters())

    model.register_forward_pre_hook(snapshot)
    assert trainer._checks_on_device()
    with pytest.raises(NonFiniteLossError, match=r"non-finite gradient norm \(nan\) at step 13.*step 10\) is kept"):
        trainer.fit()
    assert model.train_calls == 14, "step 13's values were read after step 14 was queued"
    assert trainer.step == 12 and trainer.scheduler.last_epoch == 12, "neither step 13 nor 14 counted"
    for p, q in zip(model.parameters(), after_12, strict=True):
        assert torch.equal(p, q), "an update after step 12 was applied"
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 10
    train_rows = [r for r in read_metrics(tmp_path) if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [5, 10]


def test_checks_on_device_log_what_checks_at_once_log(tmp_path, monkeypatch):
    rows = {}
    for name in ("at once", "on device"):
        if name == "on device":
            _fused_checks_on_device(monkeypatch)
        trainer, _ = _nan_gradient_fit(tmp_path / name.replace(" ", "_"), nan_at=-1, max_steps=23)
        assert trainer._checks_on_device() == (name == "on device")
        trainer.fit()
        rows[name] = read_metrics(tmp_path / name.replace(" ", "_"))
    assert [(r["split"], r.get("step")) for r in rows["at once"]] == \
        [(r["split"], r.get("step")) for r in rows["on device"]]
    for a, b in zip(rows["at once"], rows["on device"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)  # fused and per-tensor AdamW round alike to 1e-4
        if a["split"] == "train":
            assert a["lr"] == b["lr"]
