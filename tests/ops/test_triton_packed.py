"""Packed sequences run natively by the chunked Triton kernels (the delta and GLA families): one call on the
packed tokens where they lie, chunk by chunk, gives the outputs, final states and gradients (q, k, v, gates, beta,
p, initial states) of running each sequence alone; odd lengths, lengths shorter than a chunk, one sequence, with
and without initial states; fp32 and bf16. Offsets with the same number of chunks launch the same compiled
kernels.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

import linattn.ops.common.varlen as varlen
from linattn import settings
from linattn.ops import get_op
from linattn.ops.common.packed_call import Packing, chunk_layout
from linattn.ops.common.triton_compat import triton_available
from linattn.testing import assert_close, assert_same_gradients

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NATIVE = ["gated_delta_rule", "delta_rule", "comba", "gated_delta_product", "simple_gla", "gla", "retention"]
H, K, V, CHUNK = 2, 16, 16, 16


def _cu(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _inputs(name: str, T: int, dtype: torch.dtype, seed: int = 3) -> dict[str, torch.Tensor]:
    spec = get_op(name)
    return {a: x.to(DEVICE, dtype if a in ("q", "k", "v", "p") else torch.float32).requires_grad_()
            for a, x in spec.example_inputs(1, T, H, K, V, seed=seed).items()}


def _loss(o: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Reads every output and state entry with distinct weights (a misplaced gradient shows)."""
    wo = torch.linspace(-1, 1, o.numel(), device=o.device).reshape(o.shape)
    ws = torch.linspace(0.5, -0.5, state.numel(), device=state.device).reshape(state.shape)
    return (o.float() * wo).sum() + (state * ws).sum()


def _packed_and_separate(name: str, lengths: tuple[int, ...], dtype: torch.dtype, with_state: bool):
    spec = get_op(name)
    T, N = sum(lengths), len(lengths)
    inputs = _inputs(name, T, dtype)
    gen = torch.Generator().manual_seed(11)
    init = torch.randn(N, H, K, V, generator=gen).to(DEVICE).requires_grad_() if with_state else None
    cu = _cu(lengths)
    kw = dict(backend="triton", chunk_size=CHUNK, output_final_state=True)
    assert spec.packs_natively({**inputs, **kw})
    o, final = spec.fn(**inputs, initial_state=init, cu_seqlens=cu, **kw)
    outs, finals = [], []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        # token arguments have time at dim 1 (m positions per token: gated_delta_product's keys, values, beta)
        alone = {a: x[:, s * (x.shape[1] // T):e * (x.shape[1] // T)] for a, x in inputs.items()}
        o_i, f_i = spec.fn(**alone, initial_state=None if init is None else init[i:i + 1], **kw)
        outs.append(o_i)
        finals.append(f_i)
    leaves = list(inputs.values()) + ([init] if with_state else [])
    return (o, final), (torch.cat(outs, dim=1), torch.cat(finals, dim=0)), leaves


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("lengths", [(5, 1, 37, 16), (23,), (3, 7)], ids=["mixed", "one", "short"])
@pytest.mark.parametrize("name", NATIVE)
def test_packed_equals_separate_fp32(name: str, lengths: tuple[int, ...], with_state: bool) -> None:
    (o, final), (o_ref, final_ref), leaves = _packed_and_separate(name, lengths, torch.float32, with_state)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, final_ref, rtol=1e-5, atol=1e-5)
    assert_same_gradients(_loss(o, final), _loss(o_ref, final_ref), leaves, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gated_delta_rule", "comba", "simple_gla", "gla"])
def test_packed_equals_separate_bf16(name: str) -> None:
    """Under the bf16 tolerances of the Triton tests (tests/ops/test_triton_delta.py): rmse 5e-3, gradients 1e-2."""
    (o, final), (o_ref, final_ref), leaves = _packed_and_separate(name, (5, 1, 37), torch.bfloat16, True)
    assert_close(o.float(), o_ref.float(), 5e-3, "output", metric="rmse")
    assert_close(final, final_ref, 5e-3, "final state", metric="rmse")
    got = torch.autograd.grad(_loss(o, final), leaves)
    want = torch.autograd.grad(_loss(o_ref, final_ref), leaves)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_close(a.float(), b.float(), 1e-2, f"gradient {i}", metric="rmse")


@pytest.mark.parametrize("name", ["gated_delta_rule", "simple_gla"])
def test_one_sequence_packed_equals_the_unpacked_call(name: str) -> None:
    spec = get_op(name)
    inputs = _inputs(name, 21, torch.float32)
    kw = dict(backend="triton", chunk_size=CHUNK, output_final_state=True)
    o, s = spec.fn(**inputs, cu_seqlens=_cu((21,)), **kw)
    o2, s2 = spec.fn(**inputs, **kw)
    torch.testing.assert_close(o, o2, rtol=0, atol=1e-6)
    torch.testing.assert_close(s, s2, rtol=0, atol=1e-6)


def test_native_path_runs_once_and_other_backends_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend="triton" runs one call on the packed inputs; backend="chunk" keeps the per-sequence path."""
    calls = {"native": 0, "split": 0}
    native, split = varlen.run_native, varlen.run_packed

    def count(kind, fn):
        def run(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(varlen, "run_native", count("native", native))
    monkeypatch.setattr(varlen, "run_packed", count("split", split))
    spec = get_op("gla")
    inputs = _inputs("gla", 20, torch.float32)
    spec.fn(**inputs, cu_seqlens=_cu((4, 16)), backend="triton", chunk_size=CHUNK)
    spec.fn(**inputs, cu_seqlens=_cu((4, 16)), backend="chunk", chunk_size=CHUNK)
    assert calls == {"native": 1, "split": 1}


def test_simple_gla_packed_in_smaller_kernel_chunks() -> None:
    """float32 simple_gla with K > 128 runs its kernels on chunks of 32 tokens when asked for 64: each packed chunk
    splits in two (the second empty past a sequence's end), and packed still equals separate."""
    spec = get_op("simple_gla")
    lengths, K_wide = (5, 1, 70, 33), 144
    T = sum(lengths)
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, T, H, K_wide, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen).to(DEVICE).requires_grad_()
    g = (-torch.rand(1, T, H, generator=gen)).to(DEVICE).requires_grad_()
    init = torch.randn(len(lengths), H, K_wide, V, generator=gen).to(DEVICE).requires_grad_()
    kw = dict(backend="triton", chunk_size=64, output_final_state=True)
    cu = _cu(lengths)
    o, final = spec.fn(q, k, v, g, initial_state=init, cu_seqlens=cu, **kw)
    pieces = [spec.fn(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], initial_state=init[i:i + 1], **kw)
              for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))]
    o_ref, final_ref = torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 0)
    # unnormalised keys of width 144 give gate gradients up to ~33, summed over a sequence in another order on
    # each side: the float32 standard (error over the tensor's largest value) rather than elementwise 1e-5
    assert_close(o, o_ref, 1e-5, "output")
    assert_close(final, final_ref, 1e-5, "final state")
    got = torch.autograd.grad(_loss(o, final), [q, k, v, g, init])
    want = torch.autograd.grad(_loss(o_ref, final_ref), [q, k, v, g, init])
    for name, a, b in zip("q k v g initial_state".split(), got, want, strict=True):
        assert_close(a, b, 1e-5, f"gradient of {name}")


