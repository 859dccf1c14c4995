"""python -m linattn.bench.host_cost: host time, kernel launches and PyTorch operations of an op's Triton path,
counted on the CPU with the launches intercepted (in a subprocess without the interpreter, whose kernels would run)."""

import os
import subprocess
import sys

import pytest

from linattn.bench import host_cost
from linattn.ops.common.triton_compat import triton_available
from linattn.ops.common.triton_utils import interpreting

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real kernels, launches intercepted
    return subprocess.run([sys.executable, "-m", "linattn.bench.host_cost", *args, "--repeats", "2"], env=env,
                          capture_output=True, text=True, timeout=300)


def _rows(*ops: str, first: str = "op") -> dict[str, list[str]]:
    out = _run(*ops)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].split() == [first, "host", "ms", "launches", "torch", "ops"]
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


def test_a_layers_launches_per_training_step():
    """--layers: one layer's share of a CausalLM training step on CUDA's choices. The delta-rule layers launch 18
    (delta_rule) and 20 (gated_delta_rule) Triton kernels a step, forward, the backward's rebuild of q, k, v and
    backward (q and k normalised together, the decay and beta from one kernel and not rebuilt). Either count changing
    is a change of the layers' fused path: more means a fused step came apart."""
    rows = _rows("--layers", "gated_delta_rule,delta_rule,softmax_attn", first="layer")
    assert list(rows) == ["gated_delta_rule", "delta_rule", "softmax_attn"]
    assert int(rows["gated_delta_rule"][1]) == 20 and int(rows["delta_rule"][1]) == 18, rows
    # (host ms is a difference of two noisy timings: a busy 2-core machine can make it negative, so it is not checked)
    assert int(rows["softmax_attn"][1]) == 0 and all(int(r[2]) > 0 for r in rows.values())


def test_layers_needs_a_mixer():
    out = _run("--layers", ",")
    assert out.returncode == 2 and "--layers: give at least one mixer name" in out.stderr


def test_titans_triton_path_makes_few_torch_operations():
    """titans' gate coefficients are kernels (one each way), not dozens of small PyTorch operations: its forward and
    backward make about as many operations as gated_delta_rule's (43 against 37 here; with the coefficients in
    PyTorch its forward alone made 64)."""
    rows = _rows("titans", "gated_delta_rule")
    assert list(rows) == ["titans", "gated_delta_rule"]
    (t_ms, t_launches, t_ops), (_, g_launches, g_ops) = rows["titans"], rows["gated_delta_rule"]
    assert int(t_launches) == 5, "forward, coefficients, state-gradient scan, per-chunk gradients, coefficients' bwd"
    assert int(g_launches) > 0 and float(t_ms) > 0
    assert int(t_ops) <= 1.25 * int(g_ops), rows


def test_the_backward_passs_operations_are_counted():
    """The backward pass's operations run under the autograd engine's events, not under other operations."""
    import torch

    x = torch.randn(3, requires_grad=True)
    forward = host_cost._top_level_ops(lambda: x.mul(2).sin().sum())
    both = host_cost._top_level_ops(lambda: x.mul(2).sin().sum().backward())
    assert forward == 3 and both >= forward + 3, (forward, both)


@pytest.mark.skipif(not interpreting(), reason="the interpreter is what the error is about")
def test_refuses_to_run_under_the_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        host_cost.host_cost("simple_gla", repeats=1)


def test_cuda_guards_turn_the_cpu_fast_path_off_and_back_on():
    import torch

    from linattn.ops.common import masking

    x = torch.ones(3, 2)
    A = torch.ones(2, 3, 3).tril()
    assert masking.all_finite_here(x)
    with host_cost.cuda_guards():
        assert not masking.all_finite_here(x)
        torch.testing.assert_close(masking.tril_matmul(A, x), A @ x)  # the branch-free form, same numbers
    assert masking.all_finite_here(x)
