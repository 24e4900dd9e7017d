"""The recall curves of benchmarks/study_block_routing.py against a brute-force count per query."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from sparseattn.index.cluster import ClusterIndex

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "study_block_routing.py")
_spec = importlib.util.spec_from_file_location("study_block_routing", _PATH)
sbr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sbr)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(12, 8)) * 3.0
    keys = (centres[rng.integers(0, 12, 900)] + rng.normal(size=(900, 8))).astype(np.float32)
    return keys, rng.normal(size=(20, 8)).astype(np.float32) * 2.0


def test_curves_match_a_direct_count_of_the_true_top64_in_the_routed_clusters() -> None:
    keys, queries = _data()
    res = sbr.group_curves(keys, queries, 1)
    C = res["C"]
    assert C == 30  # round(sqrt(900))
    index = ClusterIndex(n_clusters=C).build(keys)  # same seed and data: the same clusters
    members = [set(index.perm_[index.cluster_ptr_[c]:index.cluster_ptr_[c + 1]].tolist()) for c in range(C)]
    centred = keys[index.perm_].astype(np.float64) - index.mean_
    mu = np.array([centred[index.cluster_ptr_[c]:index.cluster_ptr_[c + 1]].mean(axis=0) for c in range(C)])
    q = queries.astype(np.float64)
    top = [set(np.argsort(-(keys.astype(np.float64) @ row))[:64].tolist()) for row in q]
    curve = res["rules"]["mean"]
    for P in (1, 3, len(curve["recall"])):
        found, read = [], []
        for row, t in zip(q, top, strict=True):
            chosen = np.argsort(-(mu @ row), kind="stable")[:P]
            keys_in = set().union(*(members[c] for c in chosen))
            found.append(len(t & keys_in) / 64)
            read.append(len(keys_in))
        assert abs(curve["recall"][P - 1] - np.mean(found)) < 1e-4
        assert abs(curve["keys"][P - 1] - np.mean(read)) < 0.05 + 1e-9


def test_oracle_bounds_every_rule_and_curves_rise() -> None:
    keys, queries = _data(1)
    res = sbr.group_curves(keys, queries, 2)
    oracle = res["rules"]["oracle"]["recall"]
    for name, curve in res["rules"].items():
        r = np.array(curve["recall"])
        assert np.all(np.diff(r) >= -1e-12) and np.all(np.diff(curve["keys"]) > 0), name
        n = min(len(r), len(oracle))
        assert np.all(r[:n] <= np.array(oracle[:n]) + 1e-9), name  # no ordering of these clusters finds more
        hit = sbr.first_reaching(curve, 0.5)
        assert hit is None or r[hit[0] - 1] >= 0.5 and (hit[0] == 1 or r[hit[0] - 2] < 0.5)
