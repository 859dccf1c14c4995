"""What the layers keep for the backward pass: with ShortConvs, the conv outputs and q, k, v made of them are
recomputed in the backward pass (layers/base.py, ConvOutputs) and the output norm's result is (layers/norms.py,
norm_gate_project); the gradients are those of autograd keeping them, bit for bit, on the PyTorch and the Triton
backends, under autocast, and with packed sequences.

The Triton cases run on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

import linattn
from linattn.layers.base import MixerLayer, storage_layout
from linattn.layers.registry import list_mixers, mixer_class
from linattn.ops.common.triton_compat import triton_available

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CONV_MIXERS = [m for m in list_mixers() if issubclass(mixer_class(m), MixerLayer)
               and mixer_class(m).default_short_conv and mixer_class(m).streams is MixerLayer.streams]


def _grads(layer, x, recompute: bool, monkeypatch, **kw):
    monkeypatch.setattr(MixerLayer, "recomputes_conv_outputs",
                        (lambda self, cache: MixerLayer.__dict__["_orig"](self, cache)) if recompute
                        else (lambda self, cache: False))
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y, _ = layer(x, use_cache=False, **kw)
    y.float().square().sum().backward()
    return [y.detach(), x.grad, *[p.grad for p in layer.parameters()]]


@pytest.fixture(autouse=True)
def _orig(monkeypatch):
    monkeypatch.setattr(MixerLayer, "_orig", MixerLayer.recomputes_conv_outputs, raising=False)


@pytest.mark.parametrize("mixer", CONV_MIXERS)
def test_recomputed_conv_outputs_give_the_same_gradients(mixer, monkeypatch):
    torch.manual_seed(0)
    layer = mixer_class(mixer)(32, 2)
    x = torch.randn(2, 37, 32)
    assert layer.recomputes_conv_outputs(None) and not layer.recomputes_conv_outputs(object())
    kept, recomputed = (_grads(layer, x, r, monkeypatch) for r in (False, True))
    for a, b in zip(kept, recomputed):
        assert (a is None and b is None) or torch.equal(a, b)


def _grad_mode_conv_backend(x: torch.Tensor) -> str:
    """ShortConv's "auto" as on CUDA, with the multiply-adds for Triton: conv1d when gradients are wanted, another
    backend (and another output layout) otherwise."""
    return "conv1d" if torch.is_grad_enabled() and x.requires_grad else "muladd"


@pytest.mark.parametrize("mixer", CONV_MIXERS)
def test_recomputed_with_a_grad_mode_dependent_conv_backend(mixer, monkeypatch):
    """The recompute makes the forward's backend choices: on CUDA, ShortConv's "auto" takes conv1d for small inputs
    that need gradients and the Triton kernels without gradients, whose outputs lie in other storage layouts."""
    monkeypatch.setattr("linattn.layers.shortconv.auto_backend", _grad_mode_conv_backend)
    torch.manual_seed(0)
    layer = mixer_class(mixer)(32, 2)
    x = torch.randn(2, 37, 32)
    kept, recomputed = (_grads(layer, x, r, monkeypatch) for r in (False, True))
    for a, b in zip(kept, recomputed):
        assert (a is None and b is None) or torch.equal(a, b)


def test_a_recompute_laid_out_otherwise_is_an_error(monkeypatch):
    """A recomputed tensor in another storage layout than the forward's is an error, not wrong gradients."""
    in_backward = []

    def conv1d_then_muladd(x: torch.Tensor) -> str:
        return "muladd" if in_backward else "conv1d"

    monkeypatch.setattr("linattn.layers.shortconv.auto_backend", conv1d_then_muladd)
    layer = mixer_class("gated_delta_rule")(32, 2)
    y, _ = layer(torch.randn(2, 37, 32), use_cache=False)
    in_backward.append(True)
    with pytest.raises(RuntimeError, match="recomputed tensor 0 of the backward pass has layout"):
        y.square().sum().backward()


