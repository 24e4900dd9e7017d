"""Input handling shared by every public entry point: arrays, positions, dtypes, scale, broadcasting.

Every user-facing function validates once, at the boundary, so the Numba kernels only ever see
C-contiguous float arrays with consistent shapes.  Errors name the argument, say what was expected and
what was received, and give a hint.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace

import numpy as np

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def as_float_array(x: object, name: str, *, min_ndim: int = 2, check_finite: bool = True) -> np.ndarray:
    """Return ``x`` as a float16/32/64 ndarray, validating dtype, rank and finiteness.

    Integer, boolean, complex and object inputs are rejected (a silent cast hides bugs such as passing
    token ids instead of embeddings).
    """
    arr = np.asarray(x)
    if arr.dtype.kind == "c":
        raise TypeError(f"{name} must be a real floating array; got complex dtype {arr.dtype}. "
                        f"Pass {name}.real or a float array.")
    if arr.dtype.kind != "f" or arr.dtype.type not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float16, float32 or float64; got {arr.dtype}. "
                        f"Convert with {name}.astype(np.float32).")
    if arr.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions (..., length, features); "
                         f"got shape {arr.shape}.")
    if check_finite and arr.size and not np.isfinite(arr).all():
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ValueError(f"{name} contains NaN or Inf (first at index {tuple(int(i) for i in bad)}). "
                         f"Clean the input (a function that takes check_finite skips this check with "
                         f"check_finite=False).")
    return arr


def result_dtype(*arrays: np.ndarray) -> np.dtype:
    """Computation dtype: float64 if any input is float64, else float32 (float16 is upcast)."""
    if any(a.dtype == np.float64 for a in arrays):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def check_positive_int(value: object, name: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Validate an integer parameter (bools rejected) in ``[minimum, maximum]`` and return it as ``int``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}; got {value!r} ({type(value).__name__}).")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {int(value)}.")
    if maximum is not None and int(value) > maximum:
        raise ValueError(f"{name} must be <= {maximum:,}; got {int(value):,}.")
    return int(value)


def check_scale(scale: object, head_dim: int) -> float:
    """Resolve the score scale: ``None`` means ``1/sqrt(head_dim)``; otherwise a finite real number."""
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim)) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None; got {scale!r} ({type(scale).__name__}).")
    s = float(scale)
    if not np.isfinite(s):
        raise ValueError(f"scale must be finite; got {scale!r}.")
    return s


def check_bool(value: object, name: str) -> bool:
    """Validate a flag (Python or numpy bool; ints are rejected) and return it as ``bool``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}.")
    return bool(value)


def overflow_message(dtype: np.dtype, scale: float, fix: str | None = None) -> str:
    """Error text for attention scores that overflow the computation dtype (finite inputs, an infinite or NaN
    score); ``fix`` says what the caller can change (default: float64 inputs or a smaller scale for float32,
    smaller inputs or scale for float64)."""
    if fix is None:
        fix = ("pass float64 inputs or a smaller scale" if np.dtype(dtype) != np.float64 else
               "scale the queries or keys down, or pass a smaller scale (float64 is the widest dtype)")
    return (f"attention scores overflow {np.dtype(dtype).name} (some q.k * scale is beyond its range with scale={scale:g}); "
            f"{fix}.")


def check_lse(lse: np.ndarray, dtype: np.dtype, scale: float, *, nan_is_overflow: bool = True) -> None:
    """Apply the library's empty-row and overflow policy to a computed log-sum-exp.

    Policy, shared by the dense reference, the sparse kernel and selectors that attend by themselves:

    * a row with no key (or only ``-inf`` scores) is legal: zeros and ``lse = -inf``, never an error;
    * a row whose scores overflowed the computation dtype (finite inputs, some ``q . k * scale`` is
      ``+inf``) is reported by the kernels as ``lse = +inf``, or ``NaN`` when the overflow produced
      ``inf - inf`` inside a dot product; this function turns either into
      ``ValueError(overflow_message(dtype, scale))``.

    Parameters
    ----------
    lse : float array, any shape
        Log-sum-exp per row, as returned by a kernel.
    dtype : numpy dtype
        The computation dtype (named in the error).
    scale : float
        The score scale in force (named in the error).
    nan_is_overflow : bool
        Treat NaN as overflow (default).  Pass False when the inputs were not checked for finiteness
        (``check_finite=False``): a NaN there may come from a NaN input, which is not an overflow.

    Raises
    ------
    ValueError
        If ``lse`` holds ``+inf`` (or NaN when ``nan_is_overflow``).
    """
    arr = np.asarray(lse)
    if not arr.size:
        return
    if np.isposinf(arr).any() or (nan_is_overflow and np.isnan(arr).any()):
        raise ValueError(overflow_message(dtype, scale))


