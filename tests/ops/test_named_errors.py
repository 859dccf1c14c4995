"""Named errors of the ops and layers: log decays g > 0 (or NaN) refused by every op and step that takes one; an
unknown backend or absurd chunk_size refused when a layer is built; a decoding cache whose ShortConv states do not
match the layer continuing it; mesa_net's read-out system that is not positive definite (NaN inputs, float16 keys too
large for float32 precision), on every backend."""

from __future__ import annotations

import math

import pytest
import torch

from linattn.layers import MixerLayer, build_mixer, list_mixers
from linattn.layers.cache import LayerCache
from linattn.layers.registry import mixer_class
from linattn.models import CausalLM, ModelConfig
from linattn.ops import get_op
from linattn.ops.common.values import value_checks
from linattn.ops.mesa_net import NotPositiveDefiniteError
from linattn.testing import assert_close, step_inputs

B, T, H, K, V = 1, 3, 2, 4, 4
# every op taking a log decay g (documented g <= 0); path_attn's is optional
LOG_DECAY_OPS = ["simple_gla", "gla", "gated_delta_rule", "comba", "gated_delta_product", "mesa_net",
                 "forgetting_attn", "path_attn"]
G_ERROR = r"must have values in \[-inf, 0\]"
MIXER_LAYERS = [name for name in list_mixers() if issubclass(mixer_class(name), MixerLayer)]


def _step_inputs(name: str) -> dict[str, torch.Tensor]:
    return step_inputs(name, B, H, K, V)


# --- log decays must be <= 0 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [1.0, math.nan])
@pytest.mark.parametrize("name", LOG_DECAY_OPS)
def test_op_refuses_positive_log_decay(name: str, bad: float) -> None:
    x = get_op(name).example_inputs(B, T, H, K, V)
    x["g"] = torch.full_like(x["g"], bad)
    with pytest.raises(ValueError, match="^g " + G_ERROR):
        get_op(name).fn(**x)


@pytest.mark.parametrize("name", LOG_DECAY_OPS)
def test_step_refuses_positive_log_decay(name: str) -> None:
    x = _step_inputs(name)
    x["g"] = torch.ones_like(x["g"])
    with pytest.raises(ValueError, match="^g " + G_ERROR):
        get_op(name).step(**x)


@pytest.mark.parametrize("name", LOG_DECAY_OPS)
def test_zero_log_decay_and_off_mode_still_run(name: str) -> None:
    x = get_op(name).example_inputs(B, T, H, K, V)
    x["g"] = torch.full_like(x["g"], -0.0)  # a layer's -exp()*softplus can round to -0.0 or 0.0
    get_op(name).fn(**x)
    x["g"] = torch.zeros_like(x["g"])
    get_op(name).fn(**x)
    x["g"] = torch.full_like(x["g"], 0.5)
    with value_checks("off"):  # the caller vouches for the range: not read
        get_op(name).fn(**x)


# --- a layer's backend and chunk_size are checked when it is built ----------------------------------------------

@pytest.mark.parametrize("name", MIXER_LAYERS)
def test_layer_refuses_unknown_backend(name: str) -> None:
    msg = r"^backend must be one of 'auto', 'recurrent', 'parallel', 'chunk', 'triton'; got 'foo'$"
    with pytest.raises(ValueError, match=msg):
        build_mixer(name, 16, 2, backend="foo")


@pytest.mark.parametrize("chunk_size", [0, 2**20, 16.0, True])
def test_layer_refuses_bad_chunk_size(chunk_size: object) -> None:
    with pytest.raises(ValueError, match=r"^chunk_size must be an int in \[1, 4096\]"):
        build_mixer("gated_delta_rule", 16, 2, chunk_size=chunk_size)


def test_layer_valid_backend_and_chunk_size_build() -> None:
    layer = build_mixer("gated_delta_rule", 16, 2, backend="recurrent", chunk_size=32)
    y, _ = layer(torch.randn(1, 5, 16))
    assert y.shape == (1, 5, 16)


# --- a decoding cache must carry the ShortConv states of the layer continuing it --------------------------------

def _lm(**mixer_kwargs: str) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(ModelConfig(mixer="gated_delta_rule", d_model=32, n_layers=1, n_heads=2, vocab_size=20,
                                mixer_kwargs=mixer_kwargs)).eval()


