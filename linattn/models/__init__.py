"""Models built from a :class:`ModelConfig`: CausalLM (cached decoding) and SequenceClassifier; weight transfer
from a pretrained model to a classifier."""

from linattn.layers import list_mixers

from .classifier import SequenceClassifier
from .config import ModelConfig
from .lm import CausalLM
from .padded import PaddedClassifier
from .transfer import TransferReport, load_pretrained, transfer_encoder

__all__ = ["CausalLM", "ModelConfig", "PaddedClassifier", "SequenceClassifier", "TransferReport", "list_mixers",
           "load_pretrained", "transfer_encoder"]
