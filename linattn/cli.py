"""Command line: ``linattn list | run | train | bench ops | bench decode | bench model | bench accuracy | data |
convert-fla``.

A user error (:class:`linattn.errors.UserError`: a bad config, flag or file) prints one line
``linattn: error: <message>`` and exits with code 2; any other exception is a bug and keeps its traceback.
``--debug`` shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import json
import sys

from linattn.compile_modes import TORCH_COMPILE_MODES
from linattn.errors import ConfigError, UserError
from linattn.validation import check_device, int_arg, json_object_arg

USER_ERROR_EXIT = 2


def _cmd_list(args: argparse.Namespace) -> int:
    from linattn.ops import list_ops, op_info

    rows = [op_info(name) for name in list_ops()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from linattn.experiments import cli_list
    from linattn.models import list_mixers

    print(f"{'op':22s} {'family':12s} {'backends':36s} equation")
    for r in rows:
        print(f"{r['name']:22s} {r['family']:12s} {','.join(r['backends']):36s} {r['equation']}")
    print(f"\nmixers (layers): {', '.join(list_mixers())}\n")
    return cli_list()


def _cmd_run(args: argparse.Namespace) -> int:
    from linattn.experiments import cli_run

    return cli_run(args)


def _cmd_train(args: argparse.Namespace) -> int:
    from linattn.experiments import cli_train

    return cli_train(args.config, device=args.device, out_dir=args.out, override_config=args.override_config)


def _cmd_bench_ops(args: argparse.Namespace) -> int:
    import torch

    from linattn.bench.ops import format_table, rows_as_dicts, run_ops_bench

    check_device("--device", args.device, allow_auto=False)
    cuda = args.device == "cuda"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype or ("bfloat16" if cuda else "float32")]
    shape = dict(B=args.B or (4 if cuda else 1), H=args.H or (16 if cuda else 4),
                 K=args.K or (128 if cuda else 64), V=args.V or (128 if cuda else 64))
    lengths = _int_list("--lengths", args.lengths or ("2048,4096,8192,16384,32768,65536" if cuda else "2048"))
    impls = (args.impls or ("chunk,triton,fla,sdpa" if cuda else "recurrent,chunk,sdpa")).split(",")
    ops = (args.ops or "simple_gla,gla,delta_rule,gated_delta_rule").split(",")
    header = (f"device={args.device} dtype={str(dtype).replace('torch.', '')} "
              f"B={shape['B']} H={shape['H']} K={shape['K']} V={shape['V']} torch={torch.__version__}")
    done = []

    def on_row(row) -> None:  # print and save as we go: a long run interrupted keeps what it measured
        done.append(row)
        print(f"  {row.op} T={row.T} {row.impl}: fwd {row.fwd_ms} ms, fwd+bwd {row.fwdbwd_ms} ms "
              f"({row.fwdbwd_b2b_ms} ms back to back) {row.note}",
              file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"header": header, "rows": rows_as_dicts(done)}, f, indent=1)

    rows = run_ops_bench(ops, lengths, impls, dtype=dtype, device=torch.device(args.device),
                         repeats=args.repeats, memory=not args.no_memory, on_row=on_row, launches=args.launch,
                         progress=not args.no_progress, **shape)
    print(header + "\n\n" + format_table(rows))
    return 0


def _cmd_bench_decode(args: argparse.Namespace) -> int:
    import torch

    from linattn.models import list_mixers
    from linattn.models.decode_bench import decode_cost_ratio

    check_device("--device", args.device, allow_auto=False)
    mixers = args.mixers.split(",") if args.mixers else list_mixers()
    unknown = [m for m in mixers if m not in list_mixers()]
    if unknown:
        raise ConfigError(f"unknown mixer(s) {unknown}; valid: {', '.join(list_mixers())}", field="--mixers")
    paths = ["eager", "static"] if args.path == "both" else [args.path]
    print(f"time per generated token at context {args.long} over {args.short} (device={args.device}, "
          f"d_model={args.d_model}, {args.layers} layers, batch {args.batch_size}, {args.dtype}; recurrent target "
          f"<= 1.2; static: {'no CUDA graph' if args.no_cuda_graph else 'CUDA graph on CUDA'}"
          f"{', torch.compile' if args.compile else ''})")
    print("| mixer | path | ms/token short | ms/token long | ratio | tokens/s short | tokens/s long | vs eager |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows, graph = [], False if args.no_cuda_graph else None
    for mixer in mixers:
        eager_long = None
        for path in paths:
            r = decode_cost_ratio(mixer, short_context=args.short, long_context=args.long, new_tokens=args.tokens,
                                  d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                                  batch_size=args.batch_size, device=args.device, path=path,
                                  dtype=getattr(torch, args.dtype), use_cuda_graph=graph, compile=args.compile)
            rows.append(r)
            long_ms = r["ms_per_token_long"]
            eager_long = long_ms if path == "eager" else eager_long
            speedup = f"{eager_long / long_ms:.1f}x" if path == "static" and eager_long else "-"
            print(f"| {mixer} | {path} | {r['ms_per_token_short']:.3f} | {long_ms:.3f} | {r['ratio']:.2f} | "
                  f"{r['tokens_per_s_short']:.0f} | {r['tokens_per_s_long']:.0f} | {speedup} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


def _cmd_bench_model(args: argparse.Namespace) -> int:
    from linattn.bench.model import cli_bench_model

    return cli_bench_model(args)


def _cmd_bench_accuracy(args: argparse.Namespace) -> int:
    from linattn.bench.accuracy import run_from_args

    run_from_args(args)
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from linattn.data.lra.__main__ import main as lra_main

    lra_main(args.rest, prog="linattn data")
    return 0


def _cmd_convert_fla(args: argparse.Namespace) -> int:
    import torch

    try:
        from linattn.hf.convert import convert_fla
    except ImportError as exc:  # the optional hf extra: its message says how to install it
        raise UserError(str(exc)) from None
    out = convert_fla(args.src, args.out, dtype=getattr(torch, args.dtype))
    print(f"wrote {out} (load it with: import linattn.hf; transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


def _int_list(flag: str, text: str) -> list[int]:
    """``"2048,4096"`` -> [2048, 4096]; ConfigError naming ``flag`` otherwise."""
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"expected a comma list of ints >= 1, got {text!r}", field=flag)
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linattn", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of every error")
    # every subcommand takes --debug too; SUPPRESS keeps a flag given before the subcommand
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", parents=[debug], help="list the ops with their backends and equations")
    p.add_argument("--json", action="store_true", help="print machine-readable metadata")
    p.set_defaults(func=_cmd_list)
    bench = sub.add_parser("bench", help="speed / memory benchmarks").add_subparsers(dest="what", required=True)
    p = bench.add_parser("ops", parents=[debug],
                         help="time every backend of the ops (and SDPA, FLA) at several lengths")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--ops", help="comma-separated op names (default: simple_gla,gla,delta_rule,gated_delta_rule)")
    p.add_argument("--lengths", help="comma-separated T values (cpu default 2048; cuda 2048..65536)")
    p.add_argument("--impls", help="comma-separated: recurrent,parallel,chunk,triton,fla,sdpa,flex (flex: torch's "
                   "FlexAttention, forgetting_attn on CUDA)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    for name in ("B", "H", "K", "V"):
        p.add_argument(f"--{name}", type=int_arg(1))
    p.add_argument("--repeats", type=int_arg(1), default=5)
    p.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--launch", action="append", default=[], type=json_object_arg,
                   help="a triton_launch JSON object, e.g. '{\"path_attn\": {\"split\": 16}}': one more triton "
                        "row per op and length, run under it in the same process (repeatable)")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    p.set_defaults(func=_cmd_bench_ops)
    p = bench.add_parser("accuracy", parents=[debug], help="an op's backends (and FLA) in bf16/fp16 against a float32 "
                         "reference: output and every gradient")
    from linattn.bench import accuracy

    accuracy.add_arguments(p)
    p.set_defaults(func=_cmd_bench_accuracy)
    p = bench.add_parser("decode", parents=[debug], help="time per generated token at a long vs a short context")
    p.add_argument("--mixers", help="comma-separated mixer names (default: every mixer)")
    p.add_argument("--short", type=int_arg(1), default=512)
    p.add_argument("--long", type=int_arg(1), default=8192)
    p.add_argument("--tokens", type=int_arg(1), default=32, help="generated tokens timed per context")
    p.add_argument("--d-model", type=int_arg(1), default=256)
    p.add_argument("--layers", type=int_arg(1), default=2)
    p.add_argument("--heads", type=int_arg(1), default=4)
    p.add_argument("--batch-size", type=int_arg(1), default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="parameters and activations (states and KV buffers stay float32)")
    p.add_argument("--path", default="eager", choices=["eager", "static", "both"],
                   help="eager: cached single-token calls; static: StaticDecoder (a CUDA graph on CUDA); both")
    p.add_argument("--no-cuda-graph", action="store_true", help="static path without the CUDA graph")
    p.add_argument("--compile", action="store_true", help="static path: torch.compile the step (experimental)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", help="also write the rows as JSON to this file")
    p.set_defaults(func=_cmd_bench_decode)
    p = bench.add_parser("model", parents=[debug],
                         help="whole-model training step and decoding per mixer, next to softmax_attn",
                         description="A CausalLM per mixer (softmax_attn always included, same config and process): "
                         "tokens/s and peak memory of a full training step (eager and torch.compile; steps run "
                         "back to back, and the median step synchronised on its own beside them), ms per "
                         "generated token. Options left out take the device's defaults: on cuda the reference "
                         "config (d_model 1024, 12 layers, 8 heads, vocab 32000; shapes 8x2048,2x8192,1x32768; "
                         "eager,compiled; decoding B 1,16 at contexts 512,8192), on cpu a tiny one.")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--mixers", help="comma-separated mixer names, besides softmax_attn "
                   "(default: gated_delta_rule,delta_rule,gla,mamba2,retention,comba)")
    p.add_argument("--shapes", help="comma-separated training batch shapes BxT (cuda default 8x2048,2x8192,1x32768)")
    p.add_argument("--modes", help="comma-separated: eager,compiled (cuda default both; cpu eager)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="training autocast and decoding weight dtype (cuda default bfloat16; cpu float32)")
    p.add_argument("--d-model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--mixer-kwargs", help='JSON: mixer -> layer arguments, e.g. \'{"gla": {"chunk_size": 64}}\'')
    p.add_argument("--steps", type=int, help="timed training steps: the synchronised median's, and each of the "
                   "three back-to-back runs' (cuda default 10)")
    p.add_argument("--warmup", type=int, help="untimed training steps first (cuda default 3; compiled mode also "
                   "makes one compiling step before them)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled mode")
    p.add_argument("--compile-scope", default="model", choices=["model", "blocks"], help="compiled mode: "
                   "torch.compile(model), or each block (identical blocks share one graph: a fraction of the "
                   "compile time)")
    p.add_argument("--compile-mode", default="default",
                   choices=list(TORCH_COMPILE_MODES),
                   help="torch.compile mode of the compiled mode (reduce-overhead: the step's graphs replayed as "
                   "CUDA graphs, no host time per kernel)")
    p.add_argument("--profile-top", type=int, default=10, help="kernels listed per profiled row (default 10)")
    p.add_argument("--profile", action="store_true", help="profile one training step per row: top kernels, "
                   "kernel time vs wall time")
    p.add_argument("--decode-batch", help="comma-separated decoding batch sizes (cuda default 1,16)")
    p.add_argument("--decode-context", help="comma-separated prefill lengths (cuda default 512,8192)")
    p.add_argument("--decode-tokens", type=int, help="generated tokens timed per row (cuda default 64)")
    p.add_argument("--decode-path", default="eager", help="how tokens are generated (eager: a cached "
                   "model(next_ids, cache) call per token; static: StaticDecoder, a CUDA graph replay per token)")
    p.add_argument("--packed", action="store_true", help="also train each mixer and shape BxT on packed "
                   "documents: B*T tokens per step as one row with cu_seqlens, lengths drawn from --doc-lengths, "
                   "a new packing every step; its row shows tokens/s beside the fixed-length row and the ratio")
    p.add_argument("--doc-lengths", help="MIN,MAX: packed document lengths, drawn uniformly (seeded; default "
                   "64,4096)")
    p.add_argument("--no-train", action="store_true", help="decoding rows only")
    p.add_argument("--no-decode", action="store_true", help="training rows only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the header and rows as JSON to this file, rewritten as each row completes")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --out (same settings) and "
                   "measure only the missing ones")
    p.add_argument("--retry-errors", action="store_true", help="with --resume: measure again the rows that "
                   "recorded an error")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd_bench_model)
    p = sub.add_parser("data", parents=[debug],
                       help="generate data sets: `linattn data listops|pathfinder --out DIR ...`")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of python -m linattn.data.lra")
    p.set_defaults(func=_cmd_data)
    p = sub.add_parser("convert-fla", parents=[debug], help="an FLA checkpoint (DeltaNet, Gated DeltaNet, GLA, Mamba2) "
                       "to a linattn transformers checkpoint")
    p.add_argument("src", help="directory saved by FLA's model.save_pretrained")
    p.add_argument("out", help="output directory (config.json, model.safetensors)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=_cmd_convert_fla)
    from linattn.experiments import add_run_arguments

    p = sub.add_parser("run", parents=[debug], help="run a named study (e.g. shortconv) or a study YAML file")
    add_run_arguments(p)
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("train", parents=[debug],
                       help="one training run from a YAML config (under torchrun: data parallel)")
    p.add_argument("config")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="run folder (checkpoints, metrics.jsonl)")
    p.add_argument("--override-config", action="store_true",
                   help="resume a checkpoint written under a different config, with this config's values "
                        "(each changed field is printed: old -> new)")
    p.set_defaults(func=_cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command of ``argv``; returns the exit code (2 for a user error, printed as one line)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for benchmark headers
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())  # one line, whatever the message's layout
        print(f"linattn: error: {message} (--debug shows the traceback)", file=sys.stderr)
        return USER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