@pytest.mark.parametrize("maker, user, message", [
    ("", "qkv", r"the cache has no ShortConv state for stream 'q' \(it was made by a layer without a short conv "
                r"on it\)"),
    ("qkv", "", r"the cache has ShortConv state for stream 'q', which this layer does not convolve"),
])
def test_cache_with_mismatched_conv_states_refused(maker: str, user: str, message: str) -> None:
    made_by, used_by = _lm(short_conv=maker), _lm(short_conv=user)
    ids = torch.randint(0, 20, (1, 4))
    with torch.no_grad():
        _, cache = made_by(ids)
        with pytest.raises(ValueError, match=message):
            used_by(ids[:, :1], cache=cache)


def test_matching_and_fresh_caches_still_run() -> None:
    model = _lm()
    ids = torch.randint(0, 20, (1, 4))
    with torch.no_grad():
        full, _ = model(ids)
        _, cache = model(ids[:, :3])
        last, _ = model(ids[:, 3:], cache=cache)
        torch.testing.assert_close(last[:, 0], full[:, 3], rtol=1e-4, atol=1e-4)
        # an empty cache at offset 0 starts a sequence: it has no conv state yet, and needs none
        y, _ = build_mixer("gated_delta_rule", 32, 2)(torch.randn(1, 2, 32), LayerCache())
    assert y.shape == (1, 2, 32)


# --- mesa_net: a system that is not positive definite is named on every backend ---------------------------------

def _mesa_inputs_with_nan_key(T_: int = 4) -> dict[str, torch.Tensor]:
    x = get_op("mesa_net").example_inputs(B, T_, H, K, V)
    x["k"][0, T_ // 2, 0, 1] = math.nan
    return x


@pytest.mark.parametrize("solver", ["exact", "cg"])
@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_mesa_net_not_positive_definite_named(backend: str, solver: str) -> None:
    # a ValueError (bad inputs) that is still a LinAlgError for callers catching torch's
    assert issubclass(NotPositiveDefiniteError, ValueError) and issubclass(NotPositiveDefiniteError,
                                                                           torch.linalg.LinAlgError)
    with pytest.raises(NotPositiveDefiniteError, match=r"^mesa_net: G_t \+ diag\(lamb\) is not positive definite"):
        get_op("mesa_net").fn(**_mesa_inputs_with_nan_key(), backend=backend, solver=solver)


@pytest.mark.parametrize("solver", ["exact", "cg"])
def test_mesa_net_step_not_positive_definite_named(solver: str) -> None:
    x = _mesa_inputs_with_nan_key(1)
    x["k"][0, 0, 0, 1] = math.nan
    step = {"q": x["q"][:, 0], "k": x["k"][:, 0], "v": x["v"][:, 0], "g": x["g"][:, 0],
            "beta": x["beta"][:, 0], "lamb": x["lamb"]}
    with pytest.raises(NotPositiveDefiniteError, match=r"^mesa_net: G_t \+ diag\(lamb\) is not positive definite"):
        get_op("mesa_net").step(**step, solver=solver)


def _mesa_half_inputs(magnitude: float) -> dict[str, torch.Tensor]:
    x = get_op("mesa_net").example_inputs(B, 8, H, K, V, dtype=torch.float16)
    for name in ("q", "k", "v"):
        x[name] = (x[name].float() * magnitude).half()  # finite in float16 (|x| <= 65504)
    return x


@pytest.mark.parametrize("backend", ["recurrent", "parallel", "chunk"])
def test_mesa_net_large_float16_inputs(backend: str) -> None:
    """float16 inputs are solved in float32: large ones give the float32 result of the same values, and keys so
    large that G_t + diag(lamb) is singular to float32 precision raise the named error, not torch's."""
    x = _mesa_half_inputs(1e3)
    o = get_op("mesa_net").fn(**x, backend=backend)[0]
    o32 = get_op("mesa_net").fn(**{n: t.float() for n, t in x.items()}, backend=backend)[0]
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    assert_close(o.float(), o32, 1e-3, f"{backend}: float16 vs float32 on the same values")
    with pytest.raises(NotPositiveDefiniteError, match=r"keys so large that G_t dwarfs lamb beyond float32 precision"):
        get_op("mesa_net").fn(**_mesa_half_inputs(3e4), backend=backend)
