"""The ``sparseattn`` command line: ``explain``, ``selectors``, ``compare``, ``decode``, ``bench`` and ``trace``.

* ``explain``: the tutorial's worked example, step by step;
* ``selectors``: every selector with its parameters and availability;
* ``compare``: selectors against exact attention on one workload (tables via :mod:`sparseattn.tools.report`);
* ``decode``: the decode workload of :class:`sparseattn.KVCache`, per cache selector
  (:mod:`sparseattn.tools.decode_report`);
* ``bench``: a benchmark suite (:mod:`sparseattn.tools.suite`);
* ``trace``: capture real Q/K/V traces from MiniLM (:mod:`sparseattn.traces`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .args import OneLineParser, choice_arg, int_arg, positive_int, stem_arg

_INT_MAX = 2**31 - 1  # FAISS and BLAS take C ints: a larger selector parameter overflows there


def _cpus() -> int:
    return os.cpu_count() or 1


_threads_arg = int_arg(1, _cpus, " (the CPUs here)")


def _scale_arg(text: str) -> float | None:
    if text == "default":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number such as 0.5, or 'default' for 1/sqrt(d); "
                                         f"got {text!r}") from None
    if not value == value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, or 'default'; got {text!r}")
    return value


def _cmd_explain(args: argparse.Namespace) -> int:
    from ..tutorial import attention_steps, seed_example

    e = seed_example()
    scale = args.scale
    steps = attention_steps(e["X"], e["W_query"], e["W_key"], e["W_value"], scale=scale)
    q = None if args.query is None else args.query - 1
    if q is not None and not 0 <= q < steps.queries.shape[0]:
        raise ValueError(f"--query must be between 1 and {steps.queries.shape[0]}; got {args.query}.")
    print("The tutorial's worked example (numbers: help(sparseattn.tutorial.example)), scale = "
          f"{'1/sqrt(3)' if scale is None else scale}")
    print(steps.format(decimals=args.decimals, query_index=q))
    return 0


def _cmd_selectors(args: argparse.Namespace) -> int:
    from ..selectors import selector_classes

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


# ------------------------------------------------------------------------------------------------------
# progress: a rich bar with ETA on a terminal, one summary line in a log, nothing with --quiet
# ------------------------------------------------------------------------------------------------------
PROGRESS_ENV = "SPARSEATTN_PROGRESS"  # "lines": one `[i/n] step` line per step wherever stderr goes


def _rich_progress() -> Any:
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
    except ImportError:  # rich is in the 'bench' extra; without it the line printer is used
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True))


@contextmanager
def progress_steps(total: int, title: str, *, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A callback ``say(step)`` called before each of ``total`` steps; progress goes to stderr.

    * ``quiet``: nothing;
    * ``SPARSEATTN_PROGRESS=lines`` in the environment: one ``[i/n] step`` line per step;
    * stderr a terminal: a progress bar with elapsed time and ETA (``rich``; ``[i/n] step`` lines without it);
    * otherwise (a log file, a pipe): one line when the steps are done, ``title: n steps in 12.3 s``.
    """
    if quiet:
        yield lambda msg: None
        return
    lines = os.environ.get(PROGRESS_ENV, "").strip().lower() == "lines"
    tty = sys.stderr.isatty()
    if not lines and not tty:
        started = time.perf_counter()
        yield lambda msg: None
        print(f"{title}: {total} steps in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        return
    bar = _rich_progress() if tty and not lines else None
    if bar is None:
        state = {"i": 0}

        def say_line(msg: str) -> None:
            state["i"] += 1
            print(f"[{state['i']}/{total}] {msg}", file=sys.stderr, flush=True)

        yield say_line
        return
    task = bar.add_task(title, total=total)
    started_any = {"any": False}

    def say_bar(msg: str) -> None:
        if started_any["any"]:
            bar.advance(task)
        started_any["any"] = True
        bar.update(task, description=f"{title}: {msg}")

    with bar:
        yield say_bar
        bar.update(task, completed=total, description=f"{title}: done")


def kernel_cache_cold() -> bool:
    """True when Numba's cache of sparseattn's kernels holds no compiled kernel yet (a first run compiles)."""
    from .._numba_setup import cache_dir

    root = Path(cache_dir())
    return not root.is_dir() or next(root.rglob("*.nbi"), None) is None


@contextmanager
def kernel_note(quiet: bool = False) -> Iterator[None]:
    """When Numba's kernel cache is cold, say before any kernel runs that the first run compiles the kernels
    (minutes) and afterwards how long it took; on a warm cache say nothing unless the run compiled for over
    a second (new argument types), measured with Numba's compiler events.
    """
    if quiet:
        yield
        return
    from numba.core import event

    cold = kernel_cache_cold()
    if cold:
        print("note: Numba compiles the kernels on the first run (this can take minutes) and caches them for "
              "later runs", file=sys.stderr, flush=True)
    spent: dict[str, float] = {"lock": 0.0, "compile": 0.0}
    with event.install_timer("numba:compiler_lock", lambda s: spent.__setitem__("lock", s)), \
            event.install_timer("numba:compile", lambda s: spent.__setitem__("compile", s)):
        yield
    if cold or spent["compile"] >= 1.0:
        print(f"note: kernel warm-up took {spent['lock']:.1f} s ({spent['compile']:.1f} s compiling, the rest "
              f"loading from the cache)", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------
# up-front checks: every user error is reported before any work, naming the option and the fix
# ------------------------------------------------------------------------------------------------------
def check_out_dir(path: str, option: str = "--out") -> None:
    """Raise ``ValueError`` unless ``path`` is a folder, or can be created as one, and is writable."""
    if not path.strip():
        raise ValueError(f"{option}: empty path; give a folder path (created if missing).")
    try:
        _check_out_dir(path, option)
    except OSError as exc:  # e.g. a name longer than the file system allows
        shown = path if len(path) <= 80 else path[:77] + "..."
        raise ValueError(f"{option} {shown}: {exc.strerror or exc}; choose another folder path.") from None


def _check_out_dir(path: str, option: str) -> None:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option} {path}: exists and is not a folder; give a folder path (created if missing).")
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: {parent} is a file, not a folder; give a path under a folder.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: no permission to write in {parent}; choose another folder.")
    missing = []  # the folders to create, deepest first: created once as a probe, then removed again
    q = p
    while not q.exists():
        missing.append(q)
        q = q.parent
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot create the folder ({exc.strerror}); choose another "
                         f"folder.") from None
    finally:
        for q in missing:
            if q.is_dir():
                q.rmdir()