def test_bad_states_are_named_on_the_native_path() -> None:
    spec = get_op("gated_delta_rule")
    inputs = _inputs("gated_delta_rule", 20, torch.float32)
    with pytest.raises(ValueError, match=r"initial_state with cu_seqlens must have N = 2 sequences along dim 0"):
        spec.fn(**inputs, cu_seqlens=_cu((4, 16)), initial_state=torch.zeros(3, H, K, V, device=DEVICE),
                backend="triton", chunk_size=CHUNK)
    with pytest.raises(ValueError, match=r"initial_state must have shape"):
        spec.fn(**inputs, cu_seqlens=_cu((4, 16)), initial_state=torch.zeros(2, H, K + 1, V, device=DEVICE),
                backend="triton", chunk_size=CHUNK)
    with pytest.raises(ValueError, match=r"cu_seqlens must be strictly increasing"):
        spec.fn(**inputs, cu_seqlens=_cu((4, 0, 16)), backend="triton", chunk_size=CHUNK)


def test_chunk_layout() -> None:
    """Sequence n's chunks start at cu_chunks[n]; each chunk's first token and token count, the last chunk of a
    sequence holding what remains; kept per offsets tensor."""
    cu = torch.tensor([0, 5, 6, 43, 59], dtype=torch.int32)
    layout = chunk_layout(Packing(cu, tuple(cu.tolist())), 16, torch.device("cpu"))
    assert layout.cu_chunks.tolist() == [0, 1, 2, 5, 6] and layout.cu_chunks.dtype == torch.int32
    assert layout.chunk_rows.tolist() == [[0, 5], [5, 1], [6, 16], [22, 16], [38, 5], [43, 16]]
    assert layout.chunk_rows.dtype == torch.int64
    assert chunk_layout(Packing(cu, tuple(cu.tolist())), 16, torch.device("cpu")) is layout  # kept per tensor


