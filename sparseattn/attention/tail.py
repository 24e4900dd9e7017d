"""Tail estimate: what the keys a pattern did not select contribute, from a seeded uniform sample of them.

For query row i with scores ``s_j`` (scaled, plus bias), selected keys ``P`` and unselected visible keys
``U`` (``u = |U|``; causal rows see only keys at positions <= theirs), exact attention is
``(N_P + N_U) / (D_P + D_U)`` with ``N_X = Σ_{j∈X} exp(s_j) v_j`` and ``D_X = Σ_{j∈X} exp(s_j)``.
:class:`Tail` draws ``m' = min(m, u)`` keys of ``U`` uniformly without replacement and estimates

    N̂_U = (u / m') Σ_{j∈sample} exp(s_j) v_j,        D̂_U = (u / m') Σ_{j∈sample} exp(s_j)

(the Horvitz-Thompson estimator: each tail key is drawn with probability ``m'/u``), which are *unbiased*
for ``N_U`` and ``D_U``.  The output ``(N_P + N̂_U) / (D_P + D̂_U)`` is a ratio estimator: consistent, with
a bias of order ``1/m'`` (it shrinks as the sample grows, and is zero when ``m' = u``: then the whole tail
is read with weight 1 and the result is exact attention).  The returned lse is ``log(D_P + D̂_U)``, an
unbiased-in-exp estimate of the full row's log-sum-exp.

Numerically the sampled keys are attended like a second pattern (the fused kernel gives their normalised
output and lse), their lse is shifted by ``log(u/m')``, and the two parts are combined by the one
log-sum-exp merge (:mod:`sparseattn.kernels.merge`).  Cost: ``m`` more keys read per row; keys read are
reported by the result (:attr:`SparseAttentionResult.tail_patterns`).

Uniform sampling is the right tail model when the mass outside the top keys is spread out (flat real
attention); when a few unselected keys dominate it, the variance is high and more selected keys help more
than more samples.  ``shrink=c > 0`` trades the unbiasedness for lower error on such rows: the tail's
weight is multiplied by ``λ = ESS / (ESS + c)``, where ``ESS = (Σ a_j)² / Σ a_j²`` is the effective sample
size of the sampled keys' weights ``a_j = exp(s_j)``.  A sample dominated by one or two keys (small ESS,
a noisy estimate) then counts little, a flat sample (ESS near ``m'``) nearly fully.  The result is biased
towards treating the tail as zero (rows that read their whole tail stay exact); ``shrink=0`` (default) is
the unbiased-denominator estimator above.
The ESS uses the scaled scores ``q·k``, without ``bias``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.sample import sample_tail
from ..pattern import SparsePattern

__all__ = ["Tail", "as_tail", "shrink_log_weights", "tail_patterns"]


@dataclass(frozen=True)
class Tail:
    """Estimate the unselected keys' contribution from ``samples`` uniformly drawn keys per query.

    Parameters
    ----------
    samples : int
        Keys drawn per query row from its unselected visible keys (>= 1).  With ``samples`` >= the number
        of unselected keys the whole tail is read and the result is exact.
    seed : int
        Seed of the draw (default 0).  Each (batch, head) group and row has its own stream, so the draw
        does not depend on thread count or row order.
    shrink : float
        0 (default): the unbiased Horvitz-Thompson weights.  ``c > 0``: each row's tail weight times
        ``ESS / (ESS + c)`` (see the module docstring; biased, lower error where a few keys dominate the
        sample).
    """

    samples: int
    seed: int = 0
    shrink: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, (int, np.integer)) or self.samples < 1:
            raise ValueError(f"tail samples must be an integer >= 1; got {self.samples!r}. Pass tail=None for "
                             f"no tail estimate.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not \
                0 <= self.seed < 2**63:
            raise ValueError(f"tail seed must be an integer in [0, 2**63); got {self.seed!r}.")
        if isinstance(self.shrink, bool) or not isinstance(self.shrink, (int, float, np.integer, np.floating)) \
                or not 0.0 <= float(self.shrink) < np.inf:
            raise ValueError(f"tail shrink must be a finite number >= 0; got {self.shrink!r} (0 = unbiased).")


def as_tail(tail: object) -> Tail | None:
    """``None`` -> None; an int -> ``Tail(samples=int)``; a :class:`Tail` as is; anything else: TypeError."""
    if tail is None or isinstance(tail, Tail):
        return tail
    if isinstance(tail, (int, np.integer)) and not isinstance(tail, bool):
        return Tail(int(tail))
    raise TypeError(f"tail must be None, an int (samples per query) or sparseattn.Tail(samples, seed); got "
                    f"{type(tail).__name__}.")


def tail_patterns(patterns: list[SparsePattern], n_groups: int, tail: Tail, is_causal: bool,
                  query_positions: np.ndarray, key_positions: np.ndarray
                  ) -> tuple[list[SparsePattern], np.ndarray]:
    """The sampled tail keys of each group's pattern and the log weight of each row.

    patterns: one (L, S) pattern shared by every group, or one per group (G); query_positions (L,),
    key_positions (S,) int64 (causal: row i sees keys with position <= its own).  Returns a list with one
    sampled pattern per group and ``log_w`` (G, L) float64 (``log(u/m')``, 0 for rows that draw nothing).
    """
    L, S = patterns[0].shape
    if is_causal:
        order = np.argsort(key_positions, kind="stable").astype(np.int64)
        visible = np.searchsorted(key_positions[order], query_positions, side="right").astype(np.int64)
    else:
        order = np.arange(S, dtype=np.int64)
        visible = np.full(L, S, dtype=np.int64)
    rank = np.empty(S, dtype=np.int64)
    rank[order] = np.arange(S, dtype=np.int64)
    out: list[SparsePattern] = []
    log_w = np.zeros((n_groups, L), dtype=np.float64)
    for g in range(n_groups):
        p = patterns[0] if len(patterns) == 1 else patterns[g]
        tptr, tidx, lw = sample_tail(p.indptr, p.indices, visible, order, rank, int(tail.samples),
                                     int(tail.seed), g)
        out.append(SparsePattern(tptr, tidx, S, validate=False))
        log_w[g] = lw
    return out, log_w


def shrink_log_weights(q3: np.ndarray, k3: np.ndarray, q_map: np.ndarray, kv_map: np.ndarray, scale: float,
                       sampled: list[SparsePattern], shrink: float) -> np.ndarray:
    """``log(ESS / (ESS + shrink))`` per (group, row) of the sampled keys' weights ``exp(scale * q·k)``.

    q3 (Gq, L, E), k3 (Gk, S, E) float arrays with group maps q_map, kv_map (G,); ``sampled``: one pattern
    per group.  Returns (G, L) float64; 0 for rows that drew nothing.
    """
    G = len(sampled)
    L = sampled[0].shape[0] if G else 0
    out = np.zeros((G, L), dtype=np.float64)
    for g in range(G):
        p = sampled[g]
        counts = p.nnz_per_row
        if p.nnz == 0:
            continue
        rows = np.repeat(np.arange(L), counts)
        qg = q3[q_map[g]].astype(np.float64, copy=False)
        kg = k3[kv_map[g]].astype(np.float64, copy=False)
        sc = np.einsum("ne,ne->n", qg[rows], kg[p.indices]) * scale
        starts = p.indptr[:-1][counts > 0]
        mx = np.maximum.reduceat(sc, starts)
        a = np.exp(sc - np.repeat(mx, counts[counts > 0]))
        s1 = np.add.reduceat(a, starts)
        s2 = np.add.reduceat(a * a, starts)
        ess = s1 * s1 / s2
        out[g, counts > 0] = np.log(ess / (ess + shrink))
    return out