def check_selector_specs(specs: Sequence[str], option: str = "--selectors") -> list[str]:
    """Parse and construct every selector spec (not built); ``ValueError``/``ImportError`` name the spec.

    Checks: known names, known parameters given once, values of the right type and range (integers at
    most 2**31 - 1, the C int the FAISS and BLAS calls take), and availability of the backend.
    """
    from ..selectors import get_selector, selector_classes
    from ..selectors.params import parse_value

    classes = selector_classes()
    out = []
    for spec in specs:
        for piece in spec.split("+"):
            name, _, rest = piece.strip().partition(":")
            name = name.strip()
            seen: set[str] = set()
            for item in filter(None, (x.strip() for x in rest.split(","))):
                key, _, text = item.partition("=")
                key = key.strip()
                if key in seen:
                    raise ValueError(f"{option} {spec!r}: parameter {key!r} of {name!r} is given twice; give it "
                                     f"once.")
                seen.add(key)
                p = classes[name].params_spec.get(key) if name in classes else None
                value = parse_value(text) if p is not None and p.type is int else None
                if isinstance(value, int) and not isinstance(value, bool) and key != "seed" \
                        and abs(value) > _INT_MAX:
                    raise ValueError(f"{option} {spec!r}: {name}: parameter {key}={value} is too large; use at "
                                     f"most {_INT_MAX:,}.")
        try:
            get_selector(spec)
        except (ValueError, TypeError, ImportError) as exc:
            raise type(exc)(f"{option} {spec!r}: {exc} (see `sparseattn selectors`)") from None
        out.append(spec)
    return out


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_memory(need: float, what: str, fix: str) -> None:
    avail = _available_bytes()
    if avail is not None and need > avail:
        raise MemoryError(f"{what} needs about {need / 2**30:,.1f} GiB but {avail / 2**30:,.1f} GiB are "
                          f"available; {fix}.")