def _launch_keys(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Record, per kernel launch, what Triton compiles a kernel for: its constexpr arguments, the launch options,
    and for every other argument what Triton specialises on (a tensor's dtype; an int's 1 and 16-divisibility
    unless the kernel does not specialise on it; a bool's value). The grid is not part of it."""
    from linattn.ops.common.triton_launch import FastKernel

    keys: list[tuple] = []
    launch = FastKernel.launch

    def record(self, grid, args, kwargs):
        fn = getattr(self.kernel, "fn", self.kernel)
        names = list(self.kernel.arg_names)
        values = dict(zip(names, args)) | {n: v for n, v in kwargs.items() if n in names}
        constexpr = {n for n, a in fn.__annotations__.items() if "constexpr" in str(a)}
        # the kernel's do_not_specialize (under the interpreter kept among the decorator's keyword arguments)
        skip = set(getattr(self.kernel, "do_not_specialize", None)
                   or getattr(self.kernel, "kwargs", {}).get("do_not_specialize") or ["T"])
        key: list = [fn.__name__, tuple(sorted((n, v) for n, v in kwargs.items() if n not in names))]
        for n in names:
            v = values[n]
            if n in constexpr:
                key.append((n, v))
            elif isinstance(v, torch.Tensor):
                key.append((n, v.dtype))
            elif isinstance(v, bool) or v is None:
                key.append((n, v))
            elif isinstance(v, int):
                key.append((n, None if n in skip else (v == 1, v % 16 == 0)))
            else:
                key.append((n, type(v).__name__))
        keys.append(tuple(key))
        return launch(self, grid, args, kwargs)

    monkeypatch.setattr(FastKernel, "launch", record)
    return keys


@pytest.mark.parametrize("name", ["gated_delta_rule", "gla"])
def test_new_offsets_with_the_same_chunk_count_compile_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offsets with 3 or 4 sequences and different lengths that pad to 4 chunks launch kernels with the same
    specialisation (no constexpr depends on the number of sequences or their lengths), forward and backward."""
    keys = _launch_keys(monkeypatch)
    spec = get_op(name)
    seen = []
    for lengths in [(5, 15, 20), (10, 17, 14), (16, 16, 16, 16), (3, 40)]:
        keys.clear()
        inputs = _inputs(name, sum(lengths), torch.float32, seed=len(lengths))
        init = torch.zeros(len(lengths), H, K, V, device=DEVICE, requires_grad=True)
        o, s = spec.fn(**inputs, initial_state=init, cu_seqlens=_cu(lengths), backend="triton", chunk_size=CHUNK,
                       output_final_state=True)
        _loss(o, s).backward()
        seen.append(sorted(set(keys), key=repr))
    assert seen[0] and all(k == seen[0] for k in seen[1:])


def _launch_grids(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """Record (kernel name, grid) of every kernel launch."""
    from linattn.ops.common.triton_launch import FastKernel

    grids: list[tuple[str, tuple[int, ...]]] = []
    launch = FastKernel.launch

    def record(self, grid, args, kwargs):
        grids.append((getattr(self.kernel, "fn", self.kernel).__name__, tuple(grid)))
        return launch(self, grid, args, kwargs)

    monkeypatch.setattr(FastKernel, "launch", record)
    return grids


@pytest.mark.parametrize(("name", "segments"), [("gated_delta_rule", "never"), ("simple_gla", "never"),
                                                 ("simple_gla", "always"), ("gla", "never"), ("gla", "always")])
def test_no_launch_exceeds_the_grid_limit(name: str, segments: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """More sequences (or segments) times heads than a grid axis holds (CUDA: 65,535 on the second and third axes)
    run as several launches of the state scans, each adding its first program's index, and the per-chunk kernels
    keep the chunks on the first axis; here the limit is lowered to 3 programs, with 4 sequences of 1 to 37 tokens
    (6 chunks of 16) and 2 heads, and no launch, forward or backward, has more than 3 programs on those axes. (The
    delta family's scans are never cut into segments.)"""
    import linattn.ops.common.batch_slices as batch_slices
    import linattn.ops.common.triton_utils as triton_utils  # imports Triton: only where it is installed

    monkeypatch.setattr(batch_slices, "GRID_LIMIT", 3)
    assert triton_utils.grid_slices(8) == [(0, 3), (3, 3), (6, 2)]
    grids = _launch_grids(monkeypatch)
    family = {"gla": {"gla": {"segments": segments, "seg_min": 1}},
              "simple_gla": {"simple_gla": {"segments": segments, "seg_min": 1}}}.get(name, {})
    with settings(triton_launch=family):
        (o, final), (o_ref, final_ref), leaves = _packed_and_separate(name, (5, 1, 37, 16), torch.float32, True)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, final_ref, rtol=1e-5, atol=1e-5)
    with settings(triton_launch=family):
        assert_same_gradients(_loss(o, final), _loss(o_ref, final_ref), leaves, rtol=1e-5, atol=1e-5)
    assert len({kernel for kernel, _ in grids}) >= 4  # the forward's and backward's kernels were all seen
    over = [(kernel, grid) for kernel, grid in grids if any(n > 3 for n in grid[1:])]
    assert not over, f"launches over the lowered grid limit: {over}"
