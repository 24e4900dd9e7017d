"""Timing torch's ``scaled_dot_product_attention``, the baseline of ``sparseattn compare``.

This module imports the standard library only (torch and numpy are passed in, or imported by
:func:`main`).  Besides serving :mod:`sparseattn.tools.bench` in-process, its text is run as a script in
a fresh interpreter, ``python -c <this file> NPZ CAUSAL(0/1) SCALE REPEATS THREADS``
(:func:`sparseattn.tools.bench.fresh_sdpa_seconds`), which never imports sparseattn or Numba, so nothing
of ours can have slowed torch there; it prints ``{"sdpa_s": median seconds, "threads": n}`` as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any


def warm_up(torch: Any) -> None:
    """One tiny SDPA call, so torch's runtime is set up before anything is timed (or loaded)."""
    x = torch.zeros((1, 2, 8, 4))
    with torch.no_grad():
        torch.nn.functional.scaled_dot_product_attention(x, x, x)


def sdpa_times(torch: Any, tq: Any, tk: Any, tv: Any, *, is_causal: bool, scale: float, repeats: int
               ) -> list[float]:
    """Seconds of each of ``repeats`` SDPA calls over the tensors ``tq``, ``tk``, ``tv``."""
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=is_causal, scale=scale)
            times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str]) -> None:
    """The fresh-process timing: argv = NPZ path (arrays q, k, v: (G, n, d)), causal "0"/"1", scale,
    repeats, threads; the arrays are timed as (1, G, n, d) tensors."""
    import numpy as np
    import torch

    path, causal, scale, repeats, n_threads = argv
    torch.set_num_threads(int(n_threads))
    warm_up(torch)
    with np.load(path) as f:
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(f[n]))[None] for n in ("q", "k", "v"))
    times = sdpa_times(torch, tq, tk, tv, is_causal=causal == "1", scale=float(scale), repeats=int(repeats))
    print(json.dumps({"sdpa_s": statistics.median(times), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main(sys.argv[1:])
