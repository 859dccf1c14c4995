"""What a training step keeps for the backward pass, tensor by tensor, measured on the CPU.

``python -m linattn.bench.saved_tensors --mixers gated_delta_rule,softmax_attn --d-model 256 --layers 2
--batch 2 --seq 256`` builds each mixer's CausalLM, runs one forward under bf16 autocast and records, with
``torch.autograd.graph.saved_tensors_hooks``, every tensor autograd saves: its bytes, dtype, shape and the module
running when it was saved (forward pre/post hooks keep a stack of module names). Tensors that share a storage (a
view, or the same tensor saved by two nodes) count the storage's bytes once, under the first module that saved it.
Parameters, and casts of a parameter (autocast's bf16 copies of the weights), are counted apart as
"weights": they do not grow with batch or sequence length.

Most of a training step's peak memory is these activations, and they do not depend on the device, so the CPU
shows where the peak goes. ``--backend triton`` (the default) forces the op, ShortConv and fused norm / gate
backends that a CUDA run picks with "auto": an op without a Triton backend runs its CUDA choice (softmax_attn:
SDPA, "parallel"), and the table names the op backend each mixer ran. The CPU runs those kernels under
TRITON_INTERPRET=1, which this module sets when it is unset and it runs as the program or no GPU is present;
imported by a process with a GPU, it leaves the interpreter off, and there :func:`audit` and :func:`step_peak`
take ``backend="auto"``. ``--backend auto`` keeps the CPU's PyTorch paths.

``--compiled`` adds :func:`compiled_saved`: what the forward graph of the compiled model (torch.compile, split by
the min-cut partitioner inductor uses) hands to its backward graph, activations only; the partitioner recomputes
some of what eager autograd keeps and keeps some of what the layers recompute in eager mode.

``--peak`` adds :func:`step_peak`: the most bytes of tensors alive at once over a forward, the loss and the
backward pass (a dispatch mode follows every storage an op makes until its last tensor is gone), which counts the
backward pass's temporary buffers and the gradients as well; where the peak falls depends on the config (with a
small vocabulary it is the loss, with a large one the logits' buffers).

The output lists, per mixer, the activation bytes saved per layer (the blocks' total over the layer count) broken
down by module (the path inside a block, e.g. ``mixer.convs.q``) and dtype, the bytes outside the blocks
(embedding, final norm, LM head), and the ratio of the total to the first mixer named ``softmax_attn`` (or the
first mixer given).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Triton reads TRITON_INTERPRET when a kernel is defined, so it is set here, before linattn's kernel modules load
# (torch defines none). The interpreter then runs every kernel defined later in the process, and a kernel so defined
# cannot take CUDA tensors: imported by a process with a GPU (a pytest run), this module would break the CUDA
# kernels of every other caller there. So it is turned on only where there is no GPU, or when this module is the
# program (`python -m`), whose whole process is the audit on the CPU.
if __name__ == "__main__" or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import linattn  # noqa: E402
from linattn.layers import base  # noqa: E402
from linattn.models import CausalLM, ModelConfig  # noqa: E402

REFERENCE = "softmax_attn"
_BLOCK = re.compile(r"^blocks\.(\d+)(?:\.(.*))?$")


@dataclass
class Saved:
    """One storage kept for the backward pass: the module path that first saved it, its bytes, dtype, shape."""

    module: str
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    weight: bool
    site: str = ""


@dataclass
class Audit:
    """The storages one forward saved, and the per-layer breakdown derived from them."""

    mixer: str
    backend: str
    n_layers: int
    saved: list[Saved] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved if not s.weight)

    @property
    def weight_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved if s.weight)

    def block_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved if not s.weight and _BLOCK.match(s.module))

    def per_layer(self) -> dict[tuple[str, str], float]:
        """(module path inside a block, dtype) -> activation bytes per layer (the blocks' sum over n_layers)."""
        out: dict[tuple[str, str], float] = defaultdict(float)
        for s in self.saved:
            m = _BLOCK.match(s.module)
            if s.weight or not m:
                continue
            out[(m.group(2) or "(block)", str(s.dtype).removeprefix("torch."))] += s.nbytes / self.n_layers
        return dict(out)

    def outside_blocks(self) -> int:
        return sum(s.nbytes for s in self.saved if not s.weight and not _BLOCK.match(s.module))


@contextlib.contextmanager
def module_stack(model: torch.nn.Module) -> Iterator[list[str]]:
    """A list that holds the qualified names of the modules whose forward is running (innermost last)."""
    stack: list[str] = []
    handles = []

    def pop(mod: torch.nn.Module, args: object, out: object) -> None:  # None: the output is left as it is
        stack.pop()

    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        handles.append(mod.register_forward_hook(pop))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


_WEIGHT_PATH = ("ToCopyBackward", "TBackward", "TransposeBackward", "PermuteBackward", "ViewBackward",
                "UnsafeViewBackward", "ReshapeAliasBackward", "CatBackward", "SplitBackward", "ExpandBackward")


def _is_weight_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` is made of parameters by casts, views and concatenations only (autocast's bf16 copy of a
    weight, its transpose, a joint projection's concatenated weights): every path of its grad_fn ends in a
    parameter's gradient accumulator."""
    def weightish(fn: object, depth: int) -> bool:
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return True
        if depth > 8 or not name.startswith(_WEIGHT_PATH):
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        return bool(nxt) and all(weightish(f, depth + 1) for f in nxt)

    return t.grad_fn is not None and weightish(t.grad_fn, 0)


def _site() -> str:
    """The innermost caller inside linattn (not this module): "path:function", where a tensor was saved."""
    f = sys._getframe(2)
    here = os.path.abspath(__file__)
    while f is not None:
        path = f.f_code.co_filename
        # skip this module and the layers' saved-tensor hook, which passes tensors on from where they were saved
        hook = path.endswith(os.path.join("layers", "base.py")) and f.f_code.co_name == "pack"
        if "linattn" in path and os.path.abspath(path) != here and not hook:
            return f"{path[path.rindex('linattn'):]}:{f.f_code.co_name}"
        f = f.f_back
    return ""


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def record_saved(model: torch.nn.Module, run: callable) -> list[Saved]:
    """Run ``run()`` (a forward of ``model``) and return every storage saved for its backward and still held when
    the forward ends, once each. A tensor saved by a part of the graph that the output does not reach (a result
    computed and dropped) is freed with that part: it is not counted."""
    params = {_storage_key(p) for p in model.parameters()}
    seen: dict[tuple[str, int], tuple[Saved, list[weakref.ref]]] = {}

    with module_stack(model) as stack:
        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "meta" and t.untyped_storage().data_ptr() != 0:
                key = _storage_key(t)
                # an address seen before whose tensors are all gone is a new storage made where a freed one was
                if key not in seen or not any(r() is not None for r in seen[key][1]):
                    weight = key in params or _is_weight_copy(t)
                    seen[key] = (Saved(stack[-1] if stack else "", t.untyped_storage().nbytes(), t.dtype,
                                       tuple(t.shape), weight, _site()), [])
                # the graph holds t (what pack returns, or the layer's hooks keep) while it needs it
                seen[key][1].append(weakref.ref(t))
            return t

        # the layers' own saved-tensor hooks (layers/base.py, ConvOutputs) hide what they are given from these
        base.SAVED_TENSOR_OBSERVERS.append(pack)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = run()
        finally:
            base.SAVED_TENSOR_OBSERVERS.remove(pack)
        held = [s for s, refs in seen.values() if any(r() is not None for r in refs)]
    del out
    return held


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that tensors made under this mode keep alive, now and at their peak, with the module
    running (forward) or the autograd node (backward) at the peak. A storage is counted from the op that made it
    until the last tensor on it is gone; storages made before (``skip``: e.g. the parameters) are not counted."""

    def __init__(self, skip: set[int], stack: list[str]) -> None:
        super().__init__()
        self.skip, self.stack = skip, stack
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors on it]
        self.now = self.peak = 0
        self.peak_at = ""

    def _where(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"backward {type(node).__name__}"
        return f"forward {self.stack[-1] if self.stack else ''}"

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.live[ptr]

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.skip:
            return
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [storage.nbytes(), 0]
            self.now += entry[0]
            if self.now > self.peak:
                self.peak, self.peak_at = self.now, self._where()
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out


def step_peak(mixer: str, *, d_model: int, n_layers: int, n_heads: int, vocab: int, batch: int, seq: int,
              backend: str = "triton", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[int, str]:
    """Peak bytes of the tensors alive during one forward, loss and backward of ``mixer``'s CausalLM (parameters
    not counted; the gradients are), and where it was reached: the backward pass's temporary buffers count here,
    which the saved tensors alone leave out."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(mixer=mixer, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                                 vocab_size=vocab))
    ids = torch.randint(0, vocab, (batch, seq + 1))
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {inputs.untyped_storage().data_ptr(), targets.untyped_storage().data_ptr()}
    with linattn.settings(**backend_settings(backend, mixer)), module_stack(model) as stack:
        mode = LiveBytes(skip, stack)
        with mode:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits, _ = model(inputs, use_cache=False)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            del logits
            loss.backward()
            del loss
    return mode.peak, mode.peak_at


def cuda_op_backend(mixer: str) -> str:
    """The op backend "auto" picks on CUDA for ``mixer``'s layer: triton where the op has it, else its CUDA
    choice (softmax_attn: "parallel", SDPA), else what it runs on the CPU ("auto")."""
    from linattn.layers.registry import mixer_class
    from linattn.ops import get_op, list_ops

    fn = getattr(mixer_class(mixer), "op", None)
    spec = next((get_op(n) for n in list_ops() if get_op(n).fn is fn), None) if fn is not None else None
    if spec is None:
        return "auto"
    if "triton" in spec.implementations:
        return "triton"
    return spec.auto_cuda or "auto"


def backend_settings(backend: str, mixer: str) -> dict:
    """linattn.settings for ``backend``: "triton" forces the kernels a CUDA run picks; "auto" changes nothing."""
    if backend == "triton":
        return dict(op_backend=cuda_op_backend(mixer), shortconv_backend="triton", fused_backend="triton")
    return {}


def audit(mixer: str, *, d_model: int, n_layers: int, n_heads: int, vocab: int, batch: int, seq: int,
          backend: str = "triton", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Audit:
    """The storages one forward of ``mixer``'s CausalLM keeps for the backward pass (module docstring)."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(mixer=mixer, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                                 vocab_size=vocab))
    ids = torch.randint(0, vocab, (batch, seq))

    def run() -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits, _ = model(ids, use_cache=False)
        return logits

    settings = backend_settings(backend, mixer)
    with linattn.settings(**settings):
        saved = record_saved(model, run)
    return Audit(mixer, settings.get("op_backend", "auto"), n_layers, saved)


def compiled_saved(mixer: str, *, d_model: int, n_layers: int, n_heads: int, vocab: int, batch: int, seq: int,
                   backend: str = "triton", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   mixer_kwargs: dict | None = None) -> int:
    """Bytes of activations the compiled model's forward graph hands to its backward graph: ``mixer``'s CausalLM
    (its layers built with ``mixer_kwargs``) under torch.compile(fullgraph=True), split by AOTAutograd's min-cut
    partitioner (the one inductor uses), with no code generated. Tensors computed from the weights alone
    (autocast's copies of them) are not counted, as :func:`audit` counts them apart."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(mixer=mixer, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                                 vocab_size=vocab, mixer_kwargs=dict(mixer_kwargs or {})))
    ids = torch.randint(0, vocab, (batch, seq))
    kept = []

    def forward_graph(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        data = {n for n in gm.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == torch.long}
        from_data = set()
        for node in gm.graph.nodes:  # topological order: a node reads data when an input of it does
            if node in data or any(i in from_data for i in node.all_input_nodes):
                from_data.add(node)
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        # outputs[0] is the logits, the model's output; the rest is what the backward graph reads
        kept.extend(n.meta["val"].numel() * n.meta["val"].element_size() for n in outputs[1:]
                    if n in from_data and isinstance(n.meta.get("val"), torch.Tensor))
        return gm

    def aot(gm: torch.fx.GraphModule, example_inputs: list):
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_graph, bw_compiler=lambda g, i: g,
                                     partition_fn=min_cut_rematerialization_partition)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot, fullgraph=True)
    with linattn.settings(**backend_settings(backend, mixer)):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits, _ = compiled(ids, use_cache=False)
    del logits
    return sum(kept)


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def details(a: Audit) -> str:
    """Every activation storage of the first block, largest first: bytes, dtype, shape, module, saving site."""
    rows = [s for s in a.saved if not s.weight and (m := _BLOCK.match(s.module)) and m.group(1) == "0"]
    return "\n".join(f"   {s.nbytes / 2**10:9.1f} KiB {str(s.dtype).removeprefix('torch.'):9s} "
                     f"{str(list(s.shape)):22s} {s.module:24s} {s.site}"
                     for s in sorted(rows, key=lambda s: -s.nbytes))


def report(audits: list[Audit], top: int = 0, detail: bool = False) -> str:
    """The text table: per mixer the per-layer breakdown, and the totals with the ratio to the reference."""
    ref = next((a for a in audits if a.mixer == REFERENCE), audits[0])
    lines = []
    for a in audits:
        lines.append(f"== {a.mixer} (backend {a.backend}): per layer {_mib(a.block_bytes() / a.n_layers)} MiB, "
                     f"outside the blocks {_mib(a.outside_blocks())} MiB, weights {_mib(a.weight_bytes)} MiB")
        rows = sorted(a.per_layer().items(), key=lambda kv: -kv[1])
        for (module, dt), n in rows[:top or None]:
            lines.append(f"   {_mib(n)} MiB  {dt:9s} {module}")
        if detail:
            lines.append("  storages of block 0:")
            lines.append(details(a))
    lines.append("")
    lines.append(f"{'mixer':24s} {'per layer MiB':>14s} {'total MiB':>10s} {'ratio':>7s}")
    for a in audits:
        lines.append(f"{a.mixer:24s} {a.block_bytes() / a.n_layers / 2**20:14.2f} "
                     f"{a.activation_bytes / 2**20:10.2f} {a.activation_bytes / ref.activation_bytes:7.3f}")
    return "\n".join(lines)


def to_json(audits: list[Audit]) -> list[dict]:
    return [{"mixer": a.mixer, "backend": a.backend, "activation_bytes": a.activation_bytes,
             "weight_bytes": a.weight_bytes, "per_layer_bytes": a.block_bytes() / a.n_layers,
             "per_layer": [{"module": m, "dtype": dt, "bytes": n} for (m, dt), n in
                           sorted(a.per_layer().items(), key=lambda kv: -kv[1])]} for a in audits]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m linattn.bench.saved_tensors", description=__doc__.split("\n\n")[0])
    p.add_argument("--mixers", default="softmax_attn,delta_rule,gated_delta_rule,mamba2,gla,comba,retention")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2, help="heads (the H100 runs use heads of 128: d_model / 128)")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--backend", choices=("triton", "auto"), default="triton")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--top", type=int, default=0, help="rows per mixer (0: all)")
    p.add_argument("--detail", action="store_true", help="also list every storage of the first block")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--peak", action="store_true",
                   help="also the peak of the tensors alive over forward, loss and backward (step_peak)")
    p.add_argument("--compiled", action="store_true",
                   help="also what the compiled model's forward graph keeps for its backward (compiled_saved)")
    args = p.parse_args(argv)
    shape = dict(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, vocab=args.vocab, batch=args.batch,
                 seq=args.seq, backend=args.backend, dtype=getattr(torch, args.dtype))
    mixers = [m.strip() for m in args.mixers.split(",") if m.strip()]
    audits = [audit(m, **shape) for m in mixers]
    peaks = {m: step_peak(m, **shape) for m in mixers} if args.peak else {}
    compiled = {m: compiled_saved(m, **shape) for m in mixers} if args.compiled else {}
    if args.json:
        rows = to_json(audits)
        for row in rows:
            if row["mixer"] in peaks:
                row["step_peak_bytes"], row["step_peak_at"] = peaks[row["mixer"]]
            if row["mixer"] in compiled:
                row["compiled_saved_bytes"] = compiled[row["mixer"]]
        print(json.dumps(rows, indent=1))
        return 0
    print(report(audits, args.top, args.detail))
    if peaks:
        ref = peaks.get(REFERENCE, next(iter(peaks.values())))[0]
        print(f"\n{'mixer':24s} {'step peak MiB':>14s} {'ratio':>7s}  reached at")
        for m, (n, at) in peaks.items():
            print(f"{m:24s} {n / 2**20:14.2f} {n / ref:7.3f}  {at}")
    if compiled:
        ref = compiled.get(REFERENCE, next(iter(compiled.values())))
        print(f"\n{'mixer':24s} {'compiled, kept MiB':>19s} {'ratio':>7s}")
        for m, n in compiled.items():
            print(f"{m:24s} {n / 2**20:19.2f} {n / ref:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
