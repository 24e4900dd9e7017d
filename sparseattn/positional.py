"""Positional encodings: absolute (sinusoidal, learned), rotary (RoPE) and relative biases (ALiBi, T5).

Attention by itself is permutation-invariant, so order has to be injected somewhere:

* **absolute** encodings give every position a vector that is added to (:func:`add_positional`) or
  concatenated with (:func:`concat_positional`) the token embeddings before the Q/K/V projections:
  :func:`sinusoidal_encoding` (Vaswani et al. 2017) or a trained table
  (:class:`LearnedPositionalEncoding`);
* **rotary** encodings (:func:`apply_rope`, :func:`rope`; Su et al., RoFormer) rotate queries and keys
  by an angle proportional to their position, so ``q_m . k_n`` depends only on ``m - n``;
* **relative** encodings add a bias ``b(i, j)`` that depends on the distance between query position
  ``i`` and key position ``j`` to the attention scores: :class:`ALiBi` (Press et al. 2022) and
  :class:`T5RelativeBias` (Raffel et al. 2020).

The relative biases share one small protocol (:class:`RelativeBias`): ``dense`` / ``block`` give the
bias as an (H, L, S) array for the dense reference, and ``kernel_args`` gives the plain arrays that
``sparseattn.kernels.bias.bias_value`` evaluates on the selected (i, j) pairs only, so the sparse
kernels never form an L x S matrix.
"""

from __future__ import annotations

import math
import numbers
from functools import lru_cache

import numpy as np

from .inputs import as_float_array, check_position_span, check_positive_int, result_dtype
from .kernels.bias import BIAS_ALIBI, BIAS_T5

__all__ = [
    "ALiBi",
    "LearnedPositionalEncoding",
    "RelativeBias",
    "T5RelativeBias",
    "add_positional",
    "alibi_slopes",
    "apply_rope",
    "concat_positional",
    "rope",
    "sinusoidal_encoding",
    "t5_relative_position_bucket",
]

_OUT_DTYPES = (np.float16, np.float32, np.float64)
_INT64_MAX = np.iinfo(np.int64).max


# ----------------------------------------------------------------------------------------------- helpers
def _check_nonneg_int(value: object, name: str) -> int:
    """An integer >= 0 (bools rejected): sizes such as ``n_positions`` may be zero."""
    return check_positive_int(value, name, minimum=0)


def _check_base(base: object, name: str = "base") -> float:
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"{name} must be a real number > 0; got {base!r} ({type(base).__name__}).")
    b = float(base)
    if not (np.isfinite(b) and b > 0):
        raise ValueError(f"{name} must be finite and > 0; got {base!r}. The usual value is 10000.0.")
    return b


def _check_std(std: object) -> float:
    if isinstance(std, bool) or not isinstance(std, numbers.Real):
        raise TypeError(f"std must be a real number >= 0; got {std!r} ({type(std).__name__}).")
    s = float(std)
    if not (np.isfinite(s) and s >= 0):
        raise ValueError(f"std must be finite and >= 0; got {std!r}.")
    return s


def _check_seed(seed: object) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be a non-negative integer or None; got {seed!r} ({type(seed).__name__}).")
    if int(seed) < 0:
        raise ValueError(f"seed must be a non-negative integer or None; got {seed!r}.")
    return int(seed)


def _int_array(arr: object, name: str) -> np.ndarray:
    """Validate an integer array (any shape) and return it as int64.

    Float positions are rejected even when whole-valued: a float here is usually a mix-up with an
    embedding or a scale, and silently truncating 2.7 to 2 would hide it.
    """
    pos = np.asarray(arr)
    if pos.dtype.kind == "f" and pos.size == 0:  # ``[]`` arrives as float64; an empty list is fine
        return np.zeros(pos.shape, np.int64)
    if pos.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array; got dtype {pos.dtype}. Positions index tokens: "
                        f"pass e.g. np.arange(L), or convert whole-valued floats with .astype(np.int64).")
    if pos.dtype == np.uint64 and pos.size and int(pos.max()) > _INT64_MAX:
        raise ValueError(f"{name} has values above the int64 range (max {int(pos.max())}).")
    return np.asarray(pos, dtype=np.int64)


