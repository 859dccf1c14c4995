"""How far an op's implementations in a low precision are from a float32 reference, output and every gradient:

    python -m linattn.bench.accuracy --op mesa_net --impls triton,fla --device cuda --dtype bfloat16 \\
        --B 2 --T 2048 --H 4 [--launch '{"mesa_net": {"cg_dots": "tf32"}}'] [--out acc.json]

The op's example inputs are made once in ``--dtype`` (so every row starts from the same rounded numbers). The
reference runs our ``--reference`` backend (default chunk) on float32 copies of them; each implementation in
``--impls`` (our backends by name, and ``fla`` for FLA's kernel where FLA is installed) runs on the ``--dtype``
inputs. Every run is differentiated with the same upstream gradient (standard normal, seeded) and scored by the
relative RMS error ||a - e|| / ||e|| of its output and of each floating-point input's gradient. Each ``--launch``
setting (a JSON object for ``linattn.settings(triton_launch=...)``) adds one more row of the triton backend under it.

The op's keywords are the benchmark's (``OP_KWARGS`` in linattn/bench/ops.py: mesa_net's 30-step CG solve,
ttt_linear's inner norm), and ``FLA_SEMANTICS`` holds the ones that make ours compute what FLA's function does
(FLA's chunk_mesa_net does not scale q), so that an FLA row is compared with the same mathematics.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from linattn.bench.ops import FLA_ARGUMENTS, OP_KWARGS, fla_function, fla_output, launch_label
from linattn.bench.shape_args import add_shape_arguments
from linattn.ops import get_op, list_ops
from linattn.switches import settings
from linattn.testing import grads, rel_rmse
from linattn.validation import json_object_arg

# Our keywords that give FLA's function's mathematics, for every row of the op (FLA's mesa_net has no scale).
FLA_SEMANTICS = {"mesa_net": {"scale": 1.0}}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _outputs_and_grads(call, inputs: dict, dtype: torch.dtype, seed: int) -> tuple[list[str], list]:
    """(names, [output, grad of each floating input]) of ``call`` on ``inputs``, the floating ones cast to
    ``dtype``: :func:`linattn.testing.grads` (a seeded upstream gradient, the same for every row)."""
    names = [n for n, x in inputs.items() if isinstance(x, torch.Tensor) and x.is_floating_point()]
    fixed = {n: x for n, x in inputs.items() if n not in names}
    outs, gradients = grads(lambda *leaves: [call({**fixed, **dict(zip(names, leaves))})],
                            [inputs[n].to(dtype) for n in names], seed=seed)
    return names, [outs[0].float(), *gradients]


def _call(op: str, impl: str):
    """The function of one implementation: ours by backend name, or FLA's kernel (None when FLA is missing)."""
    spec = get_op(op)
    kwargs = {**OP_KWARGS.get(op, {}), **FLA_SEMANTICS.get(op, {})}
    if impl == "fla":
        fn = fla_function(op)
        if fn is None:
            return None
        arguments = FLA_ARGUMENTS.get(op, lambda x: x)
        return lambda x: fla_output(fn(**arguments(x)))
    if impl not in spec.backends:
        raise ValueError(f"--impls: {op} has no backend {impl!r} (its backends: {', '.join(spec.backends)}, or fla)")
    return lambda x: spec.fn(**x, **kwargs, backend=impl)[0]


def measure(op: str, impls: list[str], *, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype,
            device: str | torch.device = "cuda", reference: str = "chunk", launches: list[dict] | None = None,
            seed: int = 0) -> dict:
    """{"op", "shape", "dtype", "reference", "keywords", "rows": [{"impl", "errors": {name: rel RMS}} or {"impl",
    "note"}]}: see the module docstring ("keywords": the op's keywords in every row, the reference's too)."""
    if reference == "fla":
        raise ValueError("reference: one of our backends (FLA has no float32 reference form here)")
    device = torch.device(device)
    runs = [(impl, None) for impl in impls] + [("triton", launch) for launch in launches or []]
    calls = [_call(op, impl) for impl, _ in runs]  # a bad backend name fails here, before any compute
    torch.manual_seed(seed)
    inputs = get_op(op).example_inputs(B, T, H, K, V, dtype=dtype, device=device)
    names, want = _outputs_and_grads(_call(op, reference), inputs, torch.float32, seed + 1)
    keys = ["o"] + names
    rows = []
    for (impl, launch), call in zip(runs, calls):
        label = launch_label(impl, launch)
        if call is None:
            rows.append({"impl": label, "note": "FLA is not installed"})
            continue
        # no launch: the settings in force (LINATTN_TRITON_LAUNCH included) stay
        with settings(triton_launch=launch) if launch is not None else contextlib.nullcontext():
            got_names, got = _outputs_and_grads(call, inputs, dtype, seed + 1)
        assert got_names == names
        rows.append({"impl": label, "errors": {k: (rel_rmse(a, e) if a is not None and e is not None else None)
                                               for k, a, e in zip(keys, got, want)}})
    return {"op": op, "shape": dict(B=B, T=T, H=H, K=K, V=V), "dtype": str(dtype).removeprefix("torch."),
            "reference": f"{reference}, float32", "keywords": {**OP_KWARGS.get(op, {}), **FLA_SEMANTICS.get(op, {})},
            "rows": rows}


def table(result: dict) -> str:
    """The rows as a markdown table: one column per output/gradient."""
    keys = next((list(r["errors"]) for r in result["rows"] if "errors" in r), [])
    lines = [f"| {result['op']} ({result['dtype']}, T={result['shape']['T']}) | " + " | ".join(keys) + " |",
             "| --- |" + " ---: |" * len(keys)]
    for r in result["rows"]:
        cells = ([f"{r['errors'][k]:.2e}" if r["errors"][k] is not None else "-" for k in keys] if "errors" in r
                 else [r["note"]] + [""] * (len(keys) - 1))
        lines.append(f"| {r['impl']} | " + " | ".join(cells) + " |")
    lines.append(f"\nrelative RMS error against {result['reference']}; the op's keywords in every row: "
                 f"{result['keywords'] or 'none'}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of this tool (also `linattn bench accuracy`'s)."""
    p.add_argument("--op", required=True, choices=list_ops())
    p.add_argument("--impls", default="triton", help="comma-separated: our backends by name, and fla")
    p.add_argument("--reference", default="chunk", help="our backend run in float32 as the reference")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--launch", action="append", default=[], type=json_object_arg,
                   help="a triton_launch JSON object: one more triton row")
    p.add_argument("--seed", type=int, default=0)
    add_shape_arguments(p, B=2, T=2048, H=4)
    p.add_argument("--out", default=None, help="write the result as JSON")


def run_from_args(a: argparse.Namespace) -> None:
    """Measure what the parsed options ask for, print the table, write --out."""
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = measure(a.op, [i for i in a.impls.split(",") if i], B=a.B, T=a.T, H=a.H, K=a.K, V=a.V,
                     dtype=DTYPES[a.dtype], device=device, reference=a.reference, launches=a.launch, seed=a.seed)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    main()
