"""The Trainer's own throughput: ``python -m linattn.bench.trainer_speed [--mixers M,...] [--shape BxT]``.

Each mixer's :class:`~linattn.models.CausalLM` (the sizes of ``linattn bench model``: on CUDA the reference
config, d_model 1024, 12 layers, 8 heads, vocab 32000) trains on random tokens through
:class:`~linattn.train.Trainer` (bf16 autocast on CUDA, prefetching batches), and the tokens/s of its metrics log
are read back: the median of its train records after the first two. ``--checks`` picks how the Trainer reads each
step's loss and gradient norm: "late" (the fused AdamW, the Trainer's default on CUDA: it skips a non-finite
step's update on the device, and the values are read once the next step is queued) or "at-once" (the per-tensor
AdamW, the default on the CPU and under FSDP: values read before the update, so on CUDA the GPU's queue drains
every step). Both are measured by default, one Trainer each, in this order.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from linattn.bench.model import DEFAULTS as MODEL_DEFAULTS
from linattn.bench.model import parse_shapes
from linattn.models import CausalLM, ModelConfig
from linattn.train import TrainConfig, Trainer, read_metrics

CHECKS = ("late", "at-once")


class RandomTokens:
    """Batch ``index``: ``rows`` rows of ``seq_len + 1`` random tokens (seeded by the index), inputs and targets."""

    def __init__(self, rows: int, seq_len: int, vocab: int) -> None:
        self.rows, self.seq_len, self.vocab = rows, seq_len, vocab

    def batch(self, index: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        ids = torch.randint(0, self.vocab, (self.rows, self.seq_len + 1), generator=gen)[rank::world]
        return ids[:, :-1], ids[:, 1:]


def trainer_tokens_per_s(config: ModelConfig, batch: int, seq_len: int, steps: int, checks: str, device: str,
                         log_every: int = 5) -> float:
    """The median tokens/s of the Trainer's train records after the first two (``steps`` steps, one record per
    ``log_every``), with the non-finite ``checks`` of :data:`CHECKS`."""
    if checks not in CHECKS:
        raise ValueError(f"checks must be one of {', '.join(CHECKS)}, got {checks!r}")
    if steps < 3 * log_every:
        raise ValueError(f"steps must be at least 3 * log_every = {3 * log_every}, got {steps}")
    torch.manual_seed(0)
    model = CausalLM(config)
    cfg = TrainConfig(max_steps=steps, batch_size=batch, lr=3e-4, warmup_steps=log_every, eval_every=10**9,
                      log_every=log_every, progress=False, device=device, prefetch=True)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model, RandomTokens(batch, seq_len, config.vocab_size), cfg, out_dir=out)
        # the Trainer reads each step's values late exactly when its AdamW is the fused one (its default on CUDA)
        for group in trainer.optimizer.param_groups:
            group["fused"] = checks == "late"
            group["foreach"] = None
        trainer.fit()
        rows = [r for r in read_metrics(Path(out)) if r["split"] == "train"]
    return statistics.median(r["tokens_per_s"] for r in rows[2:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m linattn.bench.trainer_speed", description=__doc__.splitlines()[0])
    p.add_argument("--mixers", default="softmax_attn,gated_delta_rule", help="comma-separated mixer names")
    p.add_argument("--shape", default=None, help="BxT of a training batch (default: the first shape of "
                   "linattn bench model's, cuda 8x2048, cpu 2x128)")
    p.add_argument("--steps", type=int, default=None, help="training steps per Trainer (cuda default 35; cpu 15)")
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated: late,at-once")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    defaults = MODEL_DEFAULTS["cuda" if cuda else "cpu"]  # linattn bench model's sizes
    batch, seq_len = parse_shapes(a.shape or defaults["shapes"].split(",")[0])[0]
    size = dict(d_model=defaults["d_model"], n_layers=defaults["layers"], n_heads=defaults["heads"],
                vocab_size=defaults["vocab"])
    steps = a.steps or (35 if cuda else 15)
    results = []
    for mixer in a.mixers.split(","):
        for checks in a.checks.split(","):
            tps = trainer_tokens_per_s(ModelConfig(mixer=mixer, **size), batch, seq_len, steps, checks, a.device)
            results.append({"mixer": mixer, "checks": checks, "batch": batch, "seq_len": seq_len, "tokens_per_s": tps})
            print(f"{mixer:20s} {checks:8s} {tps:12,.0f} tokens/s", flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if a.out:
        summary = {"device": a.device, "size": size, "steps": steps, "rows": results}
        Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
