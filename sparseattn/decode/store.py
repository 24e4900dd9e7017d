"""Slot storage of the decode cache: keys, values and positions per kv head, the storage codec, growth
and compaction.

Each kv head owns one row of every per-slot array; a slot holds one key, its value and its int32
position (``EVICTED`` once the key is evicted: after every query, so no row ever sees it).  Storage is
float32, float16 or bfloat16 (uint16 bit patterns); every read for arithmetic goes through
:meth:`SlotStore.decode` (float32).  Other parts (eviction, routing strategies) register extra per-slot
arrays with :meth:`SlotStore.add_slot_array`, and the store moves them together with the keys whenever
slots move (growth, reordering, compaction).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import decode as kd
from ..kernels.decode import EVICTED

__all__ = ["EVICTED", "INT32_MAX", "SlotStore", "bf16_bits", "bf16_to_f32", "check_float", "is_torch",
           "resolve_storage", "to_numpy"]

INT32_MAX = 2**31 - 1
_BF16_NAMES = ("bfloat16", "bf16")


# ---------------------------------------------------------------------------------------- conversions
def is_torch(x: object) -> bool:
    """True for a torch tensor (or parameter), without importing torch."""
    mod = type(x).__module__
    return mod.startswith("torch") and type(x).__name__ in ("Tensor", "Parameter")


def to_numpy(x: object, name: str) -> np.ndarray:
    """numpy view of an array-like or a torch CPU tensor (bfloat16 tensors are widened to float32)."""
    if is_torch(x):
        import torch

        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad while autograd is enabled, but KVCache has no backward "
                             f"pass. Run the call under torch.no_grad() or torch.inference_mode(), or pass "
                             f"{name}.detach().")
        t = x.detach()
        if t.device.type != "cpu":
            raise ValueError(f"{name} is a torch tensor on {t.device}; KVCache runs on the CPU. "
                             f"Pass {name}.cpu().")

        if t.dtype == torch.bfloat16:
            t = t.float()
        if t.dtype not in (torch.float16, torch.float32, torch.float64):
            raise TypeError(f"{name} must have dtype float16, bfloat16, float32 or float64; got {t.dtype}. "
                            f"Convert with {name}.float().")
        return t.numpy()
    arr = np.asarray(x)
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:  # e.g. ml_dtypes bfloat16 seen as void
        raise TypeError(f"{name}: unsupported dtype {arr.dtype}; pass float16/32/64.")
    return arr


def check_float(arr: np.ndarray, name: str) -> None:
    """TypeError unless ``arr`` is float16, float32 or float64."""
    if arr.dtype.kind != "f" or arr.dtype.type not in (np.float16, np.float32, np.float64):
        raise TypeError(f"{name} must have dtype float16, float32 or float64; got {arr.dtype}. "
                        f"Convert with {name}.astype(np.float32).")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def resolve_storage(dtype: object) -> tuple[str, np.dtype]:
    """(storage name, numpy dtype of the stored arrays) for ``dtype``."""
    if isinstance(dtype, str) and dtype.lower() in _BF16_NAMES:
        return "bfloat16", np.dtype(np.uint16)
    if type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
        if name == "bfloat16":
            return "bfloat16", np.dtype(np.uint16)
        dtype = name
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt == np.float32:
        return "float32", dt
    if dt == np.float16:
        return "float16", dt
    raise ValueError(f"dtype must be numpy.float32, numpy.float16 or 'bfloat16' (storage; accumulation is "
                     f"float32 in every case); got {dtype!r}.")


# ---------------------------------------------------------------------------------------------- store
class SlotStore:
    """Per-kv-head slot arrays of a decode cache.

    Parameters
    ----------
    num_kv_heads, head_dim, value_dim : int
        H_kv, E and Ev.
    dtype : numpy.float32, numpy.float16 or "bfloat16"
        Storage of keys and values.
    sinks, window, segment, page_size : int
        Layout constants: growth adds ``segment`` slots of headroom and rounds to ``page_size``.
    max_keys : int or None
        Memory cap: at most ``max_keys + 2 segment + window + sinks`` slots are ever allocated.

    Attributes
    ----------
    K : (H_kv, cap, E) storage dtype; V : (H_kv, cap, Ev); pos : (H_kv, cap) int32
        Slot ``j < slots`` of kv head g holds key ``K[g, j]``, value ``V[g, j]`` at position ``pos[g, j]``.
    n : int
        Positions appended so far (the next key's position).
    n_live : int
        Keys attendable per kv head (every head holds as many).
    slots : int
        Slots in use (live + evicted, not yet compacted).
    pad : int
        Evicted slots left after the last compaction.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, value_dim: int, dtype: object, *, sinks: int,
                 window: int, segment: int, page_size: int, max_keys: int | None) -> None:
        self.num_kv_heads, self.head_dim, self.value_dim = num_kv_heads, head_dim, value_dim
        self.storage, self.sdtype = resolve_storage(dtype)
        self.sinks, self.window, self.segment, self.page_size = sinks, window, segment, page_size
        self.max_keys = max_keys
        hk = num_kv_heads
        self.n = 0
        self.n_live = 0
        self.slots = 0
        self.pad = 0
        self.cap = 0
        self.evict_from = 0  # no slot before this holds a key still to evict (a hint; 0 after moves)
        self.K = np.zeros((hk, 0, head_dim), self.sdtype)
        self.V = np.zeros((hk, 0, value_dim), self.sdtype)
        self.pos = np.zeros((hk, 0), np.int32)
        self._names = ["K", "V", "pos"]

    def add_slot_array(self, name: str, dtype: Any, shape: tuple[int, ...] = ()) -> None:
        """Register a per-slot array ``name`` of shape (H_kv, cap, *shape) (moved with the keys)."""
        setattr(self, name, np.zeros((self.num_kv_heads, self.cap) + tuple(shape), dtype))
        self._names.append(name)

    @property
    def slot_array_names(self) -> tuple[str, ...]:
        """Names of the per-slot arrays (moved together whenever slots move)."""
        return tuple(self._names)

    @property
    def s0(self) -> int:
        """Slots of the sinks in use (``min(sinks, slots)``)."""
        return min(self.sinks, self.slots)

    # ------------------------------------------------------------------------------------------ codec
    def encode(self, x: np.ndarray, name: str) -> np.ndarray:
        """Round validated float input to the storage dtype (values beyond its range -> ValueError)."""
        if self.storage == "bfloat16":
            with np.errstate(over="ignore"):  # float64 beyond float32's range: inf bits, refused below
                bits = bf16_bits(x)
            if (bits & 0x7F80 == 0x7F80).any():
                raise ValueError(f"{name} has values beyond bfloat16's range (|x| > 3.39e38 after rounding); "
                                 f"use dtype=np.float32 storage.")
            return bits
        if x.dtype == self.sdtype:
            return x
        if self.storage == "float16":  # |x| >= 65520 rounds to inf; below, the cast is exact or rounds
            if x.size and float(np.abs(x).max()) >= 65520.0:
                raise ValueError(f"{name} has values beyond float16's range (|x| > 65504); use dtype=np.float32 "
                                 f"or 'bfloat16' storage.")
            return x.astype(np.float16)
        with np.errstate(over="ignore"):
            out = x.astype(np.float32)
        if not np.isfinite(out).all():
            raise ValueError(f"{name} has values beyond float32's range (|x| > 3.4e38); scale them down before "
                             f"appending (the cache stores float32 at most).")
        return out

    def decode(self, x: np.ndarray) -> np.ndarray:
        """Stored values (any shape) as float32."""
        if self.storage == "bfloat16":
            return bf16_to_f32(x)
        return x.astype(np.float32)

    def keys(self, g: int, slots: Any = None) -> np.ndarray:
        """Keys of kv head ``g`` as a new float32 array: all slots in use, or ``slots`` (an index)."""
        return self._gather(self.K, g, slots)

    def values(self, g: int, slots: Any = None) -> np.ndarray:
        """Values of kv head ``g`` as a new float32 array: all slots in use, or ``slots`` (an index)."""
        return self._gather(self.V, g, slots)

    def _gather(self, arr: np.ndarray, g: int, slots: Any) -> np.ndarray:
        if isinstance(slots, np.ndarray) and slots.dtype.kind in "iu":  # fancy indexing copies already
            x = arr[g, slots]
            return bf16_to_f32(x) if self.storage == "bfloat16" else x.astype(np.float32, copy=False)
        return self.decode(arr[g, :self.slots] if slots is None else arr[g, slots])

    def kernel_arrays(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        """Storage arrays as the kernels read them (float16 as uint16 bit patterns)."""
        if self.storage == "float16":
            return tuple(a.view(np.uint16) for a in arrays)
        return arrays

    def write_token(self, keys: np.ndarray, values: np.ndarray) -> bool:
        """Write one float32 token (H_kv, 1, E) / (H_kv, 1, Ev) into slot ``slots`` (reserved), checked and
        rounded to the storage dtype by one compiled call per array; False when a value is not finite or
        beyond the storage range (the slot is then past the end: the partial write is never read)."""
        store = {"float32": kd.store_token_f32, "float16": kd.store_token_f16,
                 "bfloat16": kd.store_token_bf16}[self.storage]
        K, V = self.kernel_arrays(self.K, self.V)
        return not (store(keys, K[:, self.slots]) or store(values, V[:, self.slots]))

    # -------------------------------------------------------------------------------------- growth
    def reserve(self, extra: int, *, exact: bool = False) -> int | None:
        """Make room for ``extra`` more slots; returns the new capacity, or None when nothing grew.

        Storage grows by half its size (at least ``segment``) unless ``exact``; under ``max_keys`` it
        never passes the capped size."""
        need = self.slots + extra
        if need <= self.cap:
            return None
        new_cap = need if exact else max(need + self.segment, int(self.cap * 1.5))  # headroom: prompt, steps
        if self.max_keys is not None:  # a capped cache never holds more than `limit` slots
            limit = self.max_keys + 2 * self.segment + self.window + self.sinks
            new_cap = min(new_cap, limit) if exact else max(need, min(new_cap, limit))
            if new_cap <= self.cap:
                return None
        new_cap = -(-new_cap // self.page_size) * self.page_size
        for name in self._names:
            old = getattr(self, name)
            arr = np.zeros((old.shape[0], new_cap) + old.shape[2:], old.dtype)
            arr[:, :self.slots] = old[:, :self.slots]
            setattr(self, name, arr)
        self.cap = new_cap
        return new_cap

    def commit(self, a: int, b: int) -> None:
        """Slots [a, b) (just written at the end) become the next positions."""
        if b == a + 1:
            self.pos[:, a] = self.n
        else:
            self.pos[:, a:b] = np.arange(self.n, self.n + (b - a), dtype=np.int32)
        self.slots = b
        self.n += b - a
        self.n_live += b - a

    def permute(self, g: int, a: int, b: int, order: np.ndarray) -> None:
        """Reorder slots [a, b) of kv head ``g`` (every per-slot array) by ``order``."""
        for name in self._names:
            arr = getattr(self, name)
            arr[g, a:b] = arr[g, a:b][order]

    def plain_sources(self, live: np.ndarray, a: int, b: int) -> tuple[int, list[np.ndarray]]:
        """Compaction of the position-ordered region [a, b): (R, per kv head the R source slots: its live
        keys in order, padded with evicted ones up to R = the largest live count of a head)."""
        nl = live[:, a:b].sum(axis=1)
        R = int(nl.max()) if b > a else 0
        src = []
        for g in range(self.num_kv_heads):
            dead = np.flatnonzero(~live[g, a:b])[:R - int(nl[g])]
            src.append(a + np.sort(np.concatenate([dead, np.flatnonzero(live[g, a:b])])))
        return R, src

    def compact(self, src: list[np.ndarray]) -> None:
        """Rewrite the slots after the sinks: kv head g's new slot ``s0 + i`` is its old slot ``src[g][i]``
        (every head the same length); evicted slots beyond are dropped."""
        s0 = self.s0
        W = len(src[0]) if src else 0
        for name in self._names:
            arr = getattr(self, name)
            new = np.zeros_like(arr)
            if name == "pos":
                new[:] = EVICTED
            new[:, :s0] = arr[:, :s0]
            for g in range(self.num_kv_heads):
                new[g, s0:s0 + W] = arr[g, src[g]]
            setattr(self, name, new)
        self.slots = s0 + W
        self.pad = self.slots - self.n_live
        self.evict_from = 0  # slots moved

    # -------------------------------------------------------------------------------------- queries
    def live_positions(self, g: int) -> np.ndarray:
        """Sorted int64 positions of the keys kv head ``g`` can attend to now."""
        p = self.pos[g, :self.slots].astype(np.int64)
        return np.sort(p[p != EVICTED])

    def visible_counts(self, qpos: np.ndarray) -> np.ndarray:
        """(H_kv, T) int64: keys of each kv head visible at each query position (live, ``pos <= qpos[t]``)."""
        hk, n = self.num_kv_heads, self.slots
        T = qpos.shape[0]
        vis = np.full((hk, T), int(self.n_live), dtype=np.int64)  # the newest position sees every live key
        older = np.flatnonzero(qpos < self.n - 1)
        if older.size == 0 or n == 0:
            return vis
        pos = self.pos[:, :n]
        if older.size <= 8:
            for t in older:
                vis[:, t] = np.count_nonzero(pos <= qpos[t], axis=1)
        else:
            for g in range(hk):
                vis[g, older] = np.searchsorted(np.sort(pos[g]), qpos[older], side="right")
        return vis

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the stored keys and values (slots in use)."""
        return self.slots * self.num_kv_heads * (self.head_dim + self.value_dim) * self.sdtype.itemsize
