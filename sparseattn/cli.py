"""The ``sparseattn`` command line: ``explain``, ``selectors``, ``compare``, ``bench`` and ``trace``.

* ``explain``: the tutorial's worked example, step by step;
* ``selectors``: every selector with its parameters and availability;
* ``compare``: selectors against exact attention on one workload (tables via :mod:`sparseattn.report`);
* ``bench``: a benchmark suite (:mod:`sparseattn.suite`);
* ``trace``: capture real Q/K/V traces from MiniLM (:mod:`sparseattn.traces`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _cmd_explain(args: argparse.Namespace) -> int:
    from .tutorial import attention_steps, seed_example

    e = seed_example()
    scale = None if args.scale == "default" else float(args.scale)
    steps = attention_steps(e["X"], e["W_query"], e["W_key"], e["W_value"], scale=scale)
    q = None if args.query is None else args.query - 1
    if q is not None and not 0 <= q < steps.queries.shape[0]:
        print(f"error: --query must be between 1 and {steps.queries.shape[0]}; got {args.query}", file=sys.stderr)
        return 2
    print("The tutorial's worked example (numbers: help(sparseattn.tutorial.example)), scale = "
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


_FORMATS = ("table", "json", "md", "html")


def _progress_printer(total: int) -> Callable[[str], None]:
    state = {"i": 0}

    def say(msg: str) -> None:
        state["i"] += 1
        print(f"[{state['i']}/{total}] {msg}", file=sys.stderr, flush=True)

    return say


def _cmd_compare(args: argparse.Namespace) -> int:
    from . import bench, report
    from .threads import get_num_threads, threads

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = sorted(set(formats) - set(_FORMATS))
    if bad:
        raise ValueError(f"--format: unknown {bad}; choose from {', '.join(_FORMATS)}.")
    if args.k < 1:
        raise ValueError(f"--k must be >= 1; got {args.k}.")
    with threads(args.threads or get_num_threads()):
        n_sel = len(args.selectors) if args.selectors else len(bench.default_selectors(None))
        result = bench.compare(args.data, args.selectors, k=args.k, is_causal=args.causal, repeats=args.repeats,
                               max_groups=args.max_groups, progress=_progress_printer(n_sel + 1))
    if "table" in formats:
        print(report.render_text(result))
    for p in report.write_compare(result, args.out, formats):
        print(f"wrote {p}")
    return 0 if all("error" not in r for r in result["results"]) else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import suite

    path = suite.run_suite(args.suite, args.out, threads=args.threads, repeats=args.repeats)
    print(f"wrote {path}")
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from . import traces

    kwargs: dict[str, Any] = {"seed": args.seed}
    if args.kind == "window":
        kwargs["n_windows"] = args.n_windows
    else:
        kwargs.update(n_keys=args.n_keys, n_queries=args.n_queries, layer=args.layer)
        if args.heads is not None:
            try:
                kwargs["heads"] = [int(h) for h in args.heads.split(",")]
            except ValueError:
                raise SystemExit(f"sparseattn trace: --heads must be a comma list of integers such as 0,1; "
                                 f"got {args.heads!r}.") from None
    out = traces.generate_traces(args.out, args.kind, name=args.name, **kwargs)
    print(f"wrote {out}")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``compare``, ``bench`` and ``trace`` on the ``sparseattn`` parser."""
    p = sub.add_parser("compare", help="compare selectors against dense attention (accuracy and speed)",
                       description="Run selectors and exact attention side by side on one workload and "
                                   "report speed and accuracy. Default: the shipped real MiniLM traces.")
    p.add_argument("--data", default="window",
                   help="window | store | NAME@DIR (a trace written by `sparseattn trace --name NAME --out DIR`) | "
                        "synthetic:n=65536,d=64,kind=gaussian|clustered|correlated (default window)")
    p.add_argument("--selectors", nargs="+", default=None,
                   help="selector specs, e.g. topk window:width=64 'window+sinks+faiss-hnsw:M=32' (default: a "
                        "representative set; see `sparseattn selectors`)")
    p.add_argument("--k", type=int, default=64, help="keys per query for top-k selectors (default 64)")
    p.add_argument("--causal", action="store_true", help="causal attention (keys up to the query's position)")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats; medians are reported (default 3)")
    p.add_argument("--max-groups", type=int, default=12,
                   help="for real traces: evaluate this many evenly spaced (window, layer, head) groups "
                        "(default 12)")
    p.add_argument("--threads", type=int, default=None, help="threads for Numba/FAISS/BLAS (default: all cores)")
    p.add_argument("--out", default="sparseattn-report", help="output directory (default ./sparseattn-report)")
    p.add_argument("--format", default="table,json,md,html", help="comma list of table,json,md,html")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("bench", help="run the benchmark suite (time vs n, accuracy vs speed, recall vs k)")
    p.add_argument("--suite", default="quick", choices=["quick", "full"], help="quick (minutes) or full sweep")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), help="output directory")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None, help="override the suite's repeats")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("trace", help="capture real Q/K/V traces from MiniLM (needs the 'traces' extra)")
    p.add_argument("kind", choices=["window", "store"])
    p.add_argument("--out", default="data")
    p.add_argument("--n-windows", type=int, default=2)
    p.add_argument("--n-keys", type=int, default=16384)
    p.add_argument("--n-queries", type=int, default=2048)
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--heads", default=None, help="store: comma list of heads (default all 12)")
    p.add_argument("--name", default=None, help="file stem and manifest name (default: the kind); load it "
                   "with `sparseattn compare --data NAME@OUT`")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_trace)


def build_parser() -> argparse.ArgumentParser:
    """The ``sparseattn`` argument parser with every subcommand."""
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

    add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on a usage or input error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, ImportError, FileNotFoundError) as exc:
        print(f"sparseattn {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
