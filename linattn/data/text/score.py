"""Bits per byte: a language model's score that any tokenizer compares on.

bits per byte = (sum over the evaluated tokens of -ln p(token)) / ln 2 / (UTF-8 bytes those tokens stand for).
A model that spends fewer bits on the same text is better, whatever its tokens. The baseline is the unigram
entropy of the training split: the bits per byte of a model that knows only how often each token occurs.
"""

from __future__ import annotations

import math

import numpy as np

from linattn.errors import DataError


def bits_per_byte(nll_nats: float, num_bytes: int) -> float:
    """``nll_nats`` (a sum over tokens, in nats) in bits per UTF-8 byte of the text those tokens stand for."""
    if num_bytes <= 0:
        raise DataError(f"bits per byte needs a positive number of bytes, got {num_bytes}")
    return nll_nats / math.log(2) / num_bytes


def mean_loss_to_bpb(mean_nll: float, num_tokens: int, num_bytes: int) -> float:
    """The Trainer's mean token loss (nats) over ``num_tokens`` targets standing for ``num_bytes`` bytes."""
    return bits_per_byte(mean_nll * num_tokens, num_bytes)


def unigram_entropy_bpb(tokens: np.ndarray, token_bytes: np.ndarray) -> float:
    """The entropy of the token frequencies of ``tokens``, in bits per byte of the text they stand for:
    H = -sum_i p_i log2 p_i bits per token, times tokens / bytes."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=len(token_bytes)).astype(np.float64)
    total = counts.sum()
    if total == 0:
        raise DataError("the unigram entropy needs at least one token")
    p = counts[counts > 0] / total
    bits_per_token = float(-(p * np.log2(p)).sum())
    num_bytes = float((counts * token_bytes[: len(counts)]).sum())
    return bits_per_token * total / num_bytes
