"""Static decoding: for every mixer, steps on static buffers == the cached eager steps (fp32 1e-5) after an
odd-length prompt, also with rows at different positions (ragged prompts) and across TTT mini-batch ends;
buffers keep their addresses; the step reads no tensor value on the host and makes no CPU tensor (checked
on the meta device, where any such op shows up); StaticDecoder's checks."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from linattn.layers import list_mixers
from linattn.models import CausalLM, ModelConfig
from linattn.models.decode import StaticDecoder
from linattn.testing import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")
V = 50

# every mixer with its defaults, plus variants whose static step takes another branch
CONFIGS = [(name, {}) for name in list_mixers()] + [
    ("softmax_attn", {"window_size": 4, "n_kv_heads": 1}),
    ("forgetting_attn", {"rope_theta": 500.0, "window_size": 5}),
    ("path_attn", {"forget_gate": True}),
    ("ttt_linear", {"mini_batch_size": 4}),
    ("titans", {"mini_batch_size": 3}),
    ("linear_attn", {"normalize": False, "feature_map": "relu"}),
    ("retention", {"rope_theta": None}),
    ("gated_delta_product", {"use_gate": False, "num_householder": 3}),
    ("mesa_net", {"solver": "cg", "cg_steps": 4}),
    ("mamba2", {"conv_mode": "shift"}),
    ("lru", {"short_conv": "v"}),
]


def ids_of(config):
    name, kw = config
    return name + "".join(f"-{k}={v}" for k, v in kw.items())


def model_of(mixer, mixer_kwargs=None, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(mixer=mixer, d_model=32, n_layers=2, n_heads=2, vocab_size=V,
                      mixer_kwargs=dict(mixer_kwargs or {}), **kw)
    return CausalLM(cfg).eval()


@pytest.mark.parametrize("config", CONFIGS, ids=ids_of)
def test_static_steps_equal_cached_steps(config):
    """Prefill 7 tokens, then 6 steps: logits of the static step == the cached step; buffers stay in place."""
    model = model_of(*config)
    ids = torch.randint(0, V, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model(ids[:, :7])
        static = model.allocate_static_cache(3, 16)
        static.load(model, cache, torch.arange(3), 7)
        addresses = [x.data_ptr() for layer in static.layers for x in layer.buffers()]
        for t in range(7, 13):
            expected, cache = model(ids[:, t:t + 1], cache)
            got = model.static_step(ids[:, t], static)
            assert_close(got, expected[:, 0], 1e-5, f"{ids_of(config)}: static vs cached step at position {t}")
    assert static.pos.tolist() == [13] * 3
    assert [x.data_ptr() for layer in static.layers for x in layer.buffers()] == addresses


@pytest.mark.parametrize("mixer,kw", [("softmax_attn", {"n_kv_heads": 1}), ("forgetting_attn", {"window_size": 3}),
                                      ("retention", {}), ("ttt_linear", {"mini_batch_size": 4}),
                                      ("path_attn", {"forget_gate": True}), ("deltaformer", {}),
                                      ("gated_delta_rule", {})])
def test_rows_at_different_positions(mixer, kw):
    """Rows prefilled with 1, 6 and 9 tokens step together; each row == its own cached decoding."""
    model = model_of(mixer, kw)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=gen) for n in (1, 6, 9)]
    steps = torch.randint(0, V, (3, 5), generator=gen)
    decoder = StaticDecoder(model, 3, 14)
    with torch.no_grad():
        first = decoder.prefill(prompts)
        got = [first] + [decoder.step(steps[:, t]).clone() for t in range(5)]
        for row, p in enumerate(prompts):
            logits, cache = model(p[None])
            expected = [logits[:, -1]]
            for t in range(5):
                logits, cache = model(steps[row:row + 1, t:t + 1], cache)
                expected.append(logits[:, 0])
            for t, (g, e) in enumerate(zip(got, expected)):
                assert_close(g[row:row + 1], e, 1e-5, f"{mixer}: row {row} (prompt {len(p)}), step {t}")
    assert decoder.cache.pos.tolist() == [6, 11, 14]


def test_prefill_resets_the_buffers():
    """A second prefill on the same decoder gives what a fresh decoder gives (no state left over)."""
    model = model_of("path_attn")
    p = [torch.tensor([3, 4, 5]), torch.tensor([7])]
    decoder = StaticDecoder(model, 2, 8)
    with torch.no_grad():
        decoder.prefill([torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([9, 9])])
        decoder.step(torch.tensor([1, 2]))
        a = decoder.prefill(p).clone()
        a2 = decoder.step(torch.tensor([5, 6])).clone()
        fresh = StaticDecoder(model, 2, 8)
        b = fresh.prefill(p)
        b2 = fresh.step(torch.tensor([5, 6]))
    assert torch.equal(a, b) and torch.equal(a2, b2)


class _HostReads(TorchDispatchMode):
    """Records ops that read a tensor value on the host or touch a CPU tensor (with the model on the meta
    device, any CPU tensor in a step would be a host-to-device copy on CUDA)."""

    SYNCS = ("_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal")

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in self.SYNCS:
            self.found.append(str(func))
        out = func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs, out))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in flat):
            self.found.append(f"{func} on a CPU tensor")
        return out


def _static_step_on_meta(model):
    model = model.to("meta")
    cache = model.allocate_static_cache(2, 8)
    ids = torch.zeros(2, dtype=torch.long, device="meta")
    watch = _HostReads()
    try:
        with torch.no_grad(), watch:
            model.static_step(ids, cache)
    except RuntimeError as e:  # e.g. "Tensor.item() cannot be called on meta tensors"
        watch.found.append(f"error: {e}")
    return watch.found


@pytest.mark.parametrize("config", CONFIGS, ids=ids_of)
def test_static_step_reads_nothing_on_the_host(config):
    """What a CUDA graph needs: no host read of a tensor value, no tensor made on the CPU."""
    assert _static_step_on_meta(model_of(*config)) == []


def test_host_read_detector_catches_a_sync_and_a_host_tensor(monkeypatch):
    from linattn.layers import decay

    model = model_of("retention", {"rope_theta": None})
    monkeypatch.setattr(decay.RetNetLayer, "skip", lambda self, o, v: o + torch.ones(1).to(o.device))
    assert any("CPU" in f for f in _static_step_on_meta(model))
    monkeypatch.setattr(decay.RetNetLayer, "skip", lambda self, o, v: o * float(o.sum() > 0))
    assert _static_step_on_meta(model_of("retention", {"rope_theta": None}))


def test_decoder_checks():
    model = model_of("gated_delta_rule")
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        StaticDecoder(model, 2, 0)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs the model on a CUDA device"):
        StaticDecoder(model, 2, 8, use_cuda_graph=True)
    with pytest.raises(TypeError, match="model must be a CausalLM"):
        StaticDecoder(torch.nn.Linear(2, 2), 2, 8)
    decoder = StaticDecoder(model, 2, 4)
    with pytest.raises(ValueError, match="expected 2 prompts"):
        decoder.prefill([torch.tensor([1])])
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty 1-D integer tensor"):
        decoder.prefill([torch.tensor([1]), torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="a prompt of 5 tokens does not fit max_length=4"):
        decoder.prefill([torch.tensor([1]), torch.arange(5)])
    decoder.prefill([torch.tensor([1, 2, 3]), torch.tensor([4])])
    with pytest.raises(ValueError, match=r"token_ids must be an integer tensor \[B\] with B = 2"):
        decoder.step(torch.tensor([1, 2, 3]))
    decoder.step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="the static cache is full"):
        decoder.step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="a static decoding step takes one token per row"):
        model.blocks[0].mixer(torch.randn(2, 2, 32), decoder.cache.layers[0])


def test_decode_bench_static_path(tmp_path, capsys):
    import json

    from linattn.cli import main
    from linattn.models.decode_bench import decode_cost_ratio

    r = decode_cost_ratio("forgetting_attn", short_context=3, long_context=9, new_tokens=2, d_model=16, n_layers=1,
                          n_heads=2, vocab_size=20, batch_size=2, path="static")
    assert r["path"] == "static" and r["ms_per_token_long"] > 0 and r["tokens_per_s_long"] > 0
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--mixers", "mamba2", "--short", "3", "--long", "6", "--tokens", "2",
                 "--d-model", "16", "--layers", "1", "--path", "both", "--out", str(out)]) == 0
    assert "| mamba2 | static |" in capsys.readouterr().out
    assert [row["path"] for row in json.loads(out.read_text())["rows"]] == ["eager", "static"]


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["gated_delta_rule", "softmax_attn"])
def test_compiled_static_step_equals_the_plain_one(mixer):
    """StaticDecoder(compile=True): torch.compile'd steps (tens of seconds of compilation on the CPU)."""
    torch._dynamo.reset()
    model = model_of(mixer)
    prompts = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7])]
    plain, compiled = StaticDecoder(model, 2, 12), StaticDecoder(model, 2, 12, compile=True)
    with torch.no_grad():
        assert_close(compiled.prefill(prompts), plain.prefill(prompts), 1e-6, f"{mixer}: prefill")
        for t in range(4):
            ids = torch.tensor([t, 2 * t])
            assert_close(compiled.step(ids), plain.step(ids), 1e-5, f"{mixer}: compiled static step {t}")


def test_bench_model_static_decode_path(tmp_path):
    import json

    from linattn.cli import main

    out = tmp_path / "model.json"
    assert main(["bench", "model", "--d-model", "32", "--layers", "1", "--heads", "2", "--vocab", "64", "--mixers",
                 "gla", "--no-train", "--decode-batch", "2", "--decode-context", "5", "--decode-tokens", "2",
                 "--decode-path", "static", "--no-progress", "--out", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["kind"] == "decode"]
    assert {r["mixer"] for r in rows} == {"softmax_attn", "gla"}
    assert all(r["path"] == "static" and r["error"] is None and r["tokens_per_s"] > 0 for r in rows)


def test_only_mesa_nets_exact_solver_is_marked_uncapturable():
    """StaticDecoder captures a CUDA graph only when every layer's step allows it (MesaNet's exact solver does not)."""
    from linattn.layers import build_mixer

    assert not build_mixer("mesa_net", 32, 2).graph_capturable
    assert build_mixer("mesa_net", 32, 2, solver="cg").graph_capturable
    assert all(build_mixer(m, 32, 2).graph_capturable for m in ("gated_delta_rule", "softmax_attn", "mamba2"))
