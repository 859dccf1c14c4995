"""torch.compile(fullgraph=True) of CausalLM and SequenceClassifier: no graph breaks, and the compiled forward and
backward give the eager loss and gradients, for every mixer with a chunk or Triton backend; bad inputs still raise
the named errors eagerly; the data-dependent shortcuts of the ops (lag skipping of blockwise softmax, GLA's choice of
diagonal blocks) give the eager numbers when traced."""

import pytest
import torch

from linattn.layers.base import MixerLayer
from linattn.layers.registry import list_mixers, mixer_class
from linattn.models import CausalLM, ModelConfig, SequenceClassifier
from linattn.ops import get_op, list_ops
from linattn.ops.forgetting_attn import forgetting_attn
from linattn.ops.gla import gla
from linattn.testing import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")

V, T = 50, 70  # T = 70: several chunks of 16 or 32 tokens and a partial last one
TOL = 1e-5


def compiled_mixers() -> list[str]:
    """The mixers whose op has a chunk or a Triton backend (every op-backed layer; not the LRU/Mamba baselines)."""
    backends = {get_op(name).fn: get_op(name).backends for name in list_ops()}
    out = []
    for name in list_mixers():
        cls = mixer_class(name)
        if issubclass(cls, MixerLayer) and {"chunk", "triton"} & set(backends.get(cls.op, ())):
            out.append(name)
    return out


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test traces its own models (and stays clear of dynamo's recompilation limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def config(mixer: str, chunk_size: int = 32, n_layers: int = 2, **mixer_kwargs) -> ModelConfig:
    return ModelConfig(mixer=mixer, d_model=32, n_layers=n_layers, n_heads=2, vocab_size=V,
                       mixer_kwargs={"chunk_size": chunk_size, **mixer_kwargs})


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids [2, T] and a right-padding mask (the second sequence has 45 real tokens)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, T), generator=gen)
    mask = torch.arange(T)[None] < torch.tensor([[T], [45]])
    return {"ids": ids, "mask": mask}


def lm_loss(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    logits, _ = model(data["ids"], use_cache=False)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), data["ids"][:, 1:].reshape(-1))


def classifier_loss(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(data["ids"], mask=data["mask"]), torch.tensor([0, 2]))


def graph_breaks(model: torch.nn.Module, loss, data) -> list[str]:
    explanation = torch._dynamo.explain(lambda: loss(model, data))()
    return [str(b.reason)[:300] for b in explanation.break_reasons]


def assert_training_step_matches(model: torch.nn.Module, loss, data, backend: str) -> None:
    """One forward and backward of the compiled model (fullgraph: a graph break raises) gives the eager loss and
    gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    expected = loss(model, data)
    expected_grads = torch.autograd.grad(expected, params)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    actual = loss(compiled, data)
    actual_grads = torch.autograd.grad(actual, params)
    assert_close(actual, expected, TOL, "loss")
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for name, a, e in zip(names, actual_grads, expected_grads):
        assert_close(a, e, TOL, f"grad of {name}")


def test_every_op_backed_mixer_is_covered():
    assert set(compiled_mixers()) == set(list_mixers()) - {"lru", "mamba"}


@pytest.mark.parametrize("mixer, chunk_size", [("gated_delta_rule", 16), ("delta_rule", 32), ("gla", 16),
                                               ("mamba2", 32), ("softmax_attn", 32)])
def test_causal_lm_has_no_graph_breaks(mixer, chunk_size):
    torch.manual_seed(0)
    assert graph_breaks(CausalLM(config(mixer, chunk_size)), lm_loss, batch()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the backends 'auto' picks there (Triton)")
@pytest.mark.parametrize("mixer", ["gated_delta_rule", "comba", "softmax_attn"])
def test_causal_lm_on_cuda_under_autocast_has_no_graph_breaks(mixer):
    """The training setting of a GPU (default backends, bf16 autocast), traced by the torch installed there:
    Dynamo versions differ in what they trace (torch 2.11 broke every layer on a bool(ModuleDict) that the CPU's
    torch traces)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CausalLM(config(mixer, 64))
    data = {"ids": batch()["ids"].cuda()}

    def loss(model, data):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return lm_loss(model, data)

    assert graph_breaks(model, loss, data) == []


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("mixer", ["gated_delta_rule", "softmax_attn"])
def test_classifier_with_mask_has_no_graph_breaks(mixer, bidirectional):
    torch.manual_seed(0)
    model = SequenceClassifier(config(mixer), 3, pooling="last" if bidirectional else "mean",
                               bidirectional=bidirectional)
    assert graph_breaks(model, classifier_loss, batch()) == []


@pytest.mark.parametrize("mixer", compiled_mixers())
def test_compiled_causal_lm_training_step_matches_eager(mixer):
    torch.manual_seed(0)  # one block: tracing time grows with depth, and the graph breaks are tested above
    assert_training_step_matches(CausalLM(config(mixer, n_layers=1)), lm_loss, batch(), "eager")