@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("mixer", ["gated_delta_rule", "mamba2", "comba"])
@pytest.mark.parametrize("packed", [False, True])
def test_recomputed_on_the_triton_backends_under_autocast(mixer, packed, monkeypatch):
    torch.manual_seed(0)
    layer = mixer_class(mixer)(32, 2, head_dim=16).to(DEVICE)
    B, kw = (1, {"cu_seqlens": torch.tensor([0, 20, 70], device=DEVICE)}) if packed else (2, {})
    x = torch.randn(B, 70, 32, device=DEVICE)
    with linattn.settings(op_backend="triton", shortconv_backend="triton", fused_backend="triton"), \
            torch.autocast(DEVICE, dtype=torch.bfloat16):
        kept, recomputed = (_grads(layer, x, r, monkeypatch, **kw) for r in (False, True))
    for a, b in zip(kept, recomputed):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("mixer", CONV_MIXERS)
def test_rebuilt_qkv_are_the_op_inputs(mixer):
    """What a layer declares of its q and k feature maps (``qk_feature_map``, read by the backward's rebuild to skip
    the token arguments) is what its mix_inputs does: the same q, k, v bit for bit, with tied keys and values too."""
    torch.manual_seed(0)
    cls = mixer_class(mixer)
    for kw in ({}, {"tie_kv": "exact", "short_conv": cls.default_short_conv.replace("v", "")}):
        try:
            layer = cls(32, 2, head_dim=16, **kw).to(DEVICE)
        except ValueError:  # a layer without tied keys and values
            continue
        x = torch.randn(2, 19, 32, device=DEVICE)
        s, _ = layer.streams(x, None)
        want = layer.op_inputs(x, s, 0, None)[:3]
        got = layer.rebuilt_qkv(x, s, 0, None)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and storage_layout(a) == storage_layout(b) and torch.equal(a, b), mixer


def test_a_subclass_with_its_own_mix_inputs_gets_the_full_rebuild(monkeypatch):
    """A declaration counts only beside the mix_inputs it describes: a subclass that changes q without saying so is
    rebuilt through its own mix_inputs, and its gradients equal those of autograd keeping q, k, v."""
    from linattn.layers.base import declared_qk_feature_map
    from linattn.layers.delta import GatedDeltaNetLayer

    class Scaled(GatedDeltaNetLayer):
        def mix_inputs(self, x, q, k, v, offset, streams):
            q, k, v, args, kw = super().mix_inputs(x, q, k, v, offset, streams)
            return 2 * q, k, v, args, kw

    assert declared_qk_feature_map(GatedDeltaNetLayer) == "l2" and declared_qk_feature_map(Scaled) is None
    torch.manual_seed(0)
    layer = Scaled(32, 2, head_dim=16).to(DEVICE)
    x = torch.randn(2, 19, 32, device=DEVICE)
    s, _ = layer.streams(x, None)
    assert torch.equal(layer.rebuilt_qkv(x, s, 0, None)[0], layer.op_inputs(x, s, 0, None)[0])
    kept, recomputed = (_grads(layer, x, r, monkeypatch) for r in (False, True))
    for a, b in zip(kept, recomputed):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_backward_after_the_settings_block_rebuilds_as_the_forward_did():
    """A backward pass run after the ``linattn.settings`` block of its forward, under other ShortConv and fused
    kernel settings: the rebuild makes the forward's choices (Triton's joint conv, whose outputs conv1d would lay out
    otherwise) and the gradients are those of a backward inside the block, bit for bit; the settings in force are
    left as they were."""
    torch.manual_seed(0)
    layer = mixer_class("gated_delta_rule")(32, 2, head_dim=16).to(DEVICE)
    x = torch.randn(2, 37, 32, device=DEVICE)
    grads = []
    for inside in (True, False):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        with linattn.settings(shortconv_backend="triton", fused_backend="triton"):
            y, _ = layer(xi, use_cache=False)
            if inside:
                y.square().sum().backward()
        if not inside:
            with linattn.settings(shortconv_backend="conv1d", fused_backend="torch"):
                y.square().sum().backward()
                assert linattn.current().shortconv_backend == "conv1d"
        grads.append([xi.grad, *[p.grad for p in layer.parameters()]])
    for a, b in zip(*grads):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.triton
