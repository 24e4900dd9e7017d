"""Quest-style page selector: per page of consecutive keys, an upper bound of q.k from the element-wise
min and max of its keys; each query takes the pages of largest bound.

For a page with element-wise minimum ``m`` and maximum ``M`` of its keys, every key k of the page has
``q . k <= sum_e max(q_e * m_e, q_e * M_e)`` (each term bounds ``q_e * k_e`` since ``m_e <= k_e <= M_e``).
Quest (Tang et al., 2024) ranks pages by this bound and attends to the keys of the best ones.  The bound
needs ``2 E`` numbers per page and is updated in place when keys are appended (:meth:`PagesSelector.add`).
"""

from __future__ import annotations

import numpy as np

from ..inputs import as_float_array
from ..kernels.pages import page_bounds
from ..pattern import SparsePattern
from .base import Param, Selector, positive, register

__all__ = ["PagesSelector", "page_min_max"]

_PAIR_BLOCK = 4096  # causal (query, straddling page) pairs bounded at once (memory: pairs * page_size * E)


def page_min_max(keys: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Element-wise min and max of each page of ``page_size`` consecutive keys.

    Parameters
    ----------
    keys : (S, E) float array
    page_size : int >= 1

    Returns
    -------
    pmin, pmax : (ceil(S / page_size), E), the keys' dtype; the last page may hold fewer keys.
    """
    S, E = keys.shape
    n_full = S // page_size
    n_pages = -(-S // page_size)
    pmin = np.empty((n_pages, E), keys.dtype)
    pmax = np.empty((n_pages, E), keys.dtype)
    if n_full:
        blk = keys[:n_full * page_size].reshape(n_full, page_size, E)
        pmin[:n_full] = blk.min(axis=1)
        pmax[:n_full] = blk.max(axis=1)
    if n_pages > n_full:
        rest = keys[n_full * page_size:]
        pmin[n_full] = rest.min(axis=0)
        pmax[n_full] = rest.max(axis=0)
    return pmin, pmax


@register
class PagesSelector(Selector):
    """Quest page selection: the ``pages`` pages of largest upper bound ``sum_e max(q_e m_e, q_e M_e)``.

    Keys are grouped by id into pages of ``page_size`` (``[0, page_size)``, ``[page_size, 2 page_size)``,
    ...).  Each query keeps ``pages`` pages (default ``ceil(k / page_size)``, so about k keys) in
    decreasing bound order, ties to the lower page id, and selects every key of them.  Causal queries rank
    only pages holding at least one allowed key, and a page straddling the query's position is bounded
    over its allowed keys only (the final causal filter drops the rest of it), so a row depends only on
    the keys at positions <= its own.  Cost per query: ``2 E`` multiply-max per page, then the selected keys; memory ``2 E`` numbers
    per page.  ``add`` updates the last page and appends new ones without touching the others.
    """

    name = "pages"
    guarantee = ("approximate: ranks pages by a true upper bound of q.k over the page (exact for the page's "
                 "maximum only when its keys share the extreme coordinates); every key of a chosen page. Causal: "
                 "strictly causal (a straddling page is bounded over its allowed keys only)")
    supports_add = True
    params_spec = {
        "page_size": Param(int, 16, "keys per page", positive),
        "pages": Param(int, None, "pages per query (default ceil(k / page_size))", positive, when="query"),
        "block": Param(int, 256, "query rows bounded at once (memory: block * pages)", positive,
                       when="query"),
    }

    def _ensure_built(self, action: str) -> None:
        """RuntimeError unless built with the current parameters (the base class's check)."""
        self._require_built(action)

    def _build(self, keys: np.ndarray) -> None:
        self.pmin_, self.pmax_ = page_min_max(keys, self._params["page_size"])

    def add(self, new_keys: np.ndarray, *, check_finite: bool = True) -> PagesSelector:
        """Append keys (ids continue after the existing ones); only the last page's bounds and the new
        pages are computed.

        Parameters
        ----------
        new_keys : float array, shape (N, E)
            Converted to the dtype of the built keys.
        """
        self._ensure_built("add")
        nk = as_float_array(new_keys, "new_keys", min_ndim=2, check_finite=check_finite)
        if nk.ndim != 2 or nk.shape[1] != self.keys_.shape[1]:
            raise ValueError(f"new_keys must have shape (N, E={self.keys_.shape[1]}); got {nk.shape}.")
        if nk.shape[0] == 0:
            return self
        ps = self._params["page_size"]
        S = self.keys_.shape[0]
        self.keys_ = np.concatenate([self.keys_, np.ascontiguousarray(nk, dtype=self.keys_.dtype)])
        first = S // ps  # the first page that changes
        mn, mx = page_min_max(self.keys_[first * ps:], ps)
        self.pmin_ = np.concatenate([self.pmin_[:first], mn])
        self.pmax_ = np.concatenate([self.pmax_[:first], mx])
        return self

    def bounds(self, queries: np.ndarray) -> np.ndarray:
        """Upper bounds (L, n_pages) of ``q . k`` over each page, for (L, E) queries (keys' dtype)."""
        self._ensure_built("bounds")
        q = np.ascontiguousarray(as_float_array(queries, "queries", min_ndim=2), dtype=self.keys_.dtype)
        return page_bounds(q, self.pmin_, self.pmax_)

    def _partial_bounds(self, q: np.ndarray, qpos: np.ndarray, kpos: np.ndarray, page_first: np.ndarray,
                        page_last: np.ndarray, bnd: np.ndarray) -> None:
        """Causal: bound each page that is only partly allowed over its allowed keys alone, in place.

        A page holding keys on both sides of a query's position would otherwise be ranked with the
        min / max of keys the query may not see, making the choice of pages depend on later keys.
        q (b, E), qpos (b,) int64, bnd (b, n_pages) float64 (the full-page bounds, -inf for pages with
        no allowed key).  With keys sorted by position a row has at most one such page.
        """
        ps = self._params["page_size"]
        S = self.keys_.shape[0]
        partial = (page_first[None, :] <= qpos[:, None]) & (page_last[None, :] > qpos[:, None])
        rows, pages = np.nonzero(partial)
        info = np.finfo(self.keys_.dtype)
        for c in range(0, rows.size, _PAIR_BLOCK):  # (row, page) pairs, a bounded batch at a time
            r, pg = rows[c:c + _PAIR_BLOCK], pages[c:c + _PAIR_BLOCK]
            ids = pg[:, None] * ps + np.arange(ps)[None, :]  # (n, ps)
            inside = ids < S
            ids = np.minimum(ids, S - 1)
            ok = (inside & (kpos[ids] <= qpos[r, None]))[:, :, None]
            keys = self.keys_[ids]  # (n, ps, E)
            mn = np.where(ok, keys, info.max).min(axis=1)
            mx = np.where(ok, keys, info.min).max(axis=1)
            qr = q[r]
            bnd[r, pg] = np.maximum(qr * mn, qr * mx).sum(axis=1, dtype=np.float64)

    def _query(self, q, k, is_causal, qpos, kpos) -> SparsePattern:
        ps = self._params["page_size"]
        S = self.keys_.shape[0]
        n_pages = self.pmin_.shape[0]
        want = self._params["pages"] or -(-k // ps)
        P = min(want, n_pages)
        L = q.shape[0]
        if is_causal:  # smallest / largest key position of each page: allowed / entirely allowed
            pad = np.full(n_pages * ps, np.iinfo(np.int64).max, np.int64)
            pad[:S] = kpos
            page_first = pad.reshape(n_pages, ps).min(axis=1)
            pad[S:] = np.iinfo(np.int64).min
            page_last = pad.reshape(n_pages, ps).max(axis=1)
        chosen = np.empty((L, P), np.int64)
        valid = np.ones((L, P), bool)
        block = self._params["block"]
        for a in range(0, L, block):
            b = min(a + block, L)
            bnd = page_bounds(q[a:b], self.pmin_, self.pmax_).astype(np.float64)
            if is_causal:
                bnd[page_first[None, :] > qpos[a:b, None]] = -np.inf
                self._partial_bounds(q[a:b], qpos[a:b], kpos, page_first, page_last, bnd)
            order = np.argsort(-bnd, axis=1, kind="stable")[:, :P]  # stable: ties to the lower page id
            chosen[a:b] = order
            valid[a:b] = np.take_along_axis(bnd, order, axis=1) > -np.inf
        chosen = np.where(valid, chosen, n_pages)  # invalid -> past the end, dropped below
        chosen.sort(axis=1)
        ids = chosen[:, :, None] * ps + np.arange(ps)[None, None, :]
        ids = ids.reshape(L, P * ps)
        keep = ids < S
        counts = keep.sum(axis=1)
        indptr = np.zeros(L + 1, np.int64)
        np.cumsum(counts, out=indptr[1:])
        return SparsePattern(indptr, ids[keep].astype(np.int32), S, validate=False)
