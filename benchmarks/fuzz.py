"""Fuzz the attention entry points: dense reference, sparse kernel over explicit patterns, and selectors.

Run:  python benchmarks/fuzz.py [--cases 100000] [--seed 0] [--max-n 32]
Reproduce one case (prints its kind and the full traceback; add the run's --max-n if not the default):
      python benchmarks/fuzz.py --seed S --case I
FAISS's k-means prints "WARNING clustering ..." lines to stderr for tiny IVF indexes: harmless, documented
by the selector; the report goes to stdout.

Not part of CI's default run (``tests/test_fuzz.py`` runs the same loop for a few thousand cases).

Every case draws its own generator ``np.random.default_rng([seed, case])``, so a failure is reproduced by
its (seed, case) pair alone.  Case kinds:

* ``full``     dense attention (bool / float / no mask, causal, GQA, broadcast leading dims, small dense
               tiles) against the sparse kernel over the full pattern of allowed keys;
* ``pattern``  a random sparse pattern (empty rows, duplicates in the constructor input) as a dense boolean
               mask against the sparse kernel over the pattern;
* ``bias``     a float additive mask (with ``-inf`` entries, fully masked rows) as the dense ``attn_mask``
               and as the sparse ``bias``;
* ``selector`` ``sparse_attention`` with a selector spec; the patterns it used are checked (canonical CSR,
               no future key when causal) and the output against the oracle over those patterns;
* ``invalid``  deliberately invalid input; must raise the documented ValueError / TypeError with the
               documented message (anything else, or no error, is a failure).

Logits reach +-1e4 (large-norm q/k, or a large or negative ``scale``).  Outputs are compared with an
independent float64 numpy oracle written here, with a tolerance derived from the rounding of each row's
logits (``|scale| * max_j sum_e |q_e k_je|``) in the computation dtype.  Checked for every valid case:
no NaN/Inf output, zeros and ``lse = -inf`` where a row has no allowed key, dense and sparse both within
tolerance of the oracle (hence of each other), output dtype and shape.  Failures that match a known,
reported bug (``KNOWN_BUGS``, kept as strict xfail tests) are counted separately from new failures.
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import sparseattn as sa
from sparseattn import SparsePattern
from sparseattn.attention.sparse import sparse_attention_result
from sparseattn.selectors import get_selector
from sparseattn.tools.args import OneLineParser, float_arg, nonnegative_int, positive_int

KINDS = ("full", "pattern", "bias", "selector", "invalid")
KIND_WEIGHTS = (0.45, 0.2, 0.1, 0.13, 0.12)
DTYPES = (np.float16, np.float32, np.float64)
DEFAULT_MAX_N = 32
# Unit roundoff of the computation dtype (float16 inputs compute in float32) and of the output dtype.
UNIT = {np.dtype(np.float16): 2.0 ** -11, np.dtype(np.float32): 2.0 ** -24, np.dtype(np.float64): 2.0 ** -53}

# Small-size variants of every registered selector (LSH with a tiny candidate cap so datasketch's
# MinHashLSH is really used at these sizes; IVF-PQ with one sub-quantizer so it divides every E).
SELECTOR_SPECS = (
    "window", "window:width=3,dilation=2", "sinks:g=2", "sinks:positions=0;3", "random:n_random=3,seed=7",
    "topk", "topk:block=3", "faiss-flat", "faiss-hnsw:M=4,ef_search=8", "faiss-ivf:nprobe=2",
    "faiss-ivfpq:m=1,nbits=2,nprobe=2", "kdtree", "kdtree:eps=0.5,leafsize=2",
    "lsh:n_candidates=4,n_tables=4", "lsh:family=simhash,n_bits=3,n_candidates=4,n_tables=4",
    "angular-lsh:n_rounds=2,chunk_size=2", "angular-lsh:chunk_size=0,rerank=false",
    "cluster:n_probe=1", "cluster:mode=block", "window:width=4+sinks:g=1+topk",
)
# Documented "this selector cannot run on such input" errors: counted as unsupported, not as failures.
UNSUPPORTED_MARK = "cannot run here"


class CaseFailure(Exception):
    """A check failed (wrong value, NaN, wrong error): the fuzz's finding, as opposed to a crash."""


# Failures matching a known, reported bug (kept as strict xfail tests) are counted apart from new ones:
# id -> (description, predicate on (kind, status, message)).
# bug id -> (description, predicate(kind, status, message)); empty: every reported bug is fixed
KNOWN_BUGS: dict[str, tuple[str, Callable[[str, str, str], bool]]] = {}


def known_bug(kind: str, status: str, msg: str) -> str | None:
    for bug_id, (_, pred) in KNOWN_BUGS.items():
        if pred(kind, status, msg):
            return bug_id
    return None


