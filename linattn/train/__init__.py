"""Training: the Trainer (AdamW, warmup+cosine, clipping, AMP, eval, early stop, exact resume, DDP)."""

from linattn.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from linattn.train.config import TrainConfig
from linattn.train.distributed import DistInfo, init_distributed
from linattn.train.trainer import NonFiniteLossError, Trainer, TrainResult, read_metrics

__all__ = [
    "CheckpointError", "load_checkpoint", "save_checkpoint", "TrainConfig", "DistInfo", "init_distributed",
    "NonFiniteLossError", "Trainer", "TrainResult", "read_metrics",
]
