"""Prompts are prefilled with SDPA kept off cuDNN (which builds a plan per new sequence length on CUDA): every
prefill path goes through ``prefill_forward``, which enters ``sdpa_for_new_lengths``."""

import contextlib

import pytest
import torch

from linattn.models import CausalLM, ModelConfig, decode


@pytest.fixture
def entered(monkeypatch):
    calls = []

    def recording(x):
        calls.append(tuple(x.shape))
        return contextlib.nullcontext()

    monkeypatch.setattr(decode, "sdpa_for_new_lengths", recording)
    return calls


def _model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(mixer="softmax_attn", d_model=32, n_layers=1, n_heads=2, vocab_size=32)).eval()


@pytest.mark.parametrize("static", [True, False])
def test_generate_prefills_each_prompt_length_through_the_restriction(entered, static):
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8])]
    _model().generate(prompts, 2, static=static)
    assert sorted(entered) == [(1, 2), (2, 3)]  # one prefill per prompt length, rows of a length together


def test_prefill_forward_returns_the_model_output(entered):
    model, ids = _model(), torch.tensor([[1, 2, 3, 4]])
    logits, _ = decode.prefill_forward(model, ids)
    assert torch.equal(logits, model(ids)[0]) and entered == [(1, 4)]