@dataclass
class Summary:
    cases: int = 0
    seconds: float = 0.0
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    status: collections.Counter = field(default_factory=collections.Counter)  # (kind, status) -> count
    failures: list[tuple[int, int, str, str, str]] = field(default_factory=list)  # seed, case, kind, status, msg
    known: list[tuple[int, int, str, str, str]] = field(default_factory=list)  # failures of known bugs
    max_n: int = 0

    @property
    def n_failures(self) -> int:
        return len(self.failures)


# ----------------------------------------------------------------------------------------- the oracle
def oracle(q, k, v, allowed, add, scale):
    """float64 softmax attention per group: q (G,L,E), k (G,S,E), v (G,S,Ev), allowed (G,L,S) bool,
    add (G,L,S) float or None.  Returns (out (G,L,Ev), lse (G,L)); rows with no allowed key: 0, -inf."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    s = scale * np.einsum("gle,gse->gls", q, k)
    if add is not None:
        s = s + np.asarray(add, dtype=np.float64)
    s = np.where(allowed, s, -np.inf)
    G, L, S = s.shape
    out = np.zeros((G, L, v.shape[-1]))
    lse = np.full((G, L), -np.inf)
    if S == 0 or L == 0:
        return out, lse
    m = s.max(axis=-1)
    ok = np.isfinite(m)
    w = np.exp(s - np.where(ok, m, 0.0)[..., None])
    w[~allowed] = 0.0
    tot = w.sum(axis=-1)
    out = np.einsum("gls,gse->gle", w, v) / np.where(ok, tot, 1.0)[..., None]
    out[~ok] = 0.0
    lse = np.where(ok, m + np.log(np.where(ok, tot, 1.0)), -np.inf)
    return out, lse


def tolerances(q, k, v, allowed, add, scale, cdt, out_dt):
    """Per-row (G, L) absolute tolerances for the output (max over features) and for lse."""
    q, k, v = (np.abs(np.asarray(a, dtype=np.float64)) for a in (q, k, v))
    G, L, S = allowed.shape
    E = q.shape[-1]
    u, u_out = UNIT[np.dtype(cdt)], UNIT[np.dtype(out_dt)]
    bound = abs(scale) * np.einsum("gle,gse->gls", q, k)  # bound on |scale * q.k| and on its rounding
    if add is not None:
        bound = bound + np.where(allowed, np.abs(np.where(np.isfinite(add), add, 0.0)), 0.0)
    bound = np.where(allowed, bound, 0.0).max(axis=-1, initial=0.0)
    delta = 4.0 * u * (E + 4) * bound  # abs. error of one logit in the computation dtype
    n = allowed.sum(axis=-1)
    vmax = np.where(allowed[..., None], v[:, None, :, :], 0.0).max(axis=(-1, -2), initial=0.0) if S else \
        np.zeros((G, L))
    spread = np.expm1(np.minimum(2.0 * delta, 50.0))  # weights move by exp(+-delta) each
    tol_out = vmax * (2.0 * spread + 8.0 * u * (n + E + 8) + 2.0 * u_out) + 1e-300
    tol_lse = delta + 8.0 * u * (n + 8) * (1.0 + bound)
    return tol_out, tol_lse


# ------------------------------------------------------------------------------------------ drawing
def _size(rng, max_n, *, allow_zero=True):
    r = rng.random()
    if allow_zero and r < 0.03:
        return 0
    if r < 0.12:
        return 1
    return int(rng.integers(1, max_n + 1))


def _lead_shapes(rng):
    """(q_lead, kv_lead, enable_gqa)."""
    r = rng.random()
    if r < 0.45:
        return (), (), False
    q_lead = [(1,), (2,), (3,), (2, 2), (1, 3), (2, 1)][rng.integers(6)]
    r = rng.random()
    if r < 0.15 and q_lead[-1] in (2, 3):  # grouped-query attention: one K/V head
        return q_lead, q_lead[:-1] + (1,), True
    if r < 0.3:  # broadcasting: K/V shared across the leading batch dim, or across heads
        return q_lead, q_lead[1:] if len(q_lead) > 1 else (1,), False
    return q_lead, q_lead, False


def _groups(x, lead, n_lead_kv, gqa):
    """x (..., n, f) broadcast to (G, n, f) for the broadcast leading shape ``lead`` (GQA repeat)."""
    xl = x.shape[:-2]
    if gqa and xl and xl[-1] != lead[-1]:
        x = np.repeat(x, lead[-1] // xl[-1], axis=-3)
    full = np.broadcast_to(x, tuple(lead) + x.shape[-2:])
    return full.reshape((int(np.prod(lead, dtype=np.int64)),) + x.shape[-2:])


def draw_inputs(rng, max_n, *, allow_zero=True):
    """A valid (q, k, v) triple with its metadata."""
    q_lead, kv_lead, gqa = _lead_shapes(rng)
    L, S = _size(rng, max_n, allow_zero=allow_zero), _size(rng, max_n, allow_zero=allow_zero)
    E, Ev = int(rng.integers(1, 17)), int(rng.integers(1, 17))
    if rng.random() < 0.75:
        dts = [DTYPES[rng.integers(3)]] * 3
    else:
        dts = [DTYPES[i] for i in rng.integers(3, size=3)]
    q = rng.standard_normal(q_lead + (L, E))
    k = rng.standard_normal(kv_lead + (S, E))
    if rng.random() < 0.1 and S > 1:  # exact ties: duplicated keys, a zero query
        k[..., 1::2, :] = k[..., :1, :]
        if L:
            q[..., 0, :] = 0.0
    v = rng.standard_normal(kv_lead + (S, Ev)) * 10.0 ** rng.uniform(-2, 3)
    target = 10.0 ** rng.uniform(-1, 4)  # largest |logit|, up to 1e4
    raw = float(np.abs(q.reshape(-1, L, E)[0] @ k.reshape(-1, S, E)[0].T).max()) if L and S else 0.0
    scale = None
    if raw > 0:
        if rng.random() < 0.5:  # large-norm q and k, default scale
            f = math.sqrt(target / (raw / math.sqrt(E)))
            f = min(f, 3e4 / max(np.abs(q).max(), np.abs(k).max()))  # stay finite in float16
            q, k = q * f, k * f
        else:  # a large (sometimes negative) explicit scale
            scale = target / raw * (-1.0 if rng.random() < 0.1 else 1.0)
    elif rng.random() < 0.3:
        scale = float(rng.uniform(-3, 3))
    q, k, v = q.astype(dts[0]), k.astype(dts[1]), v.astype(dts[2])
    if rng.random() < 0.15:  # strided, Fortran-ordered or read-only inputs must work like contiguous ones
        q, k, v = (_odd_layout(rng, a) for a in (q, k, v))
    lead = tuple(np.broadcast_shapes(q_lead, kv_lead[:-1] + q_lead[-1:] if gqa else kv_lead))
    return dict(q=q, k=k, v=v, scale=scale, lead=lead, gqa=gqa, L=L, S=S, E=E, Ev=Ev,
                is_causal=bool(rng.random() < 0.4))


def _odd_layout(rng, a):
    r = rng.integers(3)
    if r == 0:  # a strided view (every other column of a wider array)
        b = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), dtype=a.dtype)[..., ::2]
        b[...] = a
    elif r == 1:
        b = np.asfortranarray(a)
    else:
        b = a.copy()
    if rng.random() < 0.5:
        b.flags.writeable = False
    return b


def _random_bool(rng, shape, *, empty_rows=True):
    m = rng.random(shape) < rng.uniform(0.0, 1.0)
    if empty_rows and shape[-2] and rng.random() < 0.4:
        m[..., rng.integers(shape[-2]), :] = False
    if rng.random() < 0.1:
        m[...] = False
    return m


def causal_mask(L, S):
    return np.arange(S)[None, :] <= np.arange(L)[:, None]


# ----------------------------------------------------------------------------------------- checking
def check_close(name, got, lse_got, ref, lse_ref, tol_out, tol_lse, allowed):
    G, L, Ev = ref.shape
    got = np.asarray(got, dtype=np.float64).reshape(G, L, Ev)
    lse_got = np.asarray(lse_got, dtype=np.float64).reshape(G, L)
    if not np.isfinite(got).all():
        raise CaseFailure(f"{name}: {int((~np.isfinite(got)).sum())} NaN/Inf output values")
    none = ~allowed.any(axis=-1) if allowed.shape[-1] else np.ones((G, L), bool)
    if np.isnan(lse_got).any():
        raise CaseFailure(f"{name}: NaN in lse")
    if (got[none] != 0).any():
        raise CaseFailure(f"{name}: rows with no allowed key are not zero")
    if not np.all(np.isneginf(lse_got[none])):
        raise CaseFailure(f"{name}: lse of rows with no allowed key is not -inf: {lse_got[none][:4]}")
    if not np.isfinite(lse_got[~none]).all():
        raise CaseFailure(f"{name}: non-finite lse on rows with allowed keys")
    err = np.abs(got - ref).max(axis=-1, initial=0.0)
    bad = err > tol_out
    if bad.any():
        g, i = np.argwhere(bad)[0]
        raise CaseFailure(f"{name}: output error {err[g, i]:.3g} > tol {tol_out[g, i]:.3g} at group {g} row {i} "
                          f"({int(bad.sum())} rows)")
    lerr = np.abs(np.where(none, 0.0, lse_got - lse_ref))
    bad = lerr > tol_lse
    if bad.any():
        g, i = np.argwhere(bad)[0]
        raise CaseFailure(f"{name}: lse error {lerr[g, i]:.3g} > tol {tol_lse[g, i]:.3g} at group {g} row {i}")


def _check_meta(name, out, c):
    want_dt = np.result_type(c["q"].dtype, c["k"].dtype, c["v"].dtype)
    if out.dtype != want_dt:
        raise CaseFailure(f"{name}: output dtype {out.dtype}, expected {want_dt}")
    want_shape = c["lead"] + (c["L"], c["Ev"])
    if out.shape != want_shape:
        raise CaseFailure(f"{name}: output shape {out.shape}, expected {want_shape}")


def _compare(c, allowed, add, dense_res, sparse_res):
    """Check dense and sparse results against the float64 oracle (allowed/add are (G, L, S))."""
    lead, gqa = c["lead"], c["gqa"]
    nk = len(c["k"].shape) - 2
    qg = _groups(c["q"], lead, nk, False)
    kg, vg = _groups(c["k"], lead, nk, gqa), _groups(c["v"], lead, nk, gqa)
    sc = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(c["E"])
    cdt = np.float64 if np.float64 in (c["q"].dtype, c["k"].dtype, c["v"].dtype) else np.float32
    out_dt = np.result_type(c["q"].dtype, c["k"].dtype, c["v"].dtype)
    ref, lse_ref = oracle(qg, kg, vg, allowed, add, sc)
    tol_out, tol_lse = tolerances(qg, kg, vg, allowed, add, sc, cdt, out_dt)
    for name, res in (("dense", dense_res), ("sparse", sparse_res)):
        if res is None:
            continue
        out, lse = res
        _check_meta(name, out, c)
        check_close(name, out, lse, ref, lse_ref, tol_out, tol_lse, allowed)


def _dense(c, rng, **kw):
    blocks = {}
    if rng.random() < 0.5:  # small tiles: exercise the online softmax across query and key tiles
        blocks = dict(q_block=int(rng.integers(1, 9)), k_block=int(rng.integers(1, 9)))
    return sa.scaled_dot_product_attention(c["q"], c["k"], c["v"], scale=c["scale"], enable_gqa=c["gqa"],
                                           return_lse=True, **blocks, **kw)


def _sparse(c, pattern, **kw):
    return sa.sparse_attention(c["q"], c["k"], c["v"], pattern, scale=c["scale"], enable_gqa=c["gqa"],
                               return_lse=True, **kw)


# -------------------------------------------------------------------------------------------- kinds
def case_full(rng, max_n):
    c = draw_inputs(rng, max_n)
    L, S, lead = c["L"], c["S"], c["lead"]
    G = int(np.prod(lead, dtype=np.int64))
    r = rng.random()
    mask = None
    if r < 0.4:
        allowed2 = np.ones((L, S), bool)
    elif r < 0.8 or not lead:
        shape = [(L, S), (L, S), (1, S), (L, 1), (1, L, S)][rng.integers(5)]  # broadcast mask shapes
        mask = _random_bool(rng, shape, empty_rows=shape[-2] == L)
        allowed2 = np.broadcast_to(mask.reshape(mask.shape[-2:]), (L, S))
        if mask.ndim == 3 and not lead:  # (1, L, S) would widen the output's leading dims
            mask = mask[0]
    else:
        mask = _random_bool(rng, lead + (L, S))
        allowed2 = None
    causal = c["is_causal"]
    cm = causal_mask(L, S) if causal else np.ones((L, S), bool)
    if allowed2 is not None:
        allowed2 = allowed2 & cm
        allowed = np.broadcast_to(allowed2, (G, L, S))
        if mask is None:
            pattern = SparsePattern.full(L, S, is_causal=causal)
        else:
            pattern = SparsePattern.from_mask(allowed2)
    else:
        allowed = (mask & cm).reshape(G, L, S)
        pattern = [SparsePattern.from_mask(a) for a in allowed]
    d = _dense(c, rng, attn_mask=mask, is_causal=causal)
    s = _sparse(c, pattern)
    _compare(c, allowed, None, d, s)


def _random_pattern(rng, L, S):
    """A random canonical pattern (with empty rows), built through one of the public constructors."""
    m = _random_bool(rng, (L, S))
    how = rng.integers(3)
    if how == 0 or S == 0:
        p = SparsePattern.from_mask(m)
    elif how == 1:
        rows = [list(np.nonzero(r)[0]) * int(rng.integers(1, 3)) for r in m]  # duplicates get merged
        p = SparsePattern.from_rows([rng.permutation(r).tolist() for r in rows], S)
    else:
        n_max = int(m.sum(axis=1).max(initial=0))
        w = n_max + int(rng.integers(0, 3))
        ids = np.full((L, w), -1, dtype=np.int64)
        for i, r in enumerate(m):
            nz = rng.permutation(np.nonzero(r)[0])
            ids[i, :nz.size] = nz
        if w > n_max and rng.random() < 0.5:  # duplicate the first id into a padding slot
            ids[:, -1] = np.where(ids[:, 0] >= 0, ids[:, 0], -1)
        p = SparsePattern.from_padded(ids, S)
    if not np.array_equal(p.to_mask(), m):
        raise CaseFailure("pattern constructor changed the selected set")
    return p


def case_pattern(rng, max_n):
    c = draw_inputs(rng, max_n)
    L, S, lead = c["L"], c["S"], c["lead"]
    G = int(np.prod(lead, dtype=np.int64))
    causal = c["is_causal"]
    if G > 1 and rng.random() < 0.5:
        patterns = [_random_pattern(rng, L, S) for _ in range(G)]
    else:
        patterns = [_random_pattern(rng, L, S)]
    if causal:  # dense applies is_causal; the explicit pattern is filtered with .causal()
        patterns = [p.causal() for p in patterns]
    for p in patterns:
        p.validate()
    masks = np.stack([p.to_mask() for p in patterns]) if L else np.zeros((len(patterns), 0, S), bool)
    allowed = np.broadcast_to(masks, (G, L, S))
    dense_mask = masks.reshape(lead + (L, S)) if len(patterns) > 1 else masks[0]
    d = _dense(c, rng, attn_mask=dense_mask, is_causal=causal)
    s = _sparse(c, patterns if len(patterns) > 1 else patterns[0])
    _compare(c, allowed, None, d, s)


def case_bias(rng, max_n):
    c = draw_inputs(rng, max_n)
    L, S, lead = c["L"], c["S"], c["lead"]
    G = int(np.prod(lead, dtype=np.int64))
    shape = (L, S) if rng.random() < 0.6 or not lead else lead + (L, S)
    add = rng.standard_normal(shape) * 10.0 ** rng.uniform(-1, 3)
    add[~_random_bool(rng, shape)] = -np.inf
    add = add.astype(np.float64 if rng.random() < 0.5 else np.float32)
    d = _dense(c, rng, attn_mask=add)
    s = _sparse(c, SparsePattern.full(L, S), bias=add)
    add_g = np.broadcast_to(add, lead + (L, S)).reshape(G, L, S)
    _compare(c, np.isfinite(add_g), add_g, d, s)


def case_selector(rng, max_n):
    c = draw_inputs(rng, max_n)
    L, S, lead = c["L"], c["S"], c["lead"]
    G = int(np.prod(lead, dtype=np.int64))
    spec = SELECTOR_SPECS[rng.integers(len(SELECTOR_SPECS))]
    kq = int(rng.integers(1, max(S, 1) + 3))  # includes k > S
    causal = c["is_causal"]
    qpos = None
    if causal and S >= L and rng.random() < 0.3:  # decoding: L new queries after S - L cached keys
        qpos = np.arange(S - L, S)
    context = f"[{spec} L={L} S={S} E={c['E']} k={kq} causal={causal}{' decode' if qpos is not None else ''}] "
    try:
        res = sparse_attention_result(c["q"], c["k"], c["v"], spec, k=kq, is_causal=causal, scale=c["scale"],
                                      enable_gqa=c["gqa"], query_positions=qpos)
    except Exception as exc:
        exc.fuzz_context = context  # run_case puts it in front of the message
        raise
    patterns = res.patterns
    if not patterns:  # block-mode cluster attends by itself: its query() gives the routed keys
        nk = len(c["k"].shape) - 2
        qg = _groups(c["q"], lead, nk, False)
        kg = _groups(c["k"], lead, nk, c["gqa"])
        patterns = [get_selector(spec).build(kg[g]).query(qg[g], kq, is_causal=causal, query_positions=qpos)
                    for g in range(G)]
    if len(patterns) != G:
        raise CaseFailure(f"selector {spec}: {len(patterns)} patterns for {G} groups")
    for p in patterns:
        if p.shape != (L, S):
            raise CaseFailure(f"selector {spec}: pattern shape {p.shape} != {(L, S)}")
        p.validate()
    masks = np.stack([p.to_mask() for p in patterns]) if L else np.zeros((G, 0, S), bool)
    visible = causal_mask(L, S) if qpos is None else np.arange(S)[None, :] <= qpos[:, None]
    if causal and (masks & ~visible).any():
        raise CaseFailure(f"selector {spec}: a future key was selected (is_causal=True)")
    if spec.startswith(("topk", "faiss-flat", "kdtree")) and spec != "kdtree:eps=0.5,leafsize=2":
        allowed_n = (visible if causal else np.ones((L, S), bool)).sum(axis=1)
        if not np.array_equal(masks.sum(axis=-1), np.broadcast_to(np.minimum(kq, allowed_n), (G, L))):
            raise CaseFailure(f"selector {spec}: rows do not hold min(k, allowed) keys")
    _compare(c, masks, None, None, (res.output, res.lse))


_BAD_DTYPES = (np.int32, np.int64, np.bool_, np.complex64, np.uint8, object)


def case_invalid(rng, max_n):
    """Apply one invalid mutation to a valid case; require the documented error type and message."""
    c = draw_inputs(rng, max_n, allow_zero=False)  # the mutations below need at least one element
    q, k, v = c["q"], c["k"], c["v"]
    L, S = c["L"], c["S"]
    target = ("dense", "sparse", "selector")[rng.integers(3)]
    args = {"query": q, "key": k, "value": v}
    kw: dict = {}
    m = int(rng.integers(12))
    if m == 0:  # NaN / Inf in one operand
        name = ("query", "key", "value")[rng.integers(3)]
        a = args[name].copy()
        a.reshape(-1)[rng.integers(a.size)] = (np.nan, np.inf, -np.inf)[rng.integers(3)]
        args[name] = a
        expected = (ValueError, rf"{name} contains NaN or Inf")
        if target == "selector" and name != "value":
            return _expect_selector(c, rng, expected, nonfinite=name)
    elif m == 1:  # feature size mismatch
        args["key"] = np.concatenate([k, k[..., :1]], axis=-1)
        expected = (ValueError, r"same feature size E")
    elif m == 2:  # S mismatch between key and value
        args["value"] = np.concatenate([v, v[..., :1, :]], axis=-2)
        expected = (ValueError, r"key and value must")
    elif m == 3:  # non-float dtype
        name = ("query", "key", "value")[rng.integers(3)]
        dt = _BAD_DTYPES[rng.integers(len(_BAD_DTYPES))]
        args[name] = args[name].astype(dt)
        expected = (TypeError, rf"{name} must (have dtype float16, float32 or float64|be a real floating)")
    elif m == 4:  # rank 1
        name = ("query", "key", "value")[rng.integers(3)]
        args[name] = args[name].reshape(-1)
        expected = (ValueError, rf"{name} must have at least 2 dimensions")
    elif m == 5:  # non-finite / non-numeric scale
        kw["scale"] = (np.nan, np.inf, "1")[rng.integers(3)]
        expected = ((TypeError, r"scale must be a real number") if isinstance(kw["scale"], str)
                    else (ValueError, r"scale must be finite"))
    elif m == 6:  # leading dims that do not broadcast
        pad = (1,) * (q.ndim - k.ndim)  # align the leading dims so that 5 meets 3
        args["key"] = np.broadcast_to(k, (5,) + pad + k.shape)
        args["value"] = np.broadcast_to(v, (5,) + pad + v.shape)
        args["query"] = np.broadcast_to(q, (3,) + q.shape)
        expected = (ValueError, r"do not broadcast")
    elif m == 7 and target == "dense":  # bad mask
        if rng.random() < 0.5:
            kw["attn_mask"] = np.ones((L + 1, S + 1), dtype=bool)
            expected = (ValueError, r"attn_mask shape .* does not broadcast")
        else:
            kw["attn_mask"] = np.ones((L, S), dtype=(np.int8, np.int64, np.complex64)[rng.integers(3)])
            expected = (TypeError, r"attn_mask must be boolean")
    elif m == 7 and target == "sparse":  # pattern of the wrong shape / wrong count
        if rng.random() < 0.5:
            kw["pattern"] = SparsePattern.full(L + 1, S)
            expected = (ValueError, r"pattern shape .* does not match")
        else:
            G = int(np.prod(c["lead"], dtype=np.int64))
            kw["pattern"] = [SparsePattern.full(L, S)] * (G + 1)
            expected = (ValueError, r"pattern sequence has")
    elif m == 8 and target != "dense":  # bad k for a selector
        kw["pattern"] = "topk"
        kw["k"] = (0, -3, 2.5, True, "4")[rng.integers(5)]
        expected = ((ValueError, r"k must be >= 1") if isinstance(kw["k"], int) and not isinstance(kw["k"], bool)
                    else (TypeError, r"k must be an integer"))
    elif m == 9 and target != "dense":  # unknown selector / parameter
        if rng.random() < 0.5:
            kw["pattern"] = "no-such-selector"
            expected = (ValueError, r"unknown selector 'no-such-selector'; available: .*window")
        else:
            kw["pattern"] = "window:widht=3"
            expected = (ValueError, r"unknown parameter\(s\) \['widht'\] for selector 'window'; valid: "
                                    r"dilation, width")
    elif m == 10:  # invalid CSR (out of range, duplicate, unsorted)
        which = rng.integers(3)
        indices = [[S], [0, 0], [1, 0]][which] if S > 1 else [[S], [0, 0], [S]][which]
        msg = [r"outside \[0, n_keys\)", r"duplicate key id", r"not sorted ascending"][which]
        if S == 1 and which == 2:
            msg = r"outside \[0, n_keys\)"
        indptr = np.zeros(L + 1, dtype=np.int64)
        indptr[1:] = len(indices)
        return _expect((ValueError, r"invalid SparsePattern: .*" + msg),
                       lambda: SparsePattern(indptr, np.array(indices), S))
    elif m == 11 and target == "dense":
        kw["is_causal"] = (1, "yes", None)[rng.integers(3)]
        expected = (TypeError, r"is_causal must be a bool")
    else:  # a bad tile size for dense, or a bool scale
        if target == "dense":
            kw["q_block"] = (0, -1)[rng.integers(2)]
            expected = (ValueError, r"q_block must be >= 1")
        else:
            kw["scale"] = True
            expected = (TypeError, r"scale must be a real number")
    if target == "dense":
        kw.pop("pattern", None)
        kw.pop("k", None)
        return _expect(expected, lambda: sa.scaled_dot_product_attention(args["query"], args["key"],
                                                                          args["value"], **kw))
    pattern = kw.pop("pattern", "window:width=2" if target == "selector" else SparsePattern.full(L, S))
    return _expect(expected, lambda: sa.sparse_attention(args["query"], args["key"], args["value"], pattern,
                                                         **kw))


def _expect_selector(c, rng, expected, nonfinite):
    """NaN/Inf in a selector's build (keys) or query (queries) input."""
    spec = SELECTOR_SPECS[rng.integers(len(SELECTOR_SPECS))]
    q = c["q"].reshape(-1, c["L"], c["E"])[0].copy()
    k = c["k"].reshape(-1, c["S"], c["E"])[0].copy()
    sel = get_selector(spec)
    if nonfinite == "key":
        k.reshape(-1)[rng.integers(k.size)] = np.nan
        return _expect((ValueError, r"keys contains NaN or Inf"), lambda: sel.build(k))
    q.reshape(-1)[rng.integers(q.size)] = -np.inf
    try:
        sel.build(k)
    except ValueError as exc:
        if UNSUPPORTED_MARK in str(exc):
            return "unsupported"
        raise
    return _expect((ValueError, r"queries contains NaN or Inf"), lambda: sel.query(q, 3))