# aot_eager also traces the backward (the autograd.Functions of the chunk backends, their saved tensors and the
# strides of the gradients); one mixer per code path that needed care
@pytest.mark.parametrize("mixer, kwargs", [
    ("gated_delta_rule", {}),
    ("gla", {"chunk_size": 16}),  # the choice of diagonal blocks inside the graph
    ("linear_attn", {}),  # the elu feature map's gradient strides
    ("forgetting_attn", {"window_size": 40, "n_kv_heads": 1}),  # blockwise softmax with gates, window, GQA
    ("retention", {"recompute_output_gate": True}),  # the output gate under a checkpoint in the graph
])
def test_aot_compiled_causal_lm_training_step_matches_eager(mixer, kwargs):
    torch.manual_seed(0)
    assert_training_step_matches(CausalLM(config(mixer, n_layers=1, **kwargs)), lm_loss, batch(), "aot_eager")


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "softmax_attn"])
def test_compiled_bidirectional_classifier_matches_eager(mixer):
    torch.manual_seed(0)
    model = SequenceClassifier(config(mixer, n_layers=1), 3, pooling="last", bidirectional=True)
    assert_training_step_matches(model, classifier_loss, batch(), "eager")


def assert_compiled_equals_eager(loss, inputs: tuple) -> None:
    """``loss(*inputs)`` and its gradients equal under torch.compile(fullgraph=True, aot_eager) and eagerly."""
    expected = loss(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs)
    actual = torch.compile(loss, fullgraph=True, backend="aot_eager")(*inputs)
    actual_grads = torch.autograd.grad(actual, inputs)
    assert_close(actual, expected, TOL, "loss")
    for name, a, e in zip("qkvg", actual_grads, expected_grads):
        assert_close(a, e, TOL, f"d{name}")


def test_compiled_blockwise_softmax_without_lag_skipping_matches_eager_with_it():
    """Strong forgetting: eager mode skips the far lags (their weights are < e^-80), the compiled graph computes
    them (no data-dependent branch); outputs and gradients agree."""
    gen = torch.Generator().manual_seed(1)
    B, n, H, K = 1, T, 2, 8
    q, k, v = (torch.randn(B, n, H, K, generator=gen).requires_grad_() for _ in range(3))
    g = (-6.0 - torch.rand(B, n, H, generator=gen)).requires_grad_()  # lags >= 2: bias below -100

    def loss(q, k, v, g):
        o, _ = forgetting_attn(q, k, v, g, backend="chunk", chunk_size=16)
        return o.square().sum()

    assert_compiled_equals_eager(loss, (q, k, v, g))


@pytest.mark.parametrize("g_value", [-0.05, -20.0])
def test_compiled_gla_picks_the_eager_diagonal_blocks(g_value):
    """Weak gates: factored diagonal blocks; strong gates (|G_t - G_b| > 30 in a sub-chunk): the explicit ones.
    The compiled graph decides inside and gives the eager numbers, finite gradients included."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 45, 2, 8, generator=gen).requires_grad_() for _ in range(3))
    g = torch.full((2, 45, 2, 8), g_value, requires_grad=True)

    def loss(q, k, v, g):
        o, state = gla(q, k, v, g, backend="chunk", chunk_size=32, output_final_state=True)
        return o.square().sum() + state.sum()

    assert_compiled_equals_eager(loss, (q, k, v, g))


def test_bad_inputs_raise_named_errors():
    """Shape and dtype checks are Python-level: eager calls and calls through a compiled model (dynamo hands the
    error on) raise the same errors; under fullgraph=True dynamo reports it as unsupported, naming it."""
    torch.manual_seed(0)
    lm = CausalLM(config("gated_delta_rule"))
    compiled = torch.compile(lm, backend="eager")
    for model in (lm, compiled):
        with pytest.raises(TypeError, match="input_ids must have dtype int64, int32, int16, uint8"):
            model(torch.rand(2, 5))
        with pytest.raises(ValueError, match=r"input_ids must have shape \[B, T\]"):
            model(torch.randint(0, V, (5,)))
    with pytest.raises(ValueError, match=r"values must lie in \[0, vocab_size=50\)"):
        lm(torch.full((2, 5), V))  # a value check: eager only (skipped while compiling)
    with pytest.raises(Exception, match="input_ids must have dtype int64, int32, int16, uint8"):
        torch.compile(lm, fullgraph=True, backend="eager")(torch.rand(2, 5))
    classifier = SequenceClassifier(config("softmax_attn"), 3)
    with pytest.raises(ValueError, match="mask must be a bool tensor of shape"):
        classifier(torch.randint(0, V, (2, 6)), mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match="must mark a non-empty prefix"):
        classifier(torch.randint(0, V, (2, 6)), mask=torch.tensor([[True] * 6, [False] + [True] * 5]))


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["gated_delta_rule", "softmax_attn"])
def test_inductor_compiled_training_step_matches_eager(mixer):
    """The default backend (inductor: generated C++ kernels on the CPU, about a minute per model)."""
    torch.manual_seed(0)
    assert_training_step_matches(CausalLM(config(mixer, 16)), lm_loss, batch(), "inductor")