@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_what_a_conv_layer_keeps():
    """gated_delta_rule keeps its input, the joint projection (the ShortConvs' input), the output norm's input and
    gate, and the op's small tensors: no conv output, no q, k, v."""
    from linattn.bench.saved_tensors import record_saved

    torch.manual_seed(0)
    layer = mixer_class("gated_delta_rule")(32, 2).to(DEVICE)
    x = torch.randn(2, 37, 32, device=DEVICE, requires_grad=True) * 1  # not a leaf: a block's input
    with linattn.settings(op_backend="triton", shortconv_backend="triton", fused_backend="triton"):
        saved = [s for s in record_saved(layer, lambda: layer(x, use_cache=False)[0]) if not s.weight]
    big = sorted(s.nbytes // 4 for s in saved if s.nbytes >= 2 * 37 * 32 * 4)
    # x, o and the gate (2 x 37 x 32 each), the joint projection (32 * 3 + 2 + 2 wide), the op's Tm (chunks of 64)
    assert big == [2 * 37 * 32] * 3 + [2 * 37 * 100, 2 * 37 * 2 * 64], big


@pytest.mark.parametrize("reentrant", [False, True])
def test_inside_activation_checkpointing(reentrant):
    """A layer run under torch.utils.checkpoint (the hooks nest) gives the gradients of a plain run."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = mixer_class("gated_delta_rule")(32, 2)
    x0 = torch.randn(2, 37, 32)
    grads = []
    for ck in (False, True):
        layer.zero_grad()
        x = x0.clone().requires_grad_(True)
        run = lambda t: layer(t, use_cache=False)[0]  # noqa: E731
        y = checkpoint(run, x, use_reentrant=reentrant) if ck else run(x)
        y.square().sum().backward()
        grads.append([x.grad, *[p.grad for p in layer.parameters()]])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_compiling_is_asked_before_the_conv_container(monkeypatch):
    """Under torch.compile the recompute is off, and the answer must not come from the ShortConv ModuleDict's truth
    value: Dynamo in torch 2.11 broke the graph on bool(ModuleDict), once in every layer of every model."""
    layer = mixer_class("gated_delta_rule")(32, 2)
    assert layer.recomputes_conv_outputs(None)

    def untraceable(self):
        raise AssertionError("the ModuleDict's size was read while compiling")

    monkeypatch.setattr(torch.nn.ModuleDict, "__len__", untraceable)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not layer.recomputes_conv_outputs(None)


GATED_MIXERS = [m for m in list_mixers()
                if issubclass(mixer_class(m), MixerLayer) and mixer_class(m).default_output_gate]


@pytest.mark.parametrize("mixer, kwargs", [(m, {}) for m in GATED_MIXERS] + [("mamba2", {"norm_groups": 2})],
                         ids=[*GATED_MIXERS, "mamba2-groups"])
def test_recomputed_output_gate(mixer, kwargs):
    """recompute_output_gate: the same output and gradients, bit for bit, and the gate's projection (B T H V
    values) no longer kept for the backward pass."""
    from linattn.bench.saved_tensors import record_saved

    x0 = torch.randn(2, 37, 32)
    runs = []
    for recompute in (False, True):
        torch.manual_seed(0)
        layer = mixer_class(mixer)(32, 2, recompute_output_gate=recompute, **kwargs)
        x = x0.clone().requires_grad_(True)
        saved = record_saved(layer, lambda layer=layer, x=x: layer(x * 1, use_cache=False)[0])
        kept = sum(s.nbytes for s in saved if not s.weight)
        y, _ = layer(x * 1, use_cache=False)
        y.square().sum().backward()
        runs.append((kept, [y, x.grad, *[p.grad for p in layer.parameters()]]))
    (kept, plain), (kept_recomputed, recomputed) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))
    gate_bytes = 2 * 37 * layer.n_heads * layer.head_dim_v * 4
    assert kept - kept_recomputed >= gate_bytes, (kept, kept_recomputed, gate_bytes)


def test_recompute_output_gate_must_be_a_bool():
    with pytest.raises(TypeError, match="recompute_output_gate must be a bool"):
        mixer_class("gated_delta_rule")(32, 2, recompute_output_gate="yes")