def _expect(expected, fn):
    import re

    etype, pattern = expected
    try:
        fn()
    except (ValueError, TypeError) as exc:
        if not isinstance(exc, etype):
            raise CaseFailure(f"expected {etype.__name__}({pattern!r}); got {type(exc).__name__}: {exc}") from exc
        if not re.search(pattern, str(exc)):
            raise CaseFailure(f"{etype.__name__} message {str(exc)!r} does not match {pattern!r}") from exc
        return "ok"
    raise CaseFailure(f"invalid input accepted: expected {etype.__name__} matching {pattern!r}")


CASES = {"full": case_full, "pattern": case_pattern, "bias": case_bias, "selector": case_selector,
         "invalid": case_invalid}


# ---------------------------------------------------------------------------------------- the loop
def run_case(seed: int, case: int, max_n: int) -> tuple[str, str, str]:
    """Run one case; returns (kind, status, message) with status ok / skipped / unsupported / fail / crash."""
    rng = np.random.default_rng([seed, case])
    kind = KINDS[rng.choice(len(KINDS), p=KIND_WEIGHTS)]
    try:
        status = CASES[kind](rng, max_n) or "ok"
        return kind, status, ""
    except CaseFailure as exc:
        return kind, "fail", str(exc)
    except Exception as exc:  # any other exception on valid input is a crash
        if kind == "selector" and isinstance(exc, ValueError) and UNSUPPORTED_MARK in str(exc):
            return kind, "unsupported", str(exc)
        return kind, "crash", f"{getattr(exc, 'fuzz_context', '')}{type(exc).__name__}: {exc}"


