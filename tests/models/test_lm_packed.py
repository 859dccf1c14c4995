"""CausalLM over packed documents (cu_seqlens): the logits and gradients of running each document alone, for
op-backed mixers (which take cu_seqlens) and the baselines (run per document); bad packed calls named."""

from __future__ import annotations

import pytest
import torch

from linattn.models import CausalLM, ModelConfig
from linattn.models.blocks import Block
from linattn.testing import assert_same_gradients

VOCAB = 23
LENGTHS = (4, 1, 19, 6)
CU = torch.tensor([0, 4, 5, 24, 30], dtype=torch.int64)


def _model(mixer: str) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelConfig(mixer=mixer, d_model=16, n_layers=2, n_heads=2, vocab_size=VOCAB,
                                mixer_kwargs={} if mixer in ("lru", "mamba") else {"chunk_size": 16})).double()


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "retention", "softmax_attn", "mamba2", "lru", "mamba"])
def test_packed_documents_equal_separate(mixer: str) -> None:
    """In float64, at the float32 tolerance: the tied embedding's gradient sums over every token, in another
    order when packed (in float32 that rounding alone reaches 3e-5), while the layers' gates and L2 norms compute
    in float32 by design (gates.py, norms.py), whose vectorised and scalar paths round differently per length."""
    model = _model(mixer)
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    logits, cache = model(ids, cu_seqlens=CU)
    assert cache is None
    ref = torch.cat([model(ids[:, s:e], use_cache=False)[0]
                     for s, e in zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True)], dim=1)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    w = torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
    assert_same_gradients((logits * w).sum(), (ref * w).sum(), list(model.parameters()), rtol=1e-5, atol=1e-5)


def test_bad_packed_calls_are_named() -> None:
    model = _model("gated_delta_rule")
    with pytest.raises(ValueError, match=r"input_ids must have batch size B = 1 with cu_seqlens"):
        model(torch.zeros(2, 30, dtype=torch.long), cu_seqlens=CU)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, got 2"):
        model(torch.zeros(1, 30, dtype=torch.long), cu_seqlens=torch.tensor([2, 30]))
    _, cache = model(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"cache must be None with cu_seqlens"):
        model(torch.zeros(1, 30, dtype=torch.long), cache, cu_seqlens=CU)
    block = Block(ModelConfig(mixer="gla", d_model=16, n_layers=1, n_heads=2, vocab_size=VOCAB), bidirectional=True)
    with pytest.raises(ValueError, match=r"cu_seqlens .* causal blocks only"):
        block(torch.zeros(1, 30, 16), cu_seqlens=CU)


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "softmax_attn", "lru"])
def test_attention_mask_runs_each_row_alone(mixer: str) -> None:
    model = _model(mixer)
    ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 6:] = 0  # right padding
    mask[1, :4] = 0  # left padding
    logits, cache = model(ids, attention_mask=mask)
    assert cache is None
    for row in range(3):
        kept = mask[row].bool()
        alone, _ = model(ids[row:row + 1, kept], use_cache=False)
        torch.testing.assert_close(logits[row:row + 1, kept], alone, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits[row, ~kept], torch.zeros_like(logits[row, ~kept])), "padding gets logits 0"


def test_bad_attention_masks_are_named() -> None:
    model = _model("gated_delta_rule")
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"attention_mask must have the inputs' shape \[B, T\] = \[2, 5\]"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"rows \[1\] have none"):
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"attention_mask values must be 0 \(padding\) or 1 \(token\)"):
        model(ids, attention_mask=torch.full((2, 5), 2))
    with pytest.raises(TypeError, match=r"attention_mask must be bool or integer"):
        model(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"pass cu_seqlens or attention_mask, not both"):
        model(ids, attention_mask=torch.ones(2, 5, dtype=torch.bool), cu_seqlens=torch.tensor([0, 10]))