def _positions_1d(arr: object, name: str, length: int | None = None) -> np.ndarray:
    """A 1-D int64 position vector, optionally of a given length; C-contiguous."""
    pos = _int_array(arr, name)
    if pos.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one position per token); got shape {pos.shape}.")
    if length is not None and pos.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},) to match the sequence length; got {pos.shape}.")
    return np.ascontiguousarray(pos)


def _check_dtype(dtype: object) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype must be a numpy float dtype (float16, float32, float64); got {dtype!r}.") from exc
    if dt.type not in _OUT_DTYPES:
        raise TypeError(f"dtype must be float16, float32 or float64; got {dt}.")
    return dt


# ----------------------------------------------------------------------------------- absolute encodings
def sinusoidal_encoding(n_positions: int, dim: int, *, base: float = 10000.0,
                        dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Sinusoidal absolute position encoding of Vaswani et al. (2017).

    ``PE[pos, 2i] = sin(pos / base**(2i / dim))`` and ``PE[pos, 2i + 1] = cos(pos / base**(2i / dim))``.
    For each frequency pair, ``PE[pos + k]`` is ``PE[pos]`` rotated by the angle ``k / base**(2i/dim)``:
    a fixed linear map for each offset ``k``, which is what lets attention pick out relative positions.

    Parameters
    ----------
    n_positions : int >= 0
        Number of positions (rows), ``0 .. n_positions - 1``.
    dim : int >= 1
        Encoding width. An odd ``dim`` is allowed: the last column is the sine of one more frequency
        (``i = (dim - 1) / 2``) without its cosine partner.
    base : float > 0, default 10000.0
        Wavelength base; wavelengths form a geometric progression from ``2 pi`` to ``2 pi * base``.
    dtype : float16, float32 or float64, default float32
        Output dtype. Angles and sines are computed in float64 then cast, so large positions keep
        their accuracy.

    Returns
    -------
    ndarray, shape (n_positions, dim), dtype ``dtype``

    Examples
    --------
    >>> pe = sinusoidal_encoding(3, 4, dtype=np.float64)
    >>> np.round(pe, 4).tolist()
    [[0.0, 1.0, 0.0, 1.0], [0.8415, 0.5403, 0.01, 1.0], [0.9093, -0.4161, 0.02, 0.9998]]
    """
    n = _check_nonneg_int(n_positions, "n_positions")
    d = check_positive_int(dim, "dim")
    b = _check_base(base)
    dt = _check_dtype(dtype)
    even = np.arange(0, d, 2, dtype=np.float64)  # 2i for i = 0 .. ceil(d/2) - 1
    angle = np.arange(n, dtype=np.float64)[:, None] / np.power(b, even / d)[None, :]
    pe = np.empty((n, d), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, : d // 2])  # odd d: the last sine has no cosine partner
    return pe.astype(dt, copy=False)


class LearnedPositionalEncoding:
    """A learned absolute position table (as in BERT / GPT-2), here seeded random or user supplied.

    Parameters
    ----------
    max_len : int >= 1
        Number of positions the table covers (``0 .. max_len - 1``).
    dim : int >= 1
        Embedding width.
    seed : int or None, default 0
        Seed of ``np.random.default_rng`` for the initial table (ignored when ``table`` is given).
    std : float >= 0, default 0.02
        Standard deviation of the normal initialisation (GPT-2 / BERT use 0.02).
    table : float array (max_len, dim), optional
        Trained weights to use instead of the random initialisation (copied, stored as float32).

    Attributes
    ----------
    table : ndarray (max_len, dim) float32
    max_len, dim : int

    Examples
    --------
    >>> pe = LearnedPositionalEncoding(16, 8, seed=1)
    >>> pe(4).shape, pe([0, 15]).shape
    ((4, 8), (2, 8))
    """

    def __init__(self, max_len: int, dim: int, *, seed: int | None = 0, std: float = 0.02,
                 table: np.ndarray | None = None) -> None:
        self.max_len = check_positive_int(max_len, "max_len")
        self.dim = check_positive_int(dim, "dim")
        if table is not None:
            arr = as_float_array(table, "table", min_ndim=2)
            if arr.shape != (self.max_len, self.dim):
                raise ValueError(f"table must have shape (max_len, dim) = {(self.max_len, self.dim)}; "
                                 f"got {arr.shape}.")
            self.table = np.array(arr, dtype=np.float32, order="C")
        else:
            s = _check_std(std)
            rng = np.random.default_rng(_check_seed(seed))
            self.table = (rng.standard_normal((self.max_len, self.dim)) * s).astype(np.float32)

    def __call__(self, positions: int | np.ndarray) -> np.ndarray:
        """Encodings of the first ``n`` positions, or of the given positions.

        Parameters
        ----------
        positions : int or integer array of any shape
            An int ``n`` means positions ``0 .. n - 1``; an array selects rows of the table.

        Returns
        -------
        ndarray float32, shape (n, dim) or ``positions.shape + (dim,)`` (a copy, never a view).
        """
        if isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
            n = _check_nonneg_int(positions, "positions")
            if n > self.max_len:
                raise ValueError(f"positions asks for {n} positions but the table has max_len = "
                                 f"{self.max_len}. Build a longer table or use sinusoidal_encoding, "
                                 f"which extrapolates.")
            return self.table[:n].copy()
        if isinstance(positions, bool):
            raise TypeError("positions must be an int or an integer array; got bool.")
        pos = _int_array(positions, "positions")
        if pos.size:
            lo, hi = int(pos.min()), int(pos.max())
            if lo < 0 or hi >= self.max_len:
                bad = lo if lo < 0 else hi
                raise ValueError(f"positions must lie in [0, max_len) = [0, {self.max_len}); got {bad}. "
                                 f"A learned table cannot extrapolate: build it with a larger max_len.")
        return self.table[pos]

    def __repr__(self) -> str:
        return f"LearnedPositionalEncoding(max_len={self.max_len}, dim={self.dim})"


def _finite_result(out: np.ndarray, what: str) -> np.ndarray:
    """``out`` computed from finite inputs, or a ValueError when it overflowed its dtype to inf (a silent
    inf would turn every later score into NaN)."""
    if not np.isfinite(out).all():
        top = float(np.finfo(out.dtype).max)
        raise ValueError(f"{what} overflows {out.dtype.name} (a result beyond its largest value {top:.4g}); "
                         f"pass float64 inputs, or rescale them.")
    return out


def _check_pe(x: object, pe: object) -> tuple[np.ndarray, np.ndarray]:
    xa = as_float_array(x, "x", min_ndim=2)
    pa = as_float_array(pe, "pe", min_ndim=2)
    L = xa.shape[-2]
    if pa.shape[-2] != L:
        raise ValueError(f"pe must have {L} rows (the length of x, dimension -2); got pe.shape = {pa.shape}. "
                         f"Slice a longer table with pe[:{L}].")
    try:
        np.broadcast_shapes(pa.shape[:-2], xa.shape[:-2])
    except ValueError:
        raise ValueError(f"pe's leading dimensions {pa.shape[:-2]} do not broadcast against x's "
                         f"{xa.shape[:-2]}; pass pe as (L, P) to share it across the batch.") from None
    return xa, pa


def add_positional(x: np.ndarray, pe: np.ndarray) -> np.ndarray:
    """Add position encodings to token embeddings: ``x + pe``.

    Parameters
    ----------
    x : float array, shape (..., L, E)
        Token embeddings.
    pe : float array, shape (L, E) or broadcastable (..., L, E)
        Encodings of the L positions (e.g. ``sinusoidal_encoding(L, E)``).

    Returns
    -------
    ndarray, shape (..., L, E), dtype ``np.result_type(x, pe)``
    """
    xa, pa = _check_pe(x, pe)
    if pa.shape[-1] != xa.shape[-1]:
        raise ValueError(f"pe must have the embedding width of x ({xa.shape[-1]}) to be added; got "
                         f"pe.shape = {pa.shape}. Use concat_positional to append encodings of another width.")
    with np.errstate(over="ignore", invalid="ignore"):
        out = xa + pa
    return _finite_result(out, "x + pe")


def concat_positional(x: np.ndarray, pe: np.ndarray) -> np.ndarray:
    """Concatenate position encodings to token embeddings along the feature axis.

    Parameters
    ----------
    x : float array, shape (..., L, E)
    pe : float array, shape (L, P) or broadcastable (..., L, P)

    Returns
    -------
    ndarray, shape (broadcast(...), L, E + P), dtype ``np.result_type(x, pe)``
    """
    xa, pa = _check_pe(x, pe)
    lead = np.broadcast_shapes(pa.shape[:-2], xa.shape[:-2])
    L = xa.shape[-2]
    dt = np.result_type(xa.dtype, pa.dtype)
    out = np.empty(lead + (L, xa.shape[-1] + pa.shape[-1]), dtype=dt)
    out[..., : xa.shape[-1]] = xa
    out[..., xa.shape[-1]:] = pa
    return out


# ---------------------------------------------------------------------------------------------- RoPE
_LAYOUTS = ("interleaved", "half")


def _rope_positions(positions: object, lead: tuple[int, ...], L: int, name: str) -> np.ndarray:
    if positions is None:
        return np.arange(L, dtype=np.int64)
    pos = _int_array(positions, name)
    if pos.ndim == 0 or pos.shape[-1] != L:
        raise ValueError(f"{name} must end in the sequence length {L} (shape (L,) or broadcastable to "
                         f"{lead + (L,)}); got shape {pos.shape}.")
    try:
        ok = np.broadcast_shapes(pos.shape, lead + (L,)) == lead + (L,)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {pos.shape} does not broadcast to the input's {lead + (L,)}.")
    return pos


def apply_rope(x: np.ndarray, positions: object = None, *, base: float = 10000.0,
               layout: str = "interleaved") -> np.ndarray:
    """Rotary position embedding (RoPE, Su et al. 2021): rotate feature pairs by position-dependent angles.

    Pair ``i`` (of ``D/2``) at position ``m`` is rotated by ``m * theta_i`` with
    ``theta_i = base**(-2i / D)``::

        out_a = x_a cos(m theta_i) - x_b sin(m theta_i)
        out_b = x_a sin(m theta_i) + x_b cos(m theta_i)

    Because rotations compose, ``apply_rope(q, m) . apply_rope(k, n)`` depends on ``m - n`` only.

    Parameters
    ----------
    x : float array, shape (..., L, D), D even
        Queries or keys (per head).
    positions : integer array, shape (L,) or broadcastable to (..., L), optional
        Position of each row; default ``arange(L)``.
    base : float > 0, default 10000.0
    layout : {"interleaved", "half"}, default "interleaved"
        Which features form pair ``i``: ``(x[2i], x[2i+1])`` as in RoFormer ("interleaved"), or
        ``(x[i], x[i + D/2])`` as in GPT-NeoX / Hugging Face ``rotate_half`` ("half").  The two are
        the same rotation up to a fixed permutation of the features; use the one the weights were
        trained with.

    Returns
    -------
    ndarray, shape (..., L, D); float64 for float64 input, else float32 (float16 is upcast).
    Angles are computed in float64, so long sequences keep accurate phases.

    Examples
    --------
    >>> x = np.array([[1.0, 0.0], [1.0, 0.0]])
    >>> np.round(apply_rope(x), 4).tolist()  # position 1 turns (1, 0) by 1 radian
    [[1.0, 0.0], [0.5403, 0.8415]]
    """
    xa = as_float_array(x, "x", min_ndim=2)
    return _apply_rope(xa, positions, _check_base(base), _check_layout(layout), "x", "positions")


def _check_layout(layout: object) -> str:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}; got {layout!r}. 'interleaved' pairs "
                         f"(x[2i], x[2i+1]) (RoFormer); 'half' pairs (x[i], x[i+D/2]) (GPT-NeoX / HF).")
    return str(layout)


def _apply_rope(xa: np.ndarray, positions: object, b: float, layout: str, x_name: str,
                pos_name: str) -> np.ndarray:
    """RoPE on a validated array; ``x_name`` / ``pos_name`` are the caller's argument names for errors."""
    D = xa.shape[-1]
    if D % 2:
        raise ValueError(f"{x_name} must have an even feature dimension for RoPE (features rotate in pairs); "
                         f"got D = {D} (shape {xa.shape}). Pad one feature or use a head size that is even.")
    lead, L = xa.shape[:-2], xa.shape[-2]
    pos = _rope_positions(positions, lead, L, pos_name)
    cdt = result_dtype(xa)
    inv_freq = 1.0 / np.power(b, np.arange(0, D, 2, dtype=np.float64) / D)  # (D/2,)
    angle = pos[..., None].astype(np.float64) * inv_freq  # (..., L, D/2)
    cos = np.cos(angle).astype(cdt, copy=False)
    sin = np.sin(angle).astype(cdt, copy=False)
    xc = xa.astype(cdt, copy=False)
    out = np.empty(np.broadcast_shapes(xa.shape, pos.shape + (D,)), dtype=cdt)
    with np.errstate(over="ignore", invalid="ignore"):  # a pair whose norm exceeds the dtype: checked below
        if layout == "interleaved":
            a, c = xc[..., 0::2], xc[..., 1::2]
            out[..., 0::2] = a * cos - c * sin
            out[..., 1::2] = a * sin + c * cos
        else:
            h = D // 2
            a, c = xc[..., :h], xc[..., h:]
            out[..., :h] = a * cos - c * sin
            out[..., h:] = a * sin + c * cos
    return _finite_result(out, f"RoPE of {x_name} (a rotated feature pair)")


def rope(q: np.ndarray, k: np.ndarray, query_positions: object = None, key_positions: object = None, *,
         base: float = 10000.0, layout: str = "interleaved") -> tuple[np.ndarray, np.ndarray]:
    """Rotate queries and keys with RoPE; see :func:`apply_rope`.

    Parameters
    ----------
    q : float array, shape (..., L, D), D even
    k : float array, shape (..., S, D)
    query_positions : integer array (L,) or broadcastable to (..., L), optional; default ``arange(L)``
    key_positions : integer array (S,) or broadcastable to (..., S), optional; default ``arange(S)``
        With a KV cache, queries usually sit at the end: ``query_positions = arange(S - L, S)``.
    base, layout : see :func:`apply_rope`

    Returns
    -------
    (q_rot, k_rot) : ndarrays of the shapes of ``q`` and ``k``.
    """
    qa = as_float_array(q, "q", min_ndim=2)
    ka = as_float_array(k, "k", min_ndim=2)
    if qa.shape[-1] != ka.shape[-1]:
        raise ValueError(f"q and k must have the same feature dimension to be scored; got "
                         f"q.shape = {qa.shape}, k.shape = {ka.shape}.")
    b = _check_base(base)
    lay = _check_layout(layout)
    q_rot = _apply_rope(qa, query_positions, b, lay, "q", "query_positions")
    k_rot = _apply_rope(ka, key_positions, b, lay, "k", "key_positions")
    return q_rot, k_rot


# ------------------------------------------------------------------------------------ relative biases
class RelativeBias:
    """Protocol of an additive relative-position bias ``b_h(i, j)`` on attention scores.

    Subclasses set ``num_heads`` and implement :meth:`dense` and :meth:`kernel_args`.

    * ``dense(query_positions, key_positions)`` -> (H, L, S) float64, for the dense reference;
    * ``block(query_positions_block, key_positions)`` -> (H, b, S), the same for a block of queries
      (the blocked reference calls it tile by tile and never forms all L x S at once);
    * ``kernel_args()`` -> ``(kind, params, ints)`` in the layout of ``sparseattn.kernels.bias``:
      ``kind`` int, ``params`` float64 (H, P) C-contiguous, ``ints`` int64 (3,).
    """

    num_heads: int
    kind: int = 0

    def dense(self, query_positions: object, key_positions: object) -> np.ndarray:
        """The bias for every (query, key) pair.

        Parameters
        ----------
        query_positions : integer array, shape (L,)
        key_positions : integer array, shape (S,)

        Returns
        -------
        ndarray float64, shape (num_heads, L, S)
        """
        qpos = _positions_1d(query_positions, "query_positions")
        kpos = _positions_1d(key_positions, "key_positions")
        check_position_span(qpos, kpos)
        return self._dense(qpos, kpos, None)

    def block(self, query_positions_block: object, key_positions: object, *,
              head: int | None = None) -> np.ndarray:
        """The bias for a block of queries against some keys.

        Parameters
        ----------
        query_positions_block : integer array, shape (b,)
        key_positions : integer array, shape (S,)
        head : int, optional
            Only this head: the result is (b, S). Saves H-fold work when the caller handles one head
            at a time.

        Returns
        -------
        ndarray float64, shape (num_heads, b, S), or (b, S) when ``head`` is given.
        """
        qpos = _positions_1d(query_positions_block, "query_positions_block")
        kpos = _positions_1d(key_positions, "key_positions")
        check_position_span(qpos, kpos)
        if head is None:
            return self._dense(qpos, kpos, None)
        if isinstance(head, bool) or not isinstance(head, numbers.Integral) or not 0 <= head < self.num_heads:
            raise ValueError(f"head must be an int in [0, num_heads) = [0, {self.num_heads}); got {head!r}.")
        return self._dense(qpos, kpos, int(head))[0]

    def kernel_args(self) -> tuple[int, np.ndarray, np.ndarray]:
        """``(kind, params float64 (H, P) C-contiguous, ints int64 (3,))`` for ``kernels.bias``."""
        raise NotImplementedError

    def _dense(self, qpos: np.ndarray, kpos: np.ndarray, head: int | None) -> np.ndarray:
        raise NotImplementedError


def _check_num_heads(num_heads: object) -> int:
    return check_positive_int(num_heads, "num_heads")


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi head slopes of Press et al. (2022), as in the paper's reference code.

    For a power of two ``H`` the slopes are the geometric sequence ``2**(-8 (h + 1) / H)``,
    ``h = 0 .. H-1``.  Otherwise, with ``P`` the largest power of two below ``H``, they are the ``P``
    slopes for ``P`` heads followed by every other slope for ``2P`` heads (the 1st, 3rd, ...), up to
    ``H`` in total.

    Parameters
    ----------
    num_heads : int >= 1

    Returns
    -------
    ndarray float64, shape (num_heads,)

    Examples
    --------
    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    H = _check_num_heads(num_heads)

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    p = 1 << (H.bit_length() - 1)  # largest power of two <= H
    if p == H:
        return np.array(power_of_two(H), dtype=np.float64)
    extra = power_of_two(2 * p)[0::2][: H - p]
    return np.array(power_of_two(p) + extra, dtype=np.float64)


class ALiBi(RelativeBias):
    """Attention with Linear Biases (Press et al. 2022): ``b_h(i, j) = -slope_h * |pos_j - pos_i|``.

    The symmetric ``|.|`` form equals the paper's causal ``-slope * (i - j)`` on every key a causal
    query can see, and is what ``kernels.bias`` kind 1 computes.

    Parameters
    ----------
    num_heads : int >= 1
    slopes : float array (num_heads,), optional
        Custom slopes (finite); default :func:`alibi_slopes`.

    Attributes
    ----------
    num_heads : int
    slopes : ndarray float64 (num_heads,)

    Examples
    --------
    >>> ALiBi(2).dense([0, 1], [0, 1, 2])[0].tolist()  # slopes 2**-4, 2**-8
    [[-0.0, -0.0625, -0.125], [-0.0625, -0.0, -0.0625]]
    """

    kind = BIAS_ALIBI

    def __init__(self, num_heads: int, *, slopes: np.ndarray | None = None) -> None:
        self.num_heads = _check_num_heads(num_heads)
        if slopes is None:
            self.slopes = alibi_slopes(self.num_heads)
        else:
            s = as_float_array(slopes, "slopes", min_ndim=1)
            if s.shape != (self.num_heads,):
                raise ValueError(f"slopes must have shape (num_heads,) = ({self.num_heads},); got {s.shape}.")
            self.slopes = np.array(s, dtype=np.float64)

    def _dense(self, qpos: np.ndarray, kpos: np.ndarray, head: int | None) -> np.ndarray:
        # float64 distance times float64 slope: the same operations, in the same order, as the kernel.
        dist = np.abs(kpos[None, :] - qpos[:, None]).astype(np.float64)
        slopes = self.slopes if head is None else self.slopes[head:head + 1]
        return -slopes[:, None, None] * dist[None]

    def kernel_args(self) -> tuple[int, np.ndarray, np.ndarray]:
        """``(1, slopes as float64 (H, 1), zeros int64 (3,))``."""
        return BIAS_ALIBI, np.ascontiguousarray(self.slopes[:, None], dtype=np.float64), np.zeros(3, np.int64)

    def __repr__(self) -> str:
        return f"ALiBi(num_heads={self.num_heads})"


def _check_t5_config(num_buckets: object, max_distance: object, bidirectional: object) -> tuple[bool, int, int]:
    if not isinstance(bidirectional, (bool, np.bool_)):
        raise TypeError(f"bidirectional must be a bool; got {bidirectional!r} ({type(bidirectional).__name__}).")
    bi = bool(bidirectional)
    nb = check_positive_int(num_buckets, "num_buckets", minimum=4 if bi else 2)
    md = check_positive_int(max_distance, "max_distance")
    max_exact = (nb // 2 if bi else nb) // 2
    if md <= max_exact:
        raise ValueError(f"max_distance must exceed the number of exact buckets ({max_exact} for "
                         f"num_buckets={nb}, bidirectional={bi}); got {md}. T5 uses num_buckets=32, "
                         f"max_distance=128.")
    return bi, nb, md


@lru_cache(maxsize=64)
def _t5_magnitude_table(bidirectional: bool, num_buckets: int, max_distance: int) -> np.ndarray:
    """Bucket (before the direction offset) of each distance ``n = 0 .. max_distance``.

    Every distance >= max_distance falls in the last bucket, so this table covers all of them.  The
    log-spaced buckets are computed with Python floats (float64 and the C library's ``log``) in the
    exact order of operations of ``kernels.bias.t5_bucket``: a bucket boundary can sit on a value
    that is an integer in exact arithmetic, and there float32, float64 and a differently ordered
    formula disagree by one bucket.  Mirroring the kernel keeps the dense reference equal to it.
    """
    nb = num_buckets // 2 if bidirectional else num_buckets
    max_exact = nb // 2
    table = np.empty(max_distance + 1, dtype=np.int64)
    for n in range(max_distance + 1):
        if n < max_exact:
            table[n] = n
        else:
            # + 1e-9: boundaries that are exact integers must not flip with float rounding (matches
            # kernels/bias.t5_bucket, which is compiled with fastmath).
            large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                                    * (nb - max_exact) + 1e-9)
            table[n] = min(large, nb - 1)
    table.flags.writeable = False
    return table


def t5_relative_position_bucket(relative_position: object, *, bidirectional: bool = True,
                                num_buckets: int = 32, max_distance: int = 128) -> np.ndarray:
    """T5's bucket of a relative position ``key_pos - query_pos`` (Hugging Face ``_relative_position_bucket``).

    Bidirectional: half the buckets for keys after the query (``rel > 0``), half for the rest.
    Within a half, the first ``max_exact = half // 2`` buckets are exact distances, the others
    log-spaced up to ``max_distance``; farther distances share the last bucket.  Unidirectional
    (decoder) attention: future keys (``rel > 0``) all fall in bucket 0 (distance 0).

    Parameters
    ----------
    relative_position : integer array, any shape
        ``key_position - query_position``.
    bidirectional : bool, default True
    num_buckets : int, default 32 (>= 4 bidirectional, >= 2 otherwise)
    max_distance : int, default 128 (> the number of exact buckets)

    Returns
    -------
    ndarray int64, shape of ``relative_position``, values in ``[0, num_buckets)``.

    Notes
    -----
    Equal to ``sparseattn.kernels.bias.t5_bucket`` (float64) for every input.  Hugging Face computes
    the log in float32; for T5's configurations (32 buckets, max distance 128) the buckets agree, but
    at a handful of (num_buckets, max_distance, distance) triples where the exact bucket boundary is an
    integer the two roundings differ by one bucket (e.g. unidirectional, 9 buckets, max distance 128,
    distance 8).

    Examples
    --------
    >>> t5_relative_position_bucket(np.array([-200, -9, -1, 0, 1, 9, 200])).tolist()
    [15, 8, 1, 0, 17, 24, 31]
    """
    bi, nb, md = _check_t5_config(num_buckets, max_distance, bidirectional)
    rel = _int_array(relative_position, "relative_position")
    if bi:
        offset = np.where(rel > 0, nb // 2, 0)
        n = np.abs(rel)
    else:
        offset = 0
        n = np.maximum(-rel, 0)
    table = _t5_magnitude_table(bi, nb, md)
    return offset + table[np.minimum(n, md)]


class T5RelativeBias(RelativeBias):
    """T5 relative position bias (Raffel et al. 2020): a learned scalar per (head, distance bucket).

    ``b_h(i, j) = table[h, bucket(pos_j - pos_i)]`` with :func:`t5_relative_position_bucket`.

    Parameters
    ----------
    num_heads : int >= 1
    num_buckets : int, default 32
    max_distance : int, default 128
    bidirectional : bool, default True
        True for encoders (keys before and after a query get different buckets), False for causal
        decoders.
    seed : int or None, default 0
        Seed of ``np.random.default_rng`` for the random table (ignored when ``table`` is given).
    table : float array (num_heads, num_buckets), optional
        Trained weights (e.g. a transposed Hugging Face ``relative_attention_bias.weight``).
    std : float >= 0, default 1.0
        Standard deviation of the random table: order-one biases visibly shape the attention, which
        is what demos and tests want (a trained T5 table spans a few units).

    Attributes
    ----------
    num_heads, num_buckets, max_distance : int
    bidirectional : bool
    table : ndarray float64 (num_heads, num_buckets), C-contiguous
    """

    kind = BIAS_T5

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, seed: int | None = 0, table: np.ndarray | None = None,
                 std: float = 1.0) -> None:
        self.num_heads = _check_num_heads(num_heads)
        self.bidirectional, self.num_buckets, self.max_distance = _check_t5_config(
            num_buckets, max_distance, bidirectional)
        if table is not None:
            arr = as_float_array(table, "table", min_ndim=2)
            if arr.shape != (self.num_heads, self.num_buckets):
                raise ValueError(f"table must have shape (num_heads, num_buckets) = "
                                 f"{(self.num_heads, self.num_buckets)}; got {arr.shape}. A Hugging Face "
                                 f"embedding weight is (num_buckets, num_heads): pass its transpose.")
            self.table = np.array(arr, dtype=np.float64, order="C")
        else:
            s = _check_std(std)
            rng = np.random.default_rng(_check_seed(seed))
            self.table = rng.standard_normal((self.num_heads, self.num_buckets)) * s

    def bucket(self, relative_position: object) -> np.ndarray:
        """Bucket ids (int64, same shape) of ``relative_position = key_pos - query_pos``."""
        return t5_relative_position_bucket(relative_position, bidirectional=self.bidirectional,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)

    def _dense(self, qpos: np.ndarray, kpos: np.ndarray, head: int | None) -> np.ndarray:
        b = self.bucket(kpos[None, :] - qpos[:, None])
        table = self.table if head is None else self.table[head:head + 1]
        return table[:, b]

    def kernel_args(self) -> tuple[int, np.ndarray, np.ndarray]:
        """``(2, table float64 (H, num_buckets), [bidirectional, num_buckets, max_distance] int64)``."""
        ints = np.array([int(self.bidirectional), self.num_buckets, self.max_distance], dtype=np.int64)
        return BIAS_T5, np.ascontiguousarray(self.table, dtype=np.float64), ints

    def __repr__(self) -> str:
        return (f"T5RelativeBias(num_heads={self.num_heads}, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}, bidirectional={self.bidirectional})")
