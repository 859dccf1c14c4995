"""Command line: ``linattn list | run | train | bench``."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_list(args: argparse.Namespace) -> int:
    from linattn.ops import list_ops, op_info

    rows = [op_info(name) for name in list_ops()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'op':22s} {'family':10s} {'backends':36s} equation")
    for r in rows:
        print(f"{r['name']:22s} {r['family']:10s} {','.join(r['backends']):36s} {r['equation']}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    print(f"linattn run {args.study}: not available yet (the studies land with issues 5 and 6)")
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="list the ops with their backends and equations")
    p.add_argument("--json", action="store_true", help="print machine-readable metadata")
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("run", help="run a named study (shortconv, lra)")
    p.add_argument("study")
    p.add_argument("--preset", default="smoke", choices=["smoke", "full"])
    p.set_defaults(func=_cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