def _resolve_data(spec: str, max_groups: int | None) -> tuple[str, dict[str, int], Any]:
    """The spec bench.compare loads, the workload's shape (groups, L, S, E, Ev), and a user trace or None."""
    from .. import data as data_mod
    from . import bench

    if spec.startswith("synthetic"):
        try:
            nq, n, d, dv = data_mod.synthetic_sizes(spec)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"--data {spec}: {exc}") from None
        _check_memory(8.0 * (nq * d + n * d + n * dv), f"--data {spec}", "lower n (or d)")
        return spec, {"groups": 1, "L": nq, "S": n, "E": d, "Ev": dv}, None
    if data_mod.is_user_data(spec):
        try:
            trace = data_mod.load_user(spec)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise ValueError(f"--data: {exc}") from None
        if "@" in spec:
            raise ValueError(f"--data {spec}: a path holding '@' is read as NAME@DIR; rename or link the file.")
        G = int(trace.q.size // (trace.q.shape[-1] * trace.q.shape[-2]))
        groups = G if max_groups is None else min(G, max_groups)
        shape = {"groups": groups, "L": trace.q.shape[-2], "S": trace.k.shape[-2], "E": trace.q.shape[-1],
                 "Ev": trace.v.shape[-1]}
        return f"{spec}@{os.getcwd()}", shape, trace
    if "@" not in spec and spec not in data_mod.FIXTURES:
        raise ValueError(f"--data: unknown data {spec!r}: no such file or fixture; give window, store, NAME@DIR, "
                         f"synthetic:n=...,d=..., or your arrays: FILE.npz, a folder holding q.npy, k.npy, "
                         f"v.npy, or q.npy,k.npy,v.npy (see `sparseattn compare --help`).")
    try:
        wl = bench.load_workload(spec, max_groups=max_groups)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise ValueError(f"--data {spec}: {exc}") from None
    return spec, wl.shape, None


def _check_k(k: int, shape: dict[str, int], data: str) -> None:
    if k > shape["S"]:
        raise ValueError(f"--k {k} exceeds the {shape['S']:,} keys per group of --data {data}; use --k <= "
                         f"{shape['S']:,}.")
    pairs = shape["groups"] * shape["L"] * k
    _check_memory(16.0 * pairs, f"--k {k} ({pairs:,} selected (query, key) pairs)", "lower --k")


def _add_run_args(p: argparse.ArgumentParser, thread_users: str, out_what: str) -> None:
    """The options ``compare`` and ``decode`` share: --threads, --out, --format, --quiet."""
    p.add_argument("--threads", type=_threads_arg, default=None,
                   help=f"threads for {thread_users}, 1 to the CPU count (default: all cores)")
    p.add_argument("--out", default="sparseattn-report", help=f"{out_what} (default ./sparseattn-report; not "
                   "created for --format table)")
    p.add_argument("--format", default="table,json,md,html", help="comma list of table,json,md,html")
    p.add_argument("--quiet", action="store_true", help="no progress or warm-up notes on stderr")


def _cmd_compare(args: argparse.Namespace) -> int:
    from ..threads import get_num_threads, threads
    from . import bench, report

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = sorted(set(formats) - set(_FORMATS))
    if bad or not formats:
        raise ValueError(f"--format: unknown {bad}; choose from {', '.join(_FORMATS)}.")
    files = [f for f in formats if f != "table"]
    if files:
        check_out_dir(args.out)
    specs = check_selector_specs(args.selectors) if args.selectors else bench.default_selectors(None)
    data_spec, shape, trace = _resolve_data(args.data, args.max_groups)
    _check_k(args.k, shape, args.data)
    if trace is not None and args.causal and trace.positions:
        L, S = shape["L"], shape["S"]
        import numpy as np

        default = {"q_pos": np.arange(L), "k_pos": np.arange(S)}
        if any(not np.array_equal(p, default[r]) for r, p in trace.positions.items()):
            raise ValueError(f"--data {args.data}: q_pos/k_pos other than 0..L-1 / 0..S-1 cannot be used with "
                             f"--causal yet (compare measures query i seeing keys j <= i); drop them or --causal.")
    with threads(get_num_threads() if args.threads is None else args.threads), kernel_note(args.quiet), \
            progress_steps(len(specs) + 1, "compare", quiet=args.quiet) as say:
        try:
            result = bench.compare(data_spec, specs, k=args.k, is_causal=args.causal, repeats=args.repeats,
                                   max_groups=args.max_groups, progress=say, quality_rows=args.quality_rows)
        except ValueError as exc:
            if "overflow" not in str(exc):
                raise
            # the data's magnitudes, not an option (compare computes in float32, whatever the file holds)
            raise ValueError(f"--data {args.data}: {str(exc).split(';')[0].rstrip('.')}; compare computes in "
                             f"float32 whatever the file's dtype: smaller keys and queries in the data file, or a "
                             f"smaller 'scale' array in it.") from None
    result["data"] = args.data
    if trace is not None:
        result["workload"]["description"] = trace.meta["description"]
    _show(result, formats, files, args, report.render_text, report.write_compare)
    failed = [r for r in result["results"] if "error" in r]
    for r in failed:
        print(f"sparseattn compare: error: selector {r['selector']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


def _show(result: dict[str, Any], formats: list[str], files: list[str], args: argparse.Namespace,
          render_text: Callable[[dict[str, Any]], str],
          write: Callable[[dict[str, Any], str, list[str]], list[Any]]) -> None:
    """Print the table (format "table"), write the files and say where, and warn (unless --quiet) when the
    SDPA baseline looked slowed down (``result["fairness"]``)."""
    from . import bench

    if "table" in formats:
        print(render_text(result))
    if files:
        for p in write(result, args.out, files):
            print(f"wrote {p}")
    advice = bench.fairness_advice(result.get("fairness"))
    if advice and not args.quiet:
        print(advice, file=sys.stderr)


def _check_formats(text: str) -> list[str]:
    formats = [f.strip() for f in text.split(",") if f.strip()]
    bad = sorted(set(formats) - set(_FORMATS))
    if bad or not formats:
        raise ValueError(f"--format: unknown {bad}; choose from {', '.join(_FORMATS)}.")
    return formats


def _open_decode_source(spec: str) -> Any:
    """The key source of ``decode --data`` (:func:`sparseattn.tools.decode_report.open_source`), errors naming --data."""
    from .. import data as data_mod
    from . import decode_report

    if spec.startswith("synthetic"):
        try:
            nq, n, d, dv = data_mod.synthetic_sizes(spec)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"--data {spec}: {exc}") from None
        _check_memory(4.0 * n * (d + dv), f"--data {spec}", "lower n (or d)")
    elif not data_mod.is_user_data(spec) and "@" not in spec and spec not in data_mod.FIXTURES:
        raise ValueError(f"--data: unknown data {spec!r}: no such file or fixture; give store, window, NAME@DIR, "
                         f"synthetic:n=...,d=..., or your arrays: FILE.npz, a folder holding q.npy, k.npy, "
                         f"v.npy, or q.npy,k.npy,v.npy (see `sparseattn decode --help`).")
    try:
        return decode_report.open_source(spec)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        msg = str(exc)
        raise ValueError(f"--data: {msg}" if msg.startswith(spec) else f"--data {spec}: {msg}") from None


def _cmd_decode(args: argparse.Namespace) -> int:
    import importlib.util

    import numpy as np

    from ..threads import get_num_threads, threads
    from . import decode_report

    formats = _check_formats(args.format)
    files = [f for f in formats if f != "table"]
    if files:
        check_out_dir(args.out)
    names = [x for item in args.selectors for x in decode_report.split_selectors(item)]
    if not names:
        raise ValueError("--selectors: give at least one cache selector, e.g. cluster,pages,window,topk.")
    try:
        selectors = decode_report.check_selectors(names)
    except (ValueError, TypeError, ImportError) as exc:
        raise type(exc)(f"--selectors: {exc}") from None
    src = _open_decode_source(args.data)
    heads = src.default_heads() if args.heads is None else args.heads
    if src.groups is not None and heads > src.groups:
        raise ValueError(f"--heads {heads} exceeds the {src.groups} heads (groups) of --data {args.data}; use "
                         f"--heads <= {src.groups}.")
    if src.n_keys < 2:  # one prompt key and one step at least: no --steps fits
        raise ValueError(f"--data {args.data} has {src.n_keys:,} key(s) per head; decode needs at least 2 (a "
                         f"prompt of one key and one decode step): pass data with more keys.")
    if args.steps >= src.n_keys:
        raise ValueError(f"--steps {args.steps} leaves no prompt: --data {args.data} has {src.n_keys:,} keys per "
                         f"head; use --steps <= {src.n_keys - 1:,}.")
    length = src.n_keys - args.steps if args.length is None else args.length
    if length + args.steps > src.n_keys:
        raise ValueError(f"--length {length:,} + --steps {args.steps} exceeds the {src.n_keys:,} keys per head of "
                         f"--data {args.data}; use --length <= {src.n_keys - args.steps:,} (or fewer --steps).")
    total = length + args.steps
    if args.k > total:
        raise ValueError(f"--k {args.k:,} exceeds the {total:,} keys the cache holds at the last step (--length "
                         f"+ --steps); use --k <= {total:,}.")
    kv = heads * total * 4.0 * (src.head_dim + src.value_dim)  # float32 keys + values
    # the workload, one cache per selector (capacity headroom 1.5x) and the reference's float64 copies
    _check_memory(kv * (2 + 1.5 * (len(selectors) + 1)) + min(2 * kv, 2**30),
                  f"--length {length:,} x --heads {heads} ({len(selectors) + 1} caches)", "lower --length or --heads")
    sdpa = not args.no_sdpa and importlib.util.find_spec("torch") is not None
    n_threads = get_num_threads() if args.threads is None else args.threads
    with threads(n_threads):
        try:
            wl = src.workload(heads, length, args.steps)
        except ValueError as exc:
            raise ValueError(f"--data {args.data}: {exc}") from None
        if args.dtype == "float16":
            for name, arr in (("keys", wl.k), ("values", wl.v)):
                big = float(np.abs(arr).max(initial=0.0))
                if big > 65504.0:
                    raise ValueError(f"--dtype float16: the {name} of --data {args.data} reach {big:.3g}, beyond "
                                     f"float16's range (65504); use --dtype float32 or --dtype bfloat16.")
        with kernel_note(args.quiet), \
                progress_steps(args.steps + 1 + int(sdpa), "decode", quiet=args.quiet) as say:
            try:
                result = decode_report.run_decode(wl, selectors, k=args.k, dtype=args.dtype, sdpa=not args.no_sdpa,
                                                  progress=say)
            except ValueError as exc:
                if "overflow" not in str(exc):
                    raise
                # the data's magnitudes, not an option: say which input and what can change
                raise ValueError(f"--data {args.data}: {str(exc).rstrip('.')} (for this command: smaller keys and "
                                 f"queries in the data file, or a smaller 'scale' array in it).") from None
    _show(result, formats, files, args, decode_report.render_text, decode_report.write_decode)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench, suite

    check_out_dir(args.out)
    with kernel_note(args.quiet):  # compiles into the cache the per-case subprocesses load from
        bench.warm_up()
    n_cases = len(suite.SUITES[args.suite]["cases"])
    with progress_steps(n_cases, f"bench {args.suite}", quiet=args.quiet) as say:
        path = suite.run_suite(args.suite, args.out, threads=args.threads, repeats=args.repeats, progress=say)
    print(f"wrote {path}")
    failed = suite.failed_cases(path)
    if failed:
        last = failed[0]["error"][-1] if failed[0]["error"] else "no message"
        what = "every case" if len(failed) == n_cases else f"{len(failed)} of {n_cases} cases"
        print(f"sparseattn bench: error: {what} failed (first: {failed[0]['case']['data']}: {last}); "
              f"details in {path}" + ("; no table or plots written" if len(failed) == n_cases else ""),
              file=sys.stderr)
        return 1
    return 0


#: ``trace llm --model``: (GGUF_MODELS key, context in tokens, default layer, its full-attention layers, query heads)
_TRACE_LLM_MODELS = {"smollm2": ("smollm2-135m", 8192, 3, tuple(range(30)), 9),
                     "gemma3": ("gemma3-270m", 32768, 5, (5, 11, 17), 4)}
#: options of ``trace`` and the kinds that read them (the others refuse them rather than ignore them)
_TRACE_OPTIONS = {"model": ("llm",), "chunk": ("llm",), "n_windows": ("window",), "n_keys": ("store", "llm"),
                  "n_queries": ("store", "llm"), "layer": ("store", "llm"), "heads": ("store", "llm")}


def _cmd_trace_llm(args: argparse.Namespace) -> int:
    """``trace llm``: one full-attention layer of a packaged causal LM (the llm extra) over a KJV window, as a
    decode workload."""
    from pathlib import Path

    args.model = "smollm2" if args.model is None else args.model
    gguf, context, default_layer, full_layers, n_heads = _TRACE_LLM_MODELS[args.model]
    args.n_keys = 4096 if args.n_keys is None else args.n_keys
    args.n_queries = 256 if args.n_queries is None else args.n_queries
    layer = default_layer if args.layer is None else args.layer
    if args.n_keys > context or args.n_queries > args.n_keys:
        raise ValueError(f"trace llm: --n-keys must be <= {context} ({args.model}'s context) and --n-queries <= "
                         f"--n-keys; got --n-keys {args.n_keys}, --n-queries {args.n_queries}.")
    if layer not in full_layers:  # known before the model loads
        shown = f"0 to {full_layers[-1]}" if full_layers == tuple(range(len(full_layers))) else \
            ", ".join(map(str, full_layers))
        raise ValueError(f"trace llm: --layer {layer} is not a full-attention layer of {args.model}; use one of "
                         f"{shown}.")
    heads = _heads_arg(args.heads, n_heads)
    check_out_dir(args.out)
    import numpy as np
    import torch

    from ..hf import load_gguf_model
    from ..hf_cache import capture_decode_trace
    from . import traces

    model, tok = load_gguf_model(gguf)
    bos = list(tok("").input_ids)  # what the tokenizer puts first: [<bos>] for Gemma, [] for SmolLM2
    verses = traces.kjv_text().split("\n")
    start = int(np.random.default_rng(args.seed).integers(0, len(verses) // 2))
    ids: list[int] = list(bos)
    for verse in verses[start:]:
        ids.extend(tok.encode(verse + " ", add_special_tokens=False))
        if len(ids) >= args.n_keys:
            break
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"{args.name or f'llm-L{layer}'}.npz"
    capture_decode_trace(model, torch.tensor([ids[:args.n_keys]]), path, layer=layer, heads=heads,
                         n_queries=args.n_queries, chunk=2048 if args.chunk is None else args.chunk)
    print(f"wrote {path} (sparseattn decode --data {path})")
    return 0


def _heads_arg(text: str | None, n_heads: int) -> list[int] | None:
    """``--heads`` of ``trace``: a comma list of distinct heads in [0, n_heads), or None (all)."""
    if text is None:
        return None
    try:
        heads = [int(h) for h in text.split(",")]
    except ValueError:
        raise ValueError(f"--heads must be a comma list of integers such as 0,1; got {text!r}.") from None
    if any(not 0 <= h < n_heads for h in heads) or len(set(heads)) != len(heads):
        raise ValueError(f"--heads must list distinct heads from 0 to {n_heads - 1}; got {text!r}.")
    return heads


def _cmd_trace(args: argparse.Namespace) -> int:
    from . import traces

    unused = [f"--{name.replace('_', '-')}" for name, kinds in _TRACE_OPTIONS.items()
              if getattr(args, name) is not None and args.kind not in kinds]
    if unused:
        raise ValueError(f"trace {args.kind} does not use {', '.join(unused)}; drop {'it' if len(unused) == 1 else 'them'} "
                         f"(see `sparseattn trace --help` for which kind reads which option).")
    if args.kind == "llm":
        return _cmd_trace_llm(args)
    args.n_keys = 16384 if args.n_keys is None else args.n_keys
    args.n_queries = 2048 if args.n_queries is None else args.n_queries
    check_out_dir(args.out)
    kwargs: dict[str, Any] = {"seed": args.seed}
    if args.kind == "window":
        kwargs["n_windows"] = 2 if args.n_windows is None else args.n_windows
    else:
        if args.layer is not None and args.layer >= 6:  # before loading the model: all-MiniLM-L6-v2 has 6 layers
            raise ValueError(f"trace store: --layer {args.layer} is not a layer of all-MiniLM-L6-v2; use 0 to 5.")
        kwargs.update(n_keys=args.n_keys, n_queries=args.n_queries, layer=3 if args.layer is None else args.layer)
        heads = _heads_arg(args.heads, 12)
        if heads is not None:
            kwargs["heads"] = heads
    with progress_steps(traces.GENERATE_STEPS, f"trace {args.kind}", quiet=args.quiet) as say:
        out = traces.generate_traces(args.out, args.kind, name=args.name, progress=say, **kwargs)
    print(f"wrote {out}")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``compare``, ``decode``, ``bench`` and ``trace`` on the ``sparseattn`` parser."""
    from ..data import USER_DATA_HELP
    from .bench import DEFAULT_DATA, DEFAULT_QUALITY_ROWS, DEFAULT_SELECTORS
    from .suite import SUITES

    p = sub.add_parser("compare", help="compare selectors against dense attention (accuracy and speed)",
                       description="Run selectors and exact attention side by side on one workload and "
                                   "report speed and accuracy. Default: the shipped store, 4 heads x 2,048 "
                                   "real MiniLM queries against 16,384 real keys, with the estimation zone "
                                   "(estimate=-1) and routing by mass (top_p) among the selectors. "
                                   "Your own Q/K/V: --data FILE.npz (" + USER_DATA_HELP + "); every (B, H) "
                                   "pair is one group.")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="store | window | NAME@DIR (a trace written by `sparseattn trace --name NAME --out DIR`) | "
                        "synthetic:n=65536,d=64,kind=gaussian|clustered|correlated | your arrays: FILE.npz, a "
                        f"FOLDER with q.npy k.npy v.npy, or q.npy,k.npy,v.npy (default {DEFAULT_DATA}: 16,384 "
                        "real keys; window: 512-token windows)")
    p.add_argument("--selectors", nargs="+", default=None,
                   help="selector specs, e.g. topk window:width=64 'window+sinks+faiss-hnsw:M=32' (default: "
                        f"{' '.join(DEFAULT_SELECTORS)}; see `sparseattn selectors`)")
    p.add_argument("--k", type=positive_int, default=64,
                   help="keys per query for top-k selectors, at most the keys per group (default 64)")
    p.add_argument("--causal", action="store_true", help="causal attention (query i sees keys j <= i)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timing repeats; medians are reported (default 3)")
    p.add_argument("--max-groups", type=positive_int, default=12,
                   help="evaluate this many evenly spaced (batch, head) groups of multi-group data (default 12)")
    p.add_argument("--quality-rows", type=positive_int, default=DEFAULT_QUALITY_ROWS,
                   help="query rows per group whose recall, mass and output error are computed in float64, "
                        f"evenly spaced (default {DEFAULT_QUALITY_ROWS})")
    _add_run_args(p, "Numba/FAISS/BLAS", "output folder")
    p.set_defaults(func=_cmd_compare)

    from .decode_report import DEFAULT_HEADS, DEFAULT_SELECTORS, DTYPES

    p = sub.add_parser("decode", help="measure KVCache decode steps per selector (latency, memory, accuracy)",
                       description="Fill a KVCache with --length keys (one append), then run --steps decode "
                                   "steps (append one token, attend one query per head) on one cache per "
                                   "selector, side by side; report per-step latency p50/p99, append cost, "
                                   "index memory and accuracy against exact attention, next to our dense step "
                                   "and torch SDPA (timed again in a fresh process). Default: the shipped "
                                   "store trace (16,384 keys, 4 heads).")
    p.add_argument("--data", default="store",
                   help="store | window | NAME@DIR | synthetic:n=65536,d=64,kind=gaussian|clustered|correlated "
                        "(one seeded call per head: seed, seed+1, ...) | your arrays: FILE.npz, a FOLDER with "
                        "q.npy k.npy v.npy, or q.npy,k.npy,v.npy; keys are appended in position order "
                        "(default store)")
    p.add_argument("--length", type=positive_int, default=None,
                   help="keys in the cache before the first step (default: the data's keys minus --steps)")
    p.add_argument("--heads", type=positive_int, default=None,
                   help=f"heads (evenly spaced groups of the data; default: the data's, at most "
                        f"{DEFAULT_HEADS}; synthetic: 4)")
    p.add_argument("--selectors", nargs="+", default=[",".join(DEFAULT_SELECTORS)],
                   help=f"comma list of cache selectors (default {','.join(DEFAULT_SELECTORS)}; dense is always "
                        f"measured; others: see help(sparseattn.KVCache))")
    p.add_argument("--k", type=positive_int, default=64,
                   help="keys per query of the topk selector, and the k of recall@k (default 64)")
    p.add_argument("--steps", type=positive_int, default=64, help="decode steps timed (default 64)")
    p.add_argument("--dtype", type=choice_arg(DTYPES), default="float32",
                   help="storage of the cache: float32, float16 or bfloat16 (default float32)")
    p.add_argument("--no-sdpa", action="store_true", help="do not time torch SDPA")
    _add_run_args(p, "Numba/BLAS/torch", "output folder for decode.json/.md/.html")
    p.set_defaults(func=_cmd_decode)

    p = sub.add_parser("bench", help="run the benchmark suite (time vs n, accuracy vs speed, recall vs k)",
                       description="Run a benchmark suite, each case in its own subprocess; exits 1 when any "
                                   "case fails (details in the suite JSON).")
    p.add_argument("--suite", default="quick", choices=sorted(SUITES), help="quick (minutes) or full sweep")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), help="output folder")
    p.add_argument("--threads", type=_threads_arg, default=None,
                   help="threads per case, 1 to the CPU count (default: all cores)")
    p.add_argument("--repeats", type=positive_int, default=None, help="override the suite's repeats (>= 1)")
    p.add_argument("--quiet", action="store_true", help="no progress or warm-up notes on stderr")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("trace", help="capture real Q/K/V traces from MiniLM (needs the 'traces' extra), or with "
                       "'llm' one full-attention layer's keys/values/decode queries of SmolLM2-135M or Gemma 3 "
                       "270M (the 'llm' extra)")
    p.add_argument("kind", choices=["window", "store", "llm"])
    p.add_argument("--model", choices=sorted(_TRACE_LLM_MODELS), default=None,
                   help="llm: smollm2 (8,192-token context, the default) or gemma3 (32,768; layers 5, 11, 17 are "
                        "global)")
    p.add_argument("--chunk", type=positive_int, default=None,
                   help="llm: tokens per forward pass of the capture (default 2048)")
    p.add_argument("--out", default="data", help="output folder (default ./data)")
    p.add_argument("--n-windows", type=positive_int, default=None, help="window: windows to capture (default 2)")
    p.add_argument("--n-keys", type=positive_int, default=None, help="store: default 16384; llm: tokens of text "
                   "(<= the model's context, default 4096)")
    p.add_argument("--n-queries", type=positive_int, default=None, help="store: default 2048; llm: decode queries "
                   "(the last positions, default 256)")
    p.add_argument("--layer", type=int_arg(0), default=None,
                   help="store: MiniLM layer (default 3); llm: a full-attention layer (default 3 for smollm2, "
                        "5 for gemma3)")
    p.add_argument("--heads", default=None, help="store / llm: comma list of heads (default all: 12 for store)")
    p.add_argument("--name", type=stem_arg, default=None, help="file stem and manifest name (default: the kind); load it "
                   "with `sparseattn compare --data NAME@OUT`")
    p.add_argument("--seed", type=int_arg(0), default=0)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_cmd_trace)


def plain_text(rest: str) -> str:
    """reST inline markup as plain text for ``--help``: ````x```` -> ``x``, ``:mod:`a.b``` -> ``a.b``,
    ``:func:`~a.b``` -> ``b``; line breaks kept."""
    text = re.sub(r":[a-z]+(?::[a-z]+)?:`~[\w.]*?\.?(\w+)`", r"\1", rest)
    text = re.sub(r":[a-z]+(?::[a-z]+)?:`([^`]+)`", r"\1", text)
    return text.replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    """The ``sparseattn`` argument parser with every subcommand."""
    from .. import __version__

    parser = OneLineParser(prog="sparseattn", description=plain_text(__doc__),
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="Exit status: 0 success, 1 a run failed (a selector or bench case), 2 a usage\n"
                                  "or input error, 130 interrupted. SPARSEATTN_DEBUG=1 shows tracebacks.\n"
                                  "Progress goes to stderr: a bar on a terminal, one summary line otherwise\n"
                                  f"({PROGRESS_ENV}=lines: one line per step); --quiet: none.")
    parser.add_argument("--version", action="version", version=f"sparseattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explain", help="print the tutorial's worked example step by step")
    p.add_argument("--scale", type=_scale_arg, default=1.0, help="score scale: a number, or 'default' for "
                   "1/sqrt(d) (default 1, as in the tutorial)")
    p.add_argument("--query", type=int_arg(1), default=None, help="only this query (1-based)")
    p.add_argument("--decimals", type=int_arg(0, 17), default=6, help="digits after the point (0-17)")
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser("selectors", help="list selectors, their parameters and availability")
    p.set_defaults(func=_cmd_selectors)

    add_subcommands(sub)
    return parser


# User errors (exit 2): bad options, unreadable or malformed input, impossible sizes.
_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, ImportError, OSError, OverflowError,
                                                 MemoryError, zipfile.BadZipFile)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "(no message)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    0 success; 1 a run failed (a selector or a bench case) or an unexpected error; 2 a usage or input
    error; 130 interrupted (Ctrl-C).  ``--help`` and ``--version`` print and raise ``SystemExit(0)``.  Errors print one line ``sparseattn <command>: error: ...`` on stderr
    (set ``SPARSEATTN_DEBUG=1`` for the traceback).
    """
    command = "sparseattn"
    debug = os.environ.get("SPARSEATTN_DEBUG", "") not in ("", "0")
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # a usage error (already printed as one line): its status; --help, --version: 0
            if exc.code in (0, None):
                raise
            return exc.code if isinstance(exc.code, int) else 2
        command = f"sparseattn {args.command}"
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except _USER_ERRORS as exc:
        if debug:
            raise
        plain = type(exc) in (ValueError, TypeError, ImportError, ModuleNotFoundError)  # messages name the fix
        msg = _one_line(exc) if plain else f"{type(exc).__name__}: {_one_line(exc)}"
        print(f"{command}: error: {msg}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the safety net: one line, never a traceback
        if debug:
            raise
        print(f"{command}: error: {type(exc).__name__}: {_one_line(exc)} (set SPARSEATTN_DEBUG=1 for the "
              f"traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
