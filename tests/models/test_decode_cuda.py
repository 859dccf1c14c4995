"""On a GPU only: StaticDecoder's CUDA graph == the same static step run eagerly == the cached path, for every
mixer; the graph serves a second prefill; greedy tokens of generate equal the eager path's in bf16.
(Skipped without CUDA: the CUDA graph cannot be captured on the CPU.)"""

import pytest
import torch

from linattn.layers import list_mixers
from linattn.models import CausalLM, ModelConfig
from linattn.models.decode import StaticDecoder
from linattn.testing import assert_close

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
V = 64


def model_of(mixer, d_model=64, dtype=torch.float32, seed=0, **mixer_kwargs):
    torch.manual_seed(seed)
    cfg = ModelConfig(mixer=mixer, d_model=d_model, n_layers=2, n_heads=4, vocab_size=V, mixer_kwargs=mixer_kwargs)
    return CausalLM(cfg).to(device="cuda", dtype=dtype).eval()


@pytest.mark.parametrize("mixer", list_mixers())
def test_graph_replays_equal_eager_static_and_cached_steps(mixer):
    # MesaNet's exact solver cannot be captured (test_mesa_net_exact_solver_decodes_without_a_graph): cg here
    model = model_of(mixer, **({"solver": "cg", "cg_steps": 16} if mixer == "mesa_net" else {}))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=gen).cuda() for n in (7, 3)]
    steps = torch.randint(0, V, (2, 6), generator=gen).cuda()
    graph, plain = StaticDecoder(model, 2, 16), StaticDecoder(model, 2, 16, use_cuda_graph=False)
    assert graph.use_cuda_graph and graph._graph is not None
    with torch.no_grad():
        for round_ in range(2):  # the second prefill reuses the captured graph
            assert_close(graph.prefill(prompts), plain.prefill(prompts), 1e-6, f"{mixer}: prefill")
            caches = [model(p[None]) for p in prompts]
            caches = [c for _, c in caches]
            for t in range(6):
                got, expected = graph.step(steps[:, t]).clone(), plain.step(steps[:, t])
                assert_close(got, expected, 1e-5, f"{mixer}: graph vs eager static step {t} (round {round_})")
                for row in range(2):
                    out, caches[row] = model(steps[row:row + 1, t:t + 1], caches[row])
                    assert_close(got[row:row + 1], out[:, 0], 1e-4, f"{mixer}: graph vs cached step {t}, row {row}")
            steps = steps.flip(0)


@pytest.mark.parametrize("mixer", ["gated_delta_rule", "mamba2", "gla", "delta_rule"])
def test_greedy_tokens_equal_the_eager_path_in_bf16(mixer):
    """The recurrent mixers run the same kernels on both paths (the fused op and ShortConv steps, the fused
    norms), so their tokens agree exactly. (The softmax family's static attention reads its buffer through SDPA,
    the cached path through an explicit softmax: equal to float32 rounding, not bit for bit.)"""
    model = model_of(mixer, d_model=256, dtype=torch.bfloat16)
    ids = torch.randint(0, V, (4, 33), generator=torch.Generator().manual_seed(2)).cuda()
    static = model.generate(ids, 48)
    eager = model.generate(ids, 48, static=False)
    assert torch.equal(static, eager), f"{mixer}: greedy tokens of the CUDA-graph path differ from the eager path"


def test_mesa_net_exact_solver_decodes_without_a_graph():
    model = model_of("mesa_net")
    assert not StaticDecoder(model, 2, 16).use_cuda_graph, "the default falls back to the eager static step"
    with pytest.raises(ValueError, match="MesaNetLayer cannot be captured in a CUDA graph"):
        StaticDecoder(model, 2, 16, use_cuda_graph=True)
