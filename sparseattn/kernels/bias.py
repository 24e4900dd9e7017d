"""Score biases evaluated inside the kernels, on the selected (i, j) pairs only.

Relative position schemes (ALiBi, T5 buckets) are a function b(i, j) of the query and key positions, so
a sparse kernel can apply them without ever forming an L x S matrix.  A bias is passed to a kernel as
plain arrays (no closures, so ``cache=True`` works):

* ``kind``    0 none, 1 ALiBi, 2 T5 buckets, 3 dense array gathered at (i, j);
* ``params``  float64 (H, P): ALiBi slope in column 0, or the T5 per-head bucket table;
* ``ints``    int64 (3,): T5 (bidirectional, num_buckets, max_distance);
* ``dense``   (Gb, L, S) additive bias for kind 3 (a (1, 1, 1) placeholder otherwise);
* ``bmap``    int64 (G,): which slice of ``dense`` group g uses;
* head index for kinds 1/2 is ``g % H`` (heads are the last leading dimension).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import options  # noqa: F401

BIAS_NONE = 0
BIAS_ALIBI = 1
BIAS_T5 = 2
BIAS_DENSE = 3


@njit(cache=True, inline="always")
def t5_bucket(rel, bidirectional, num_buckets, max_distance):
    """T5's relative-position bucket of ``rel = key_pos - query_pos`` (Raffel et al. 2020, HF layout)."""
    ret = 0
    nb = num_buckets
    if bidirectional:
        nb = nb // 2
        if rel > 0:
            ret += nb
        n = abs(rel)
    else:
        n = -rel if rel < 0 else 0
    max_exact = nb // 2
    if n < max_exact:
        return ret + n
    # + 1e-9: a boundary that is an exact integer in real arithmetic must land on the same bucket with
    # and without fastmath (log ratios like log(2)/log(32)*5 round either side of 1 otherwise).
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (nb - max_exact) + 1e-9)
    if large > nb - 1:
        large = nb - 1
    return ret + large


@njit(cache=True, inline="always")
def bias_value(kind, g, h, i, j, qpos, kpos, params, ints, dense, bmap):
    """The additive bias for query i (group g, head h) and key j."""
    if kind == 1:
        return -params[h, 0] * abs(kpos[j] - qpos[i])
    if kind == 2:
        b = t5_bucket(kpos[j] - qpos[i], ints[0] != 0, ints[1], ints[2])
        return params[h, b]
    if kind == 3:
        return dense[bmap[g], i, j]
    return 0.0


def no_bias_args(n_groups: int) -> tuple:
    """Kernel arguments meaning "no bias"."""
    return (BIAS_NONE, np.zeros((1, 1), np.float64), np.zeros(3, np.int64), np.zeros(1, np.int64),
            np.zeros(1, np.int64), np.zeros((1, 1, 1), np.float64), np.zeros(max(n_groups, 1), np.int64))