def value_scaling(v: np.ndarray, n_terms: int, dtype: np.dtype) -> np.ndarray | None:
    """Per-column power-of-two factors that keep weighted sums of values finite in ``dtype``, or None.

    Attention sums up to ``n_terms`` values with weights of at most 1 before it divides by the weights'
    total (and merges partial results the same way), so a column whose largest magnitude ``a`` passes
    ``finfo(dtype).max / (2 (n_terms + 1))`` can overflow to ``inf`` in that sum although the exact
    output, a convex combination of the values, is finite.  Such a column is computed on ``v * 2**-e``
    (exact: only the exponent changes, except for values that become subnormal, below 2**-126 * 2**e in
    float32, whose share of the output is below 1e-38 of the column's largest value), with the smallest
    e that brings ``a`` under the limit, and the output multiplied back (:func:`unscale_output`).

    Parameters
    ----------
    v : float array (..., S, Ev)
    n_terms : int
        The most values one output row sums (S).
    dtype : numpy dtype
        The computation dtype.

    Returns
    -------
    (Ev,) float64 array of the factors ``2**-e`` (1 for columns that need none), or None when no column
    needs one or some value is not finite.  Costs a max / min pass over v: the entry points call it only
    after a computation left a non-finite output.
    """
    if not v.size:
        return None
    limit = float(np.finfo(dtype).max) / (2.0 * (n_terms + 1))
    flat = v.reshape(-1, v.shape[-1])
    big = np.maximum(np.abs(flat.max(axis=0).astype(np.float64)), np.abs(flat.min(axis=0).astype(np.float64)))
    if not np.any(big > limit) or not np.isfinite(big).all():  # inf / NaN values (unchecked): no help
        return None
    e = np.where(big > limit, np.ceil(np.log2(np.maximum(big, limit) / limit)), 0.0)
    return np.ldexp(1.0, -e.astype(np.int64))


def unscale_output(out: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """An output computed on values scaled by ``factors`` (:func:`value_scaling`) in the values' units.

    ``out / factors`` per column, in out's dtype.  Rounding may leave a scaled output a few ulps above
    the column's largest scaled value; a finite entry is clamped to ``finfo.max * factor`` before the
    multiplication so that it cannot round up to ``inf`` (the exact output is at most ``finfo.max``).
    """
    top = (np.finfo(out.dtype).max * factors).astype(out.dtype)
    res = np.where(np.isinf(out), out, np.clip(out, -top, top))  # an inf (unchecked inf input) stays inf
    return (res / factors.astype(out.dtype)).astype(out.dtype, copy=False)


def mask_2d(m: np.ndarray) -> np.ndarray:
    """A mask of shape (S,) or () as (1, S) / (1, 1): it broadcasts to (L, S) as in torch; others unchanged."""
    return m.reshape((1,) * (2 - m.ndim) + m.shape) if m.ndim < 2 else m


def positions(arr: object, length: int, name: str) -> np.ndarray:
    """Validate a 1-D integer position vector of the given length (None -> ``arange(length)``); int64."""
    if arr is None:
        return np.arange(length, dtype=np.int64)
    pos = np.asarray(arr)
    if pos.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array; got dtype {pos.dtype}.")
    if pos.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},); got {pos.shape}.")
    if pos.dtype == np.uint64 and pos.size and int(pos.max()) > np.iinfo(np.int64).max:
        # casting would wrap them negative: a late position would silently become the earliest
        raise ValueError(f"{name} must fit in int64 (at most {np.iinfo(np.int64).max}); got {int(pos.max())}.")
    return np.ascontiguousarray(pos, dtype=np.int64)


def check_additive(arr: np.ndarray, name: str, holder: str, masked: str, cdt: np.dtype | None = None) -> None:
    """The rules for a float array added to the scores (a mask or bias ``name``, any shape): no NaN, no +inf
    (``holder`` and ``masked`` word the fix, e.g. "an additive mask" / "-inf for masked-out positions"),
    and with ``cdt`` no positive value beyond that dtype (:func:`check_additive_range`).  ValueError."""
    if arr.dtype.kind != "f":
        return
    if np.isnan(arr).any():
        raise ValueError(f"{name} contains NaN; use {masked}.")
    if np.isposinf(arr).any():
        first = tuple(int(i) for i in np.argwhere(np.isposinf(arr))[0])
        raise ValueError(f"{name} contains +inf (first at index {first}), which no softmax can weigh; {holder} "
                         f"holds finite values, or {masked}.")
    if cdt is not None:
        check_additive_range(arr, cdt, name)


