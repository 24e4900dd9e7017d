"""Leading-dimension broadcasting for (..., L, E) attention inputs without copies.

Attention inputs share leading (batch, head) dimensions that broadcast like numpy's.  Rather than
materialising broadcast copies (K shared by 12 heads would be copied 12 times), we compute, for every
flattened group g, which slice of each operand it reads.  Grouped-query attention (fewer K/V heads than
query heads) is the same idea: query head h reads K/V head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import numpy as np


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
