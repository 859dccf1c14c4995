"""Named errors of the models' inputs: an empty batch and an unsupported id dtype say what is accepted."""

from __future__ import annotations

import pytest
import torch

from linattn.models import CausalLM, ModelConfig


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return CausalLM(ModelConfig(mixer="gla", d_model=16, n_layers=1, n_heads=2, vocab_size=10))


def test_empty_batch_is_refused_by_shape(model):
    with pytest.raises(ValueError, match=r"input_ids must have shape \[B, T\] with B >= 1 and T >= 1, got \[0, 4\]"):
        model(torch.zeros(0, 4, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32, torch.bool])
def test_unsupported_id_dtype_names_the_accepted_ones(model, dtype):
    name = str(dtype).replace("torch.", "")
    with pytest.raises(TypeError, match=rf"input_ids must have dtype int64, int32, int16, uint8, got {name}$"):
        model(torch.zeros(2, 4, dtype=dtype))
    assert model(torch.zeros(2, 4, dtype=torch.uint8))[0].shape == (2, 4, 10)