def run(n_cases: int, seed: int = 0, max_n: int = DEFAULT_MAX_N, *, progress: float = 0.0,
        start: int = 0) -> Summary:
    """Run cases ``start .. start + n_cases - 1`` serially (``sparseattn.threads(1)``)."""
    summary = Summary(max_n=max_n)
    t0 = time.perf_counter()
    last = t0
    with sa.threads(1), warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for case in range(start, start + n_cases):
            kind, status, msg = run_case(seed, case, max_n)
            summary.cases += 1
            summary.by_kind[kind] += 1
            summary.status[(kind, status)] += 1
            if status in ("fail", "crash"):
                bug = known_bug(kind, status, msg)
                if bug:
                    summary.status[(kind, status)] -= 1
                    summary.status[(kind, "known-bug")] += 1
                    summary.known.append((seed, case, kind, bug, msg))
                else:
                    summary.failures.append((seed, case, kind, status, msg))
            if progress and time.perf_counter() - last > progress:
                last = time.perf_counter()
                print(f"  ... {summary.cases} cases, {summary.n_failures} failures, "
                      f"{last - t0:.0f} s", file=sys.stderr, flush=True)
    summary.seconds = time.perf_counter() - t0
    return summary


def _group_key(kind: str, status: str, msg: str) -> str:
    """Failures that differ only in numbers or shapes are listed together."""
    first = msg.splitlines()[0] if msg else ""
    spec = re.match(r"^\[(\S+) L=[^\]]*\] ", first)
    rest = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "#", first[spec.end():] if spec else first)
    return f"[{kind}/{status}] " + (f"[{spec.group(1)}] " if spec else "") + rest[:200]


