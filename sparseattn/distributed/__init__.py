"""A key store sharded over Dask workers, queried with exact log-sum-exp merging.

Attention over a union of disjoint key sets is exactly the log-sum-exp merge of the attention over each
set (:func:`sparseattn.merge_attention`), so keys and values can be split over many worker processes
with no approximation added by the split: each worker attends over its own shard and sends back an
``(output, lse)`` pair per query, and the client merges them.

Layout: shard ``i`` holds the keys ``[start_i, stop_i)`` of the store, and the store's key positions must
be non-decreasing, so each shard is also a *position range*.  Position ranges (rather than hashing or
round-robin) are what make causal attention cheap: a query at position ``p`` cannot see a key at a larger
position, so it is sent only to the shards whose first position is ``<= p`` and skips every whole future
shard.  The price is that a batch of early queries (e.g. prefill of the first tokens) loads only the
first shards.

Each shard lives in one worker process (a Dask actor) together with its selector's index, built once when
the store is made and reused by every :meth:`ShardedKeyStore.attend`; queries travel to the workers and
``(output, lse)`` travel back, never the keys.  With ``replicas=r`` each shard is held by ``r`` workers
and a call that fails on one is retried on the next (also when the worker died between two calls); a
replica is dropped for good only when its worker is lost, so a timeout or a failed computation does not
condemn a live one.  A shard with no working replica raises :class:`ShardError`, never a partial answer;
a closed client raises :class:`ClientClosedError` before anything is sent.

What the result equals: with ``k_scope="shard"`` (the default, one round trip) each shard's selector
picks up to ``k`` of *its own* keys per query, and the merged answer is the attention over the union of
the shards' selections (up to ``n_shards * k`` keys per query: with exact ``"topk"`` a superset of the
store's top-``k``).  For position-based selectors (``"window"``) that union is exactly the single-process
selection; attending selectors (``"cluster:mode=block"``) attend over the keys of each shard's routed
clusters.  With ``k_scope="store"`` (two round trips, selectors that rank keys by score) the shards send
their candidates' scores, the client keeps each query's ``k`` best over the whole store and the shards
attend over their share: for exact ``"topk"`` this is the single-process
``sparse_attention(q, keys, values, "topk", k=k)``.  Either way the answer equals the single-process
attention over the same selected keys up to float rounding.

Example (from one process to a Dask cluster; a script that starts a LocalCluster needs the
``__main__`` guard, since its worker processes import the script)::

    from dask.distributed import Client, LocalCluster
    from sparseattn.distributed import ShardedKeyStore

    if __name__ == "__main__":
        with LocalCluster(n_workers=4, threads_per_worker=1) as cluster, Client(cluster) as client:
            store = ShardedKeyStore(client, keys, values, selector="topk")  # keys (S, E), values (S, Ev)
            out, lse = store.attend(queries, k=64)                          # (L, Ev), (L,)

Needs the optional extra ``dask`` (``pip install "sparseattn[dask]"``); sparseattn must be installed on
every worker too.

The parts: :mod:`.shard` (the worker side: :class:`Shard`, one per shard and replica), :mod:`.replicas`
(the calls to the shards: waits, health checks, retries, lost replicas), :mod:`.store` (the client side:
:class:`ShardedKeyStore`), :mod:`.checks` (argument checks shared by both sides).
"""

from __future__ import annotations

try:
    import distributed as _dd  # noqa: F401  (the optional extra: fail here with the fix, not deep inside)
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "sparseattn.distributed needs Dask's distributed scheduler, which is an optional extra: "
        "install it with  pip install 'sparseattn[dask]'  (or  pip install 'dask[distributed]>=2024.1')."
    ) from _exc

from .checks import BATCH_SIZE, SEND_ROWS
from .replicas import PING_TIMEOUT, ClientClosedError, ShardError
from .shard import Shard, ShardInfo
from .store import ShardedKeyStore

__all__ = ["BATCH_SIZE", "PING_TIMEOUT", "SEND_ROWS", "ClientClosedError", "Shard", "ShardError", "ShardInfo",
           "ShardedKeyStore"]
