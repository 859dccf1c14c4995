"""Models built from a :class:`ModelConfig`: CausalLM (cached decoding) and SequenceClassifier."""

from linattn.layers import list_mixers

from .classifier import SequenceClassifier
from .config import ModelConfig
from .lm import CausalLM

__all__ = ["CausalLM", "ModelConfig", "SequenceClassifier", "list_mixers"]
