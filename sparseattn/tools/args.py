"""Argument checks shared by the ``sparseattn`` command and the benchmark scripts.

Every check is an argparse ``type=`` (it runs while the command line is parsed, before any work) whose
message names the rule and the value received; :class:`OneLineParser` turns it into one line on stderr
naming the flag, and exit status 2::

    >>> ap = OneLineParser(prog="bench")
    >>> _ = ap.add_argument("--repeats", type=positive_int, default=3)
    >>> ap.parse_args(["--repeats", "4"]).repeats
    4
    >>> positive_int("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be >= 1; got 0

Parsing a bad value prints ``bench: error: --repeats must be >= 1; got 0 (see `bench --help`)``
and exits 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import NoReturn

__all__ = ["OneLineParser", "choice_arg", "choice_list_arg", "int_arg", "int_list_arg", "float_arg",
           "nonnegative_int", "positive_int"]


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line usage errors and exit status 2: ``prog: error: --k must be ...``.

    Messages of the ``type=`` checks below (``argument --k: must be ...``) are shortened to
    ``--k must be ...``; argparse's own messages (unknown flags, missing values) keep their wording.
    """

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        if message.startswith("argument ") and ": must be " in message:
            message = message[len("argument "):].replace(": must be ", " must be ", 1)
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _integer(text: str, rule: str) -> int:
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer {rule}; got {text!r}") from None


def int_arg(minimum: int | None = None, maximum: int | Callable[[], int] | None = None,
            what: str = "") -> Callable[[str], int]:
    """argparse type: an integer in ``[minimum, maximum]`` (``maximum`` may be a callable read at parse
    time); ``what`` is appended to the upper bound in messages, e.g. ``" (the CPUs here)"``."""

    def parse(text: str) -> int:
        hi = maximum() if callable(maximum) else maximum
        if hi is None:
            rule = f">= {minimum}" if minimum is not None else ""
        else:
            rule = f"from {minimum} to {hi}{what}" if minimum is not None else f"<= {hi}{what}"
        value = _integer(text, rule)
        if (minimum is not None and value < minimum) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {rule}; got {value}")
        return value

    parse.__name__ = "int"
    return parse


positive_int = int_arg(1)
positive_int.__doc__ = "argparse type: an integer >= 1."
nonnegative_int = int_arg(0)
nonnegative_int.__doc__ = "argparse type: an integer >= 0."


def float_arg(minimum: float = 0.0, *, strict: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number ``>= minimum`` (``> minimum`` when ``strict``)."""
    rule = f"{'>' if strict else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {rule}; got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {rule}; got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


def int_list_arg(minimum: int = 1, example: str = "64,128") -> Callable[[str], list[int]]:
    """argparse type: a non-empty comma list of integers, each ``>= minimum`` (e.g. ``"16384,65536"``)."""

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",")]
        if not text.strip() or any(not t for t in items):
            raise argparse.ArgumentTypeError(f"must be a comma list of integers >= {minimum} such as {example}; "
                                             f"got {text!r}")
        out = []
        for t in items:
            try:
                value = int(t.replace("_", ""))
            except ValueError:
                raise argparse.ArgumentTypeError(f"must be a comma list of integers >= {minimum} such as "
                                                 f"{example}; got {t!r} in {text!r}") from None
            if value < minimum:
                raise argparse.ArgumentTypeError(f"must be a comma list of integers >= {minimum} such as "
                                                 f"{example}; got {value} in {text!r}")
            out.append(value)
        return out

    parse.__name__ = "int list"
    return parse


def stem_arg(text: str) -> str:
    """argparse type: a file stem (letters, digits, ``-``, ``_``, ``.``; not starting with ``.``, not ending
    in ``.npz`` / ``.npy``, which would read back as a file path): the name of a file written inside the
    output folder, never a path out of it."""
    if (not text or text.startswith(".") or not all(c.isalnum() or c in "-_." for c in text)
            or text.lower().endswith((".npz", ".npy"))):
        raise argparse.ArgumentTypeError(f"must be a file stem of letters, digits, '-', '_' or '.' (not starting "
                                         f"with '.' nor ending in .npz / .npy; the folder is --out); got {text!r}")
    return text


def choice_arg(choices: Sequence[str]) -> Callable[[str], str]:
    """argparse type: one of ``choices``, with a message listing them."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}; got {text!r}")
        return text

    parse.__name__ = "choice"
    return parse


def choice_list_arg(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a non-empty comma list, each item one of ``choices`` (repeats dropped, order kept)."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if not items or bad:
            got = repr(text) if not items else ", ".join(map(repr, bad))
            raise argparse.ArgumentTypeError(f"must be a comma list of {', '.join(choices)}; got {got}")
        return list(dict.fromkeys(items))

    parse.__name__ = "choice list"
    return parse

