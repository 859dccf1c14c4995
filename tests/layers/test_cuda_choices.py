"""Every mixer layer making CUDA's choices (the ops' Triton backends, the fused norm and gate kernels, ShortConv's
"auto" rule for CUDA tensors: conv1d for small inputs that need gradients, the Triton kernels otherwise, including
the backward pass's recompute; the guarded products' branch-free form) gives the plain CPU layer's output and
gradients (chunk backends, PyTorch norms, multiply-add convs). Choices that depend on the device or the grad mode
are where CUDA-only bugs hide: the recompute of the conv outputs once rebuilt q, k, v in another layout than the
forward's on CUDA.

Runs on CUDA when present (the layer as it is there, against a CPU copy), else on the CPU through Triton's
interpreter (tests/conftest.py) with CUDA's rules patched in."""

import copy
import functools
import inspect

import pytest
import torch

import linattn
import linattn.layers.shortconv as shortconv
from linattn.layers.registry import list_mixers, mixer_class
from linattn.ops.common import masking
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import assert_close

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed"),
              pytest.mark.usefixtures("one_thread")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _output_and_grads(layer, x, **kw):
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y, _ = layer(x, use_cache=False, **kw)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


PACKED = [m for m in list_mixers() if "cu_seqlens" in inspect.signature(mixer_class(m).forward).parameters]


@pytest.mark.parametrize("mixer,packed", [(m, False) for m in list_mixers()] + [(m, True) for m in PACKED])
def test_the_layer_with_cudas_choices_equals_the_cpu_layer(mixer, packed, monkeypatch):
    """Packed: three sequences in one row (the packed ShortConv and op paths)."""
    _check_cudas_choices(mixer, packed, 32, monkeypatch)


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "comba", "gla", "mamba2"])
def test_heads_of_128_with_cudas_choices_equal_the_cpu_layer(mixer, monkeypatch):
    """Heads of 128 channels, as the benchmark model's: the kernels then run several key blocks per head, where a
    per-block result in the wrong place shows (with one block per head it cannot)."""
    _check_cudas_choices(mixer, False, 256, monkeypatch)


def _check_cudas_choices(mixer, packed, d_model, monkeypatch):
    torch.manual_seed(0)
    layer = mixer_class(mixer)(d_model, 2)
    x = torch.randn(1 if packed else 2, 70 if packed else 37, d_model, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 20, 33, 70]) if packed else None
    kw = {"cu_seqlens": cu} if packed else {}
    with linattn.settings(op_backend="chunk", fused_backend="torch", shortconv_backend="muladd"):
        want = _output_and_grads(layer, x, **kw)
    if DEVICE == "cpu":
        monkeypatch.setattr(shortconv, "auto_backend", functools.partial(shortconv.auto_backend, on_cuda=True))
        monkeypatch.setattr(masking, "all_finite_here", lambda *xs: False)  # the guarded products' CUDA form
    with linattn.settings(op_backend="auto" if DEVICE == "cuda" else "triton", fused_backend="auto"
                          if DEVICE == "cuda" else "triton", shortconv_backend="auto"):
        # a copy: moving the layer itself would move the reference's gradients (held by reference) to the GPU
        got = _output_and_grads(copy.deepcopy(layer).to(DEVICE), x.to(DEVICE),
                                **({"cu_seqlens": cu.to(DEVICE)} if packed else {}))
    names = ["output", "dx"] + [f"grad of {n}" for n, _ in layer.named_parameters()]
    for name, a, e in zip(names, got, want):
        assert (a is None) == (e is None), name
        if e is not None:
            assert_close(a.cpu(), e, 1e-4, f"{mixer}: {name}")


@pytest.mark.parametrize("mixer", list_mixers())
def test_greedy_decoding_with_cudas_choices_equals_the_cpu_path(mixer, monkeypatch):
    """A CausalLM's greedy tokens from the static decoder with CUDA's choices (step kernels, ShortConv's step kernel)
    equal the CPU's cached eager path's."""
    from linattn.models.config import ModelConfig
    from linattn.models.lm import CausalLM

    torch.manual_seed(0)
    model = CausalLM(ModelConfig(mixer=mixer, d_model=32, n_layers=2, n_heads=2, vocab_size=50)).eval()
    prompt = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(2))
    with linattn.settings(op_backend="chunk", fused_backend="torch", shortconv_backend="muladd", step_backend="torch"):
        want = model.generate(prompt, 8, static=False)
    if DEVICE == "cpu":
        monkeypatch.setattr(shortconv, "auto_backend", functools.partial(shortconv.auto_backend, on_cuda=True))
        monkeypatch.setattr(masking, "all_finite_here", lambda *xs: False)
    backend = "auto" if DEVICE == "cuda" else "triton"
    with linattn.settings(op_backend=backend, fused_backend=backend, shortconv_backend="auto", step_backend=backend):
        got = model.to(DEVICE).generate(prompt.to(DEVICE), 8, static=True)
    assert torch.equal(got.cpu(), want)
