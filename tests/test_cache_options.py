"""KVCache's grouped options (Retention, Layout, Budget), group_options, and the deprecated flat keywords."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from sparseattn import Budget, KVCache, Layout, Retention
from sparseattn.cache import group_options

H, E = 2, 16


def _kv(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((H, n, E)).astype(np.float32), rng.standard_normal((H, n, E)).astype(np.float32)


def test_grouped_and_deprecated_flat_keywords_build_the_same_cache() -> None:
    k, v = _kv(700)
    q = np.random.default_rng(1).standard_normal((H, 3, E)).astype(np.float32)
    grouped = KVCache(H, E, selector="cluster", retention=Retention(sinks=2, window=8, max_keys=500),
                      layout=Layout(segment=128, cluster_size=16, seed=3), budget=Budget(n_probe=3, estimate=2))
    with pytest.warns(DeprecationWarning) as record:
        flat = KVCache(H, E, selector="cluster", sinks=2, window=8, max_keys=500, segment=128, cluster_size=16,
                       seed=3, n_probe=3, estimate=2)
    messages = " ".join(str(w.message) for w in record)
    for hint in ("retention=Retention(sinks=2, window=8, max_keys=500)",
                 "layout=Layout(segment=128, cluster_size=16, seed=3)", "budget=Budget(n_probe=3, estimate=2)"):
        assert hint in messages
    for c in (grouped, flat):
        c.append(k, v)
    np.testing.assert_array_equal(grouped.attend(q), flat.attend(q))  # same options, same arithmetic
    for name, value in (("sinks", 2), ("window", 8), ("max_keys", 500), ("segment", 128), ("cluster_size", 16),
                        ("seed", 3), ("n_probe", 3), ("estimate", 2), ("policy", "streaming")):
        assert getattr(grouped, name) == value == getattr(flat, name)


def test_defaults_are_the_groups_defaults() -> None:
    c = KVCache(H, E)
    for group in (Retention(), Layout(), Budget()):
        for f in dataclasses.fields(group):
            want = getattr(group, f.name)
            if want is not None:
                assert getattr(c, f.name) == want, f.name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grouped spelling never warns
        KVCache(H, E, retention=Retention(), layout=Layout(), budget=Budget())


def test_group_options_gathers_flat_settings_kept_as_data() -> None:
    got = group_options({"selector": "cluster", "n_probe": 64, "window": 8}, segment=256, dtype=np.float16)
    assert got == {"selector": "cluster", "dtype": np.float16, "budget": Budget(n_probe=64),
                   "retention": Retention(window=8), "layout": Layout(segment=256)}
    assert group_options({"selector": "window"}) == {"selector": "window"}
    assert group_options() == {}
    assert group_options({"segment": 64}, segment=128) == {"layout": Layout(segment=128)}  # keywords win
    with pytest.raises(ValueError, match="segment inside layout=Layout"):
        group_options({"layout": Layout(), "segment": 64})
    with pytest.raises(TypeError, match="options must be a dict"):
        group_options([("segment", 64)])  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(segmnet=64), TypeError, "unexpected keyword argument 'segmnet'"),
    (dict(layout={"segment": 64}), TypeError, "layout must be a sparseattn.Layout"),
    (dict(budget=Layout()), TypeError, "budget must be a sparseattn.Budget"),
    (dict(retention=Retention(), window=8), ValueError, "window inside retention=Retention"),
    (dict(layout=Layout(segment=100, page_size=16)), ValueError, "multiple of page_size"),
    (dict(retention=Retention(policy="lru")), ValueError, "policy must be one of"),
    (dict(budget=Budget(top_p=1.5), selector="cluster"), ValueError, "top_p must be"),
    (dict(budget=Budget(n_probe=0), selector="cluster"), ValueError, "n_probe"),
    (dict(budget=Budget(estimate=4)), ValueError, "estimate applies to selector='cluster'"),
])
def test_bad_options_are_refused_naming_them(kwargs: dict, error: type, match: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(error, match=match):
            KVCache(H, E, **kwargs)


def test_groups_are_frozen_values() -> None:
    b = Budget(n_probe=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.n_probe = 5  # type: ignore[misc]
    assert b == Budget(n_probe=4) and hash(b) == hash(Budget(n_probe=4))
    assert dataclasses.replace(b, estimate=2) == Budget(n_probe=4, estimate=2)