def _listing(entries, max_n, max_listed):
    groups: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)
    for seed, case, kind, status, msg in entries:
        groups[_group_key(kind, status, msg)].append((seed, case, msg))
    lines = []
    for i, (key, where) in enumerate(sorted(groups.items(), key=lambda t: -len(t[1]))):
        if i >= max_listed:
            lines.append(f"  ... {len(groups) - max_listed} more kinds of failure")
            break
        extra = f" --max-n {max_n}" if max_n != DEFAULT_MAX_N else ""
        cases = ", ".join(f"--seed {s} --case {c}{extra}" for s, c, _ in where[:3])
        lines.append(f"  {len(where):5d} x {key}\n          e.g. {where[0][2].splitlines()[0][:240]}"
                     f"\n          reproduce: python benchmarks/fuzz.py {cases}")
    return lines


def report(summary: Summary, *, max_listed: int = 30) -> str:
    lines = [f"cases: {summary.cases} in {summary.seconds:.1f} s "
             f"({1e3 * summary.seconds / max(summary.cases, 1):.2f} ms/case)"]
    for kind in KINDS:
        counts = {s: n for (k, s), n in sorted(summary.status.items()) if k == kind and n}
        lines.append(f"  {kind:9s} {summary.by_kind[kind]:7d}  " + "  ".join(f"{s}={n}" for s, n in counts.items()))
    n_crash = sum(1 for f in summary.failures if f[3] == "crash")
    lines.append(f"failures: {summary.n_failures} (crashes: {n_crash}, wrong results / wrong errors: "
                 f"{summary.n_failures - n_crash})")
    lines += _listing(summary.failures, summary.max_n, max_listed)
    lines.append(f"known bugs (reported, strict xfail in tests/; not counted above): {len(summary.known)}")
    for bug_id, (desc, _) in KNOWN_BUGS.items():
        hits = [k for k in summary.known if k[3] == bug_id]
        if hits:
            lines.append(f"  {len(hits):5d} x {bug_id}: {desc}")
            lines += _listing([(s, c, kd, "crash", m) for s, c, kd, _, m in hits], summary.max_n, 3)
    return "\n".join(lines)