def check_additive_range(arr: np.ndarray, cdt: np.dtype, name: str) -> None:
    """ValueError when a float array added to the scores (a mask or bias, any shape) holds a finite positive
    value beyond the range of the computation dtype ``cdt``: cast to it, the value would become +inf and be
    reported as an overflow of the scores.  A negative one becomes -inf there: a masked-out pair, as meant."""
    if arr.dtype.kind != "f" or np.dtype(cdt).itemsize >= arr.dtype.itemsize:
        return
    top = np.finfo(cdt).max
    beyond = np.isfinite(arr) & (arr > top)
    if beyond.any():
        first = tuple(int(i) for i in np.argwhere(beyond)[0])
        raise ValueError(f"{name} holds {float(arr[first]):g} (first at index {first}), beyond the range of "
                         f"{np.dtype(cdt).name} (largest {float(top):.4g}), the dtype the inputs compute in; "
                         f"pass float64 inputs, or a smaller additive value.")


def check_position_span(query_positions: np.ndarray, key_positions: np.ndarray) -> None:
    """ValueError when some ``key - query`` position difference leaves the int64 range: a relative-position
    bias (ALiBi's ``|key - query|``, T5's buckets) computes it in int64, where it would wrap to a
    difference of the other sign and a silently wrong bias.  Both int64, 1-D (either may be empty)."""
    if not query_positions.size or not key_positions.size:
        return
    qlo, qhi = int(query_positions.min()), int(query_positions.max())
    klo, khi = int(key_positions.min()), int(key_positions.max())
    span = max(khi - qlo, qhi - klo)  # Python ints: exact
    top = int(np.iinfo(np.int64).max)
    if span > top:
        raise ValueError(f"query_positions and key_positions are too far apart for a relative-position bias: "
                         f"a key and a query position differ by {span}, beyond int64's {top}; shift both by "
                         f"the same offset (only differences matter to the bias) so that they differ by less "
                         f"than 2**63.")


# ---------------------------------------------------------------------------- leading-dim broadcasting
# Attention inputs share leading (batch, head) dimensions that broadcast like numpy's.  Rather than
# materialising broadcast copies (K shared by 12 heads would be copied 12 times), we compute, for every
# flattened group g, which slice of each operand it reads.  Grouped-query attention (fewer K/V heads than
# query heads) is the same idea: query head h reads K/V head ``h // (Hq // Hkv)``.


def group_maps(q_lead: tuple[int, ...], kv_lead: tuple[int, ...], *, enable_gqa: bool = False,
               kv_name: str = "key") -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """Broadcast leading shapes; return (lead, q_map, kv_map) with flat source indices per group.

    ``q_map[g]`` indexes ``query.reshape(-1, L, E)`` and ``kv_map[g]`` indexes ``key.reshape(-1, S, E)``
    for the g-th group of the broadcast leading shape ``lead`` (C order).
    """
    kv_eff = kv_lead
    rep = 1
    if enable_gqa:
        if len(q_lead) < 1 or len(kv_lead) < 1:
            raise ValueError("enable_gqa needs a heads dimension at position -3 in query and key/value.")
        hq, hk = q_lead[-1], kv_lead[-1]
        if hk == 0 or hq % hk != 0:
            raise ValueError(f"enable_gqa: query heads ({hq}) must be a multiple of {kv_name} heads ({hk}).")
        rep = hq // hk
        kv_eff = kv_lead[:-1] + (hq,)
    try:
        lead = np.broadcast_shapes(q_lead, kv_eff)
    except ValueError:
        raise ValueError(f"leading dimensions of query {q_lead} and {kv_name} {kv_lead} do not broadcast"
                         + ("" if enable_gqa else "; for fewer K/V heads than query heads pass enable_gqa=True")
                         + ".") from None
    n = int(np.prod(lead, dtype=np.int64))
    q_ids = np.arange(int(np.prod(q_lead, dtype=np.int64))).reshape(q_lead) if q_lead else np.zeros((), np.int64)
    q_map = np.broadcast_to(q_ids, lead).reshape(n).astype(np.int64)
    kv_ids = np.arange(int(np.prod(kv_lead, dtype=np.int64))).reshape(kv_lead) if kv_lead else np.zeros((), np.int64)
    if rep > 1:
        kv_ids = np.repeat(kv_ids, rep, axis=-1)
    kv_map = np.broadcast_to(kv_ids, lead).reshape(n).astype(np.int64)
    return tuple(lead), q_map, kv_map


