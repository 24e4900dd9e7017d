"""The ``sparseattn`` command line: explain, selectors, demo (and compare / bench / trace)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_explain(args: argparse.Namespace) -> int:
    from .layers import attention_steps, seed_example

    e = seed_example()
    scale = None if args.scale == "default" else float(args.scale)
    steps = attention_steps(e["X"], e["W_query"], e["W_key"], e["W_value"], scale=scale)
    q = None if args.query is None else args.query - 1
    if q is not None and not 0 <= q < steps.queries.shape[0]:
        print(f"error: --query must be between 1 and {steps.queries.shape[0]}; got {args.query}", file=sys.stderr)
        return 2
    print("The tutorial's worked example (shared/seed-example.md), scale = "
          f"{'1/sqrt(3)' if scale is None else scale}")
    print(steps.format(decimals=args.decimals, query_index=q))
    return 0


def _cmd_selectors(args: argparse.Namespace) -> int:
    from .selectors import selector_classes

    for name, cls in selector_classes().items():
        reason = cls.unavailable_reason()
        status = "available" if reason is None else f"UNAVAILABLE: {reason}"
        print(f"{name}  [{status}]")
        print(f"    metric: {cls.metric}")
        print(f"    guarantee: {cls.guarantee}")
        for pname, p in cls.params_spec.items():
            print(f"    {pname} ({p.type.__name__}, default {p.default!r}): {p.help}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparseattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explain", help="print the tutorial's worked example step by step")
    p.add_argument("--scale", default="1", help="score scale: a number, or 'default' for 1/sqrt(d) (default 1, "
                   "as in the tutorial)")
    p.add_argument("--query", type=int, default=None, help="only this query (1-based)")
    p.add_argument("--decimals", type=int, default=6)
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser("selectors", help="list selectors, their parameters and availability")
    p.set_defaults(func=_cmd_selectors)

    from . import report
    report.add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, ImportError, FileNotFoundError) as exc:
        print(f"sparseattn {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
