"""Aligned dyadic position blocks: the decomposition of a causal prefix that the causal selectors'
per-block indexes use (``angular-lsh``, ``faiss-*``, ``kdtree``; see
:class:`~sparseattn.selectors.base.Selector`).

A causal query at position ``t`` sees the prefix of ``c`` keys with position <= ``t`` (in position order).
That prefix is covered by (:func:`dyadic_cover`):

* an *exact tail* ``[B * floor(c / B), c)`` of fewer than ``B`` keys, read exactly, and
* aligned dyadic blocks ``[t * 2^l * B, (t + 1) * 2^l * B)``, one per set bit of ``floor(c / B)``
  (the binary decomposition of the rest of the prefix), each a whole block the query may see.

An index built on one block's keys alone never depends on a later key, so which keys a row reads is
strictly causal.  :func:`scatter_rows` gathers the per-block candidates of such searches.  (The cluster
selector uses one :class:`~sparseattn.index.causal.CausalClusterIndex` instead.)
"""

from __future__ import annotations

import numpy as np

__all__ = ["dyadic_cover", "scatter_rows"]


def dyadic_cover(exact_from: np.ndarray, block: int) -> list[tuple[int, list[tuple[int, np.ndarray]]]]:
    """The aligned dyadic blocks covering each row's ``[0, exact_from[i])``.

    Parameters
    ----------
    exact_from : (L,) int64 array
        Multiples of ``block`` (smaller values are rounded down to one): where each row's exact part starts.
    block : int >= 1
        The smallest block size B.

    Returns
    -------
    ``[(level, [(t, rows), ...]), ...]`` by increasing level: block ``t`` of level ``l`` covers
    ``[t * B * 2^l, (t + 1) * B * 2^l)`` and belongs to ``rows`` (int64, ascending).  A row has at most
    one block per level (bit ``l`` of ``exact_from[i] // B``); its blocks are disjoint and cover
    ``[0, exact_from[i])`` exactly.
    """
    n_full = np.asarray(exact_from, dtype=np.int64) // block
    out: list[tuple[int, list[tuple[int, np.ndarray]]]] = []
    if n_full.size == 0:
        return out
    for level in range(int(n_full.max()).bit_length()):
        has = ((n_full >> level) & 1) == 1
        if not has.any():
            continue
        t_idx = (n_full >> (level + 1)) << 1  # block index at this level after clearing the lower bits
        out.append((level, [(int(t), np.flatnonzero(has & (t_idx == t))) for t in np.unique(t_idx[has])]))
    return out


def scatter_rows(found: list[tuple[np.ndarray, np.ndarray]], n_rows: int) -> np.ndarray:
    """(n_rows, width) int64 candidate ids, -1 padded, from ``(rows, ids)`` pieces (``ids`` (len(rows), w_i));
    width is the widest piece.  Gathers the per-block candidates of causal searches."""
    width = max((ids.shape[1] for _, ids in found), default=0)
    out = np.full((n_rows, width), -1, dtype=np.int64)
    for rows, ids in found:
        out[rows, :ids.shape[1]] = ids
    return out