def _show_case(seed: int, case: int, max_n: int) -> int:
    rng = np.random.default_rng([seed, case])
    kind = KINDS[rng.choice(len(KINDS), p=KIND_WEIGHTS)]
    print(f"case {case} (seed {seed}): kind={kind}")
    with sa.threads(1):
        try:
            status = CASES[kind](rng, max_n) or "ok"
            print("status:", status)
            return 0
        except Exception:
            traceback.print_exc()
            return 1


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=nonnegative_int, default=100_000, help="number of cases (default 100000)")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="base seed; case i uses default_rng([seed, i])")
    ap.add_argument("--max-n", type=positive_int, default=DEFAULT_MAX_N,
                    help=f"largest L and S (default {DEFAULT_MAX_N})")
    ap.add_argument("--start", type=nonnegative_int, default=0, help="first case index")
    ap.add_argument("--case", type=nonnegative_int, default=None, help="run only this case, with a traceback")
    ap.add_argument("--progress", type=float_arg(0.0), default=0.0, help="print progress every N seconds (stderr)")
    args = ap.parse_args(argv)
    if args.case is not None:
        return _show_case(args.seed, args.case, args.max_n)
    print(f"sparseattn {sa.__version__} fuzz: --cases {args.cases} --seed {args.seed} --max-n {args.max_n}")
    summary = run(args.cases, args.seed, args.max_n, progress=args.progress, start=args.start)
    print(report(summary))
    return 1 if summary.n_failures else 0


if __name__ == "__main__":
    sys.exit(main())