def flat3(x: np.ndarray) -> np.ndarray:
    """View (or copy if unavoidable) of x as (prod(lead), n, f)."""
    # Explicit group count: reshape(-1, ...) is ambiguous when L or S is 0.
    return x.reshape((int(np.prod(x.shape[:-2], dtype=np.int64)),) + x.shape[-2:])


# ---------------------------------------------------------------------------------- attention inputs
@dataclass
class AttentionInputs:
    """Validated query/key/value as (G, n, f) arrays, the group maps and the scale in force.

    ``q3[q_map[g]]``, ``k3[kv_map[g]]`` and ``v3[kv_map[g]]`` are the operands of group g of the broadcast
    leading shape ``lead``; ``cdt`` is the computation dtype, ``out_dtype`` the promoted input dtype;
    ``v_factors`` (Ev,) the power-of-two factors v3 was multiplied by (:meth:`with_safe_values`), or None.
    """

    q3: np.ndarray
    k3: np.ndarray
    v3: np.ndarray
    lead: tuple[int, ...]
    q_map: np.ndarray
    kv_map: np.ndarray
    scale: float
    cdt: np.dtype
    out_dtype: np.dtype
    v_factors: np.ndarray | None = None
    G: int = field(init=False)
    L: int = field(init=False)
    S: int = field(init=False)
    E: int = field(init=False)
    Ev: int = field(init=False)

    def __post_init__(self) -> None:
        self.G = len(self.q_map)
        self.L, self.E = self.q3.shape[1:]
        self.S, self.Ev = self.v3.shape[1:]

    def in_computation_dtype(self) -> AttentionInputs:
        """The same inputs with q3, k3, v3 C-contiguous in ``cdt`` (what the Numba kernels read)."""
        return replace(self, q3=np.ascontiguousarray(self.q3, dtype=self.cdt),
                       k3=np.ascontiguousarray(self.k3, dtype=self.cdt),
                       v3=np.ascontiguousarray(self.v3, dtype=self.cdt))

    def with_safe_values(self) -> AttentionInputs:
        """The same inputs, with the value columns whose weighted sums could overflow the computation
        dtype scaled by powers of two (:func:`~sparseattn.inputs.value_scaling`; v3 then in ``cdt``):
        :meth:`finish` multiplies the output back.  Unchanged (no copy) when no column needs it."""
        if self.v_factors is not None:
            return self
        f = value_scaling(self.v3, self.S, self.cdt)
        if f is None:
            return self
        v3 = np.ascontiguousarray(self.v3 * f.astype(self.cdt), dtype=self.cdt)
        return replace(self, v3=v3, v_factors=f)

    def finish(self, out: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(G, L, Ev) / (G, L) results -> (..., L, Ev) in the output dtype / (..., L) (the output multiplied
        back when the values were scaled)."""
        if self.v_factors is not None:
            out = unscale_output(out, self.v_factors)
        output = out.reshape(self.lead + (self.L, self.Ev)).astype(self.out_dtype, copy=False)
        return output, lse.reshape(self.lead + (self.L,))


def attention_inputs(query: object, key: object, value: object, scale: object, is_causal: object, *,
                     enable_gqa: bool, check_finite: bool) -> AttentionInputs:
    """Validate query (..., L, E), key (..., S, E), value (..., S, Ev), scale and is_causal once.

    The shared boundary of the dense and sparse attention entry points: float arrays (:func:`as_float_array`),
    agreeing shapes, a bool ``is_causal``, the resolved scale (:func:`check_scale`, and finite in the
    computation dtype), broadcast leading dims (:func:`group_maps`).  The arrays keep their input dtype;
    :meth:`AttentionInputs.in_computation_dtype` converts them.
    """
    q = as_float_array(query, "query", check_finite=check_finite)
    k = as_float_array(key, "key", check_finite=check_finite)
    v = as_float_array(value, "value", check_finite=check_finite)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key must have the same feature size E; got query {q.shape} and "
                         f"key {k.shape}.")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key and value must have the same length S; got key {k.shape} and value {v.shape}.")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"key and value must have the same leading dims; got {k.shape[:-2]} and {v.shape[:-2]}.")
    check_bool(is_causal, "is_causal")
    sc = check_scale(scale, q.shape[-1])
    lead, q_map, kv_map = group_maps(q.shape[:-2], k.shape[:-2], enable_gqa=enable_gqa)
    cdt = result_dtype(q, k, v)
    if not np.isfinite(cdt.type(sc)):
        raise ValueError(f"scale={sc:g} overflows the computation dtype {cdt.name}; pass float64 inputs.")
    return AttentionInputs(flat3(q), flat3(k), flat3(v), lead, q_map, kv_map, sc, cdt,
                           np.result_type(q.dtype, k.dtype, v.dtype))
