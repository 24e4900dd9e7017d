"""A growing key/value cache for long-context decoding, with an incremental index so each step reads a few
per cent of it.

Layout per kv head (slots of one contiguous array, each slot holding one key, its value and its position)::

    [ sinks | segment 0 | ... | segment s | open segment | tail ]
      exact    routed: clustered once, keys    routed,         exact: the newest keys (>= window
               stored in cluster order         re-clustered    of them), not yet clustered
                                               as it grows

* ``append`` writes new keys into the tail.  When the tail holds ``segment + window`` keys beyond the
  closed segments, the oldest ``segment`` of them are clustered on their own (spherical k-means on the
  segment's centred keys, about ``cluster_size`` keys per cluster), reordered in place into cluster
  order, and their routing vectors (member means) join the head's routed set for good.  In between, the
  *open segment* (the next, partly filled segment) is re-clustered each time the tail gains
  ``open_step`` keys, so the exact tail stays below ``open_step + window`` keys.  Nothing outside the
  open segment is ever clustered twice.
* ``attend`` scores a query against every routing vector of its kv head at once, takes the ``n_probe``
  best clusters, and computes one online softmax over sinks + tail (exact) + the chosen clusters: every
  key counted exactly once, since the routed segments and the exact part hold disjoint positions.  The
  whole step (all heads, all query tokens) is one Numba call.
* A multi-token ``attend`` (a prompt attended through the cache) is strictly causal: a row whose position
  lies inside a clustered segment (or a Quest page) that also holds later keys reads that segment's
  visible keys exactly and routes over the earlier segments only, since the segment's clusters, means and
  codes (or the page's bounds) were made with keys the row may not see.  Such rows are planned in blocks of
  their own; a decode step's row is the newest position and never meets one.

Other selectors share the storage: ``"pages"`` (Quest: per page of ``page_size`` keys the element-wise
min and max, updated on append; the ``n_probe`` pages of largest bound ``sum_e max(q_e min_e, q_e max_e)``
are attended), ``"window"`` (sinks + recent window only), ``"topk"`` (exact top-k over the whole cache:
the accuracy reference, reads everything) and ``"dense"`` (every key: exact attention).

Index selectors (a spec string such as ``"faiss-hnsw:M=16"``: any selector of
:mod:`sparseattn.selectors` that declares ``supports_add``): one selector object per kv head, built on
the keys of the first append (once it has enough keys for the backend; until then every key is
attended exactly) and grown with ``add()`` on every later append, never rebuilt per call.  Each query
attends the sinks and the newest ``window`` keys exactly plus the selector's top-``k`` (``attend(k=...)``)
among the other keys it may see (causal, not evicted): candidates are fetched with a margin, filtered by
position and re-ranked exactly, and the search is widened when the filter leaves fewer than ``k``.  Evicted
keys stay in the backend index (FAISS graphs cannot delete) but are filtered out; the index is rebuilt
from the live keys once the evicted ones outnumber them (amortised, at most once per ``max_keys``
evictions).  An IVF index keeps the lists it was trained on at its first build (``nlist=None``: about
``4 sqrt(S)`` for the S keys of the first append), so append the prompt first or set ``nlist``.

Estimation zone (``selector="cluster"``, ``estimate=N``): the ``N`` clusters ranked right after the
``n_probe`` routed ones are not read but *estimated* from statistics kept per cluster when it is made
(key count ``n_c``, member mean key ``μ_c`` = its routing vector, member mean value ``v̄_c``): the cluster
enters the online softmax as one pseudo-key of score ``scale·q·μ_c + log n_c`` and value ``v̄_c``, i.e.
``n_c·exp(scale·q·μ_c)`` stands for ``Σ_j exp(scale·q·k_j)``.  By Jensen's inequality this is at most
the true sum (exp of the mean under-estimates the mean of exp), so the estimate is biased low, least for
tight clusters.  Clusters holding a key the row may not see (a later position, or an evicted one) are
never estimated.  Clusters beyond ``n_probe + N`` are ignored, as before.

Mass-driven budget (``selector="cluster"``, ``top_p=p``): instead of a fixed ``n_probe``, each query
reads clusters in order of estimated mass until the estimated mass read m_in - the exact part's true mass
plus the estimates of the clusters read - reaches ``p`` of ``m_in + 1.1 m_out`` (m_out: the estimated mass
left unread, counted 10 % larger as a margin for the estimate's error), with at least ``top_p_min_keys``
routed keys, and stops before a cluster that would take the routed keys past ``top_p_max_keys`` (default:
no cap; a cap that binds is counted in ``stats["top_p_capped"]``).  A cluster's estimated mass is second
order, as in the prefill walk (:func:`sparseattn.index.routing.mass_routes`): ``n_c exp(scale q.mu_c +
g)``, with g the spread term of the cluster's mean per-dimension key variance (continued sub-linearly past
``log n_c`` and never above ``|scale| |q|`` times its largest member distance to the mean), since the
first-order ``n_c exp(scale q.mu_c)`` under-states spread-out clusters (Jensen) and ends the walk early.
A peaky query reads few clusters, a flat one many; ``stats["keys_read_per_query"]`` reports it.
``estimate=N`` then estimates the ``N`` clusters after the last one read.

Memory cap (``max_keys``): at most ``max_keys`` keys stay attendable; the ``sinks`` first positions and
the newest ``window`` ones are always kept.  ``policy="streaming"`` (StreamingLLM) evicts the oldest
other keys; ``policy="h2o"`` (Heavy-Hitter Oracle, Zhang et al. 2023) keeps, besides sinks and window,
the keys with the largest *accumulated attention weight*: per kv head, every ``attend`` adds to each key
read the softmax weight it got from each query row (all query heads of the group, all tokens).  With a
sparse selector only the keys actually read get weight (an unread or merely estimated key gets none),
so the statistics follow the selector's view of attention, not the exact one.  Keys never attended
weigh 0, and ties evict the oldest first (a prompt appended before any ``attend`` is capped like
streaming).  Both policies share one eviction mechanism: an evicted key's slot gets the position
``EVICTED`` (after every query), so the kernel's causal mask hides it from every selector at once, a
cluster holding it is no longer estimated (and routed clusters never read it), and its storage is freed
by a compaction once ``segment`` keys have been evicted since the last one (clusters that lost members
get their statistics recomputed from the survivors and may be estimated again).  Slots held stay below
``max_keys + segment`` per kv head for streaming; under h2o different kv heads evict different
positions, so each clustered segment keeps as many slots as its fullest head needs (the others pad with
evicted slots, never read as keys).  Index selectors keep their evicted keys in the backend index until
the rebuild described above.

The parts (each in its own module; the data path of a step goes down this list):

* :mod:`.store` -- :class:`SlotStore`: slots, keys and values in the storage dtype, positions, growth,
  compaction;
* :mod:`.routing` -- the routing strategies behind one interface (:class:`Routing`: ``cluster``,
  ``pages``, ``window``, ``topk``, ``dense``, index selectors), each declaring what it supports;
* :mod:`.eviction` -- the ``streaming`` and ``h2o`` memory-cap policies;
* :mod:`.plan` -- :class:`StepPlan`: a strategy's choice as the ranges and estimates the decode kernel
  (:mod:`sparseattn.kernels.decode`) reads, and the kernel call;
* :mod:`.options` -- :class:`Retention`, :class:`Layout`, :class:`Budget`: the grouped options;
* :mod:`.kvcache` -- :class:`KVCache`, the façade (validation, the lock, counters).
"""

from .config import CacheConfig
from .eviction import EvictionPolicy, H2OPolicy, StreamingPolicy
from .kvcache import KVCache
from .options import Budget, Layout, Retention, group_options
from .plan import PARALLEL_MIN_KEYS, StepPlan, StepResult, run_plan
from .routing import Routing, register_routing, routing_classes
from .store import SlotStore

__all__ = ["PARALLEL_MIN_KEYS", "Budget", "CacheConfig", "EvictionPolicy", "H2OPolicy", "KVCache", "Layout", "Retention", "Routing", "SlotStore",
           "StepPlan", "StepResult", "StreamingPolicy", "group_options", "register_routing", "routing_classes", "run_plan"]
