"""The launch key of FastKernel (the first part of its plan) is at least as fine as Triton's specialisation: what
changes the compiled kernel (constexprs, options, dtypes, 16-byte alignment, ints equal to 1 or divisible by 16,
widths) changes the key,
and what Triton does not specialise on (a do_not_specialize int's value) does not."""

import pytest
import torch

from linattn.ops.common.triton_compat import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]


def _kernel():
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def k(x, y, n, T, s, FLAG: tl.constexpr, BLOCK: tl.constexpr):
        pass

    return JITFunction(k, do_not_specialize=["T"])


def test_key_separates_what_triton_specialises_on(monkeypatch):
    from linattn.ops.common.triton_launch import FastKernel

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the key names the device; none here

    fk = FastKernel(_kernel())
    assert fk.direct
    x = torch.zeros(64)
    base = [x, x, 32, 100, 0.5, True, 16]
    def key(values, options=(("num_warps", 4),)):
        plan = fk._plan(values, options)
        return None if plan is None else plan[0]

    k0 = key(base)
    assert key(list(base)) == k0
    changed = {
        "dtype": [x.half(), x, 32, 100, 0.5, True, 16],
        "alignment": [x[1:], x, 32, 100, 0.5, True, 16],
        "int == 1": [x, x, 1, 100, 0.5, True, 16],
        "int % 16": [x, x, 33, 100, 0.5, True, 16],
        "int width": [x, x, 2**40, 100, 0.5, True, 16],
        "constexpr": [x, x, 32, 100, 0.5, False, 16],
        "constexpr 2": [x, x, 32, 100, 0.5, True, 32],
        "None pointer": [x, None, 32, 100, 0.5, True, 16],
    }
    for what, values in changed.items():
        assert key(values) != k0, what
    assert key(base, (("num_warps", 8),)) != k0, "launch options"
    assert key([x, x, 32, 101, 0.5, True, 16]) == k0, "T is not specialised on: its value is not in the key"
    assert key([x, x, 32, 2**40, 0.5, True, 16]) != k0, "but its width is"
    assert key([x, x, 32, 100, 0.25, True, 16]) == k0, "floats are not specialised on"
    assert key([x, x, 32, 100, "a string", True, 16]) is None, "kinds the key does not cover go through Triton"


def test_the_launcher_gets_each_tensor_as_its_address(monkeypatch):
    """The kept kernel's launcher takes a tensor's address as an int (no data_ptr call and no driver query per
    pointer); every other value as given; and the key tells CUDA tensors from others."""
    from linattn.ops.common.triton_launch import FastKernel

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fk = FastKernel(_kernel())
    x, y = torch.zeros(64), torch.ones(8)[1:]
    key, raw = fk._plan([x, y, 32, 100, 0.5, True, 16], (("num_warps", 4),))
    assert raw == [x.data_ptr(), y.data_ptr(), 32, 100, 0.5, True, 16]
    assert all(type(r) is int for r in raw[:2])
    assert (torch.float32, True, False) in key and (torch.float32, False, False) in key, "dtype, alignment, is_cuda"


def test_bind_orders_keyword_arguments_and_separates_options():
    from linattn.ops.common.triton_launch import FastKernel

    fk = FastKernel(_kernel())
    x = torch.zeros(4)
    values, options = fk._bind((x,), dict(y=x, n=3, T=5, s=0.5, FLAG=True, BLOCK=16, num_warps=4))
    assert values == [x, x, 3, 5, 0.5, True, 16] and options == (("num_warps", 4),)
    assert fk._bind((x,), dict(y=x))[0] is None, "a missing parameter leaves the launch to Triton"
    keywords = dict(x=x, y=x, n=3, T=5, s=0.5, FLAG=True, BLOCK=16)
    assert fk._bind((), keywords) == ([x, x, 3, 5, 0.5, True, 16], ())
    assert fk._bind((), {**keywords, "num_warps": 4}) == ([x, x, 3, 5, 0.5, True, 16], (("num_warps", 4),))
    assert fk._bind((), dict(y=x))[0] is None


def test_bind_gives_a_left_out_parameter_its_default():
    """A launch that leaves a defaulted parameter out still takes the kept kernel (its default is bound, as Triton
    binds it), not Triton's slow path on every call."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from linattn.ops.common.triton_launch import FastKernel

    def k(x, n, FLAG: tl.constexpr, BLOCK: tl.constexpr = 16):
        pass

    fk = FastKernel(JITFunction(k))
    x = torch.zeros(4)
    assert fk._bind((), dict(x=x, n=3, FLAG=True)) == ([x, 3, True, 16], ())
    assert fk._bind((), dict(x=x, n=3, FLAG=True, num_warps=2)) == ([x, 3, True, 16], (("num_warps", 2),))
    assert fk._bind((x,), dict(n=3, FLAG=True, BLOCK=32)) == ([x, 3, True, 32], ())
    assert fk._bind((), dict(x=x, n=3))[0] is None, "FLAG has no default: the launch is left to Triton"


def test_repeated_launches_give_the_first_launchs_values():
    """The first launch of a key goes through Triton, later ones through the kept kernel (on a GPU; under
    TRITON_INTERPRET=1 all through Triton): same values, also after the alignment of the input changes."""
    from linattn.layers.norms_triton import l2norm_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(65, 8, device=device)
    ref = torch.nn.functional.normalize(x, dim=-1)
    for _ in range(3):
        assert torch.allclose(l2norm_triton(x, 1e-6), ref, atol=1e-6)
    flat = torch.randn(65 * 8 + 1, device=device)
    shifted = flat[1:].view(65, 8)  # 4 bytes past an aligned address: a new key
    assert torch.allclose(l2norm_triton(shifted, 1e-6), torch.nn.functional.normalize(shifted, dim=-1), atol=1e-6)


def test_an_empty_hook_chain_is_no_hook(monkeypatch):
    """Newer Triton always has a (usually empty) chain of launch hooks: only a chain with a hook in it, or a
    hook function (older Triton), sends launches through Triton."""
    import triton

    from linattn.ops.common.triton_launch import launch_hooks_set

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not launch_hooks_set(), "by default no hook is installed: launches take the direct path"
    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "launch_enter_hook", Chain([]), raising=False)
    monkeypatch.setattr(runtime, "launch_exit_hook", None, raising=False)
    assert not launch_hooks_set()
    monkeypatch.setattr(runtime, "launch_exit_hook", Chain([print]), raising=False)
    assert launch_hooks_set()
    monkeypatch.setattr(runtime, "launch_exit_hook", None, raising=False)
    monkeypatch.setattr(runtime, "launch_enter_hook", print, raising=False)
    assert launch_hooks_set()


def test_grid_slices_cover_an_axis_in_launches_of_at_most_the_limit() -> None:
    from linattn.ops.common.batch_slices import GRID_LIMIT
    from linattn.ops.common.triton_utils import grid_slices

    assert GRID_LIMIT == 65535  # CUDA's cap on a grid's second and third axes
    assert grid_slices(1) == [(0, 1)] and grid_slices(65535) == [(0, 65535)]
    assert grid_slices(65536) == [(0, 65535), (65535, 1)]
    assert grid_slices(200000) == [(0, 65535), (65535, 65535), (131070, 65535), (196605, 3395)]
