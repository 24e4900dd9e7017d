"""The sharded key store against a real two-process Dask cluster, compared with the single-process answer."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import sparseattn as sa

S, E, L = 8192, 32, 200


def test_import_error_names_the_extra() -> None:
    """Without Dask, importing the module fails with a message naming the extra (run with dask blocked)."""
    code = ("import sys; sys.modules['distributed'] = None; sys.modules['dask'] = None\n"
            "import sparseattn\n"
            "try:\n    import sparseattn.distributed\nexcept ImportError as e:\n    print('MSG', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "MSG" in res.stdout, res.stderr
    assert "sparseattn[dask]" in res.stdout


def test_import_sparseattn_does_not_import_dask() -> None:
    code = "import sys, sparseattn; print('dask' in sys.modules, 'distributed' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.split() == ["False", "False"], res.stderr


distributed = pytest.importorskip("distributed")  # CI installs the extra; skipped only where it is missing
from sparseattn.distributed import ClientClosedError, ShardedKeyStore, ShardError  # noqa: E402


def bounded(fn, seconds: float = 60.0):
    """fn() run in a thread and awaited at most ``seconds``: a call that hangs fails the test instead of CI."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test thread below
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"the call did not return within {seconds} s (it hangs)")
    if "error" in box:
        raise box["error"]
    return box["value"]


_BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_distributed.py")
_spec = importlib.util.spec_from_file_location("bench_distributed", _BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("argv, flag", [
    (["--chunk", "0"], "--chunk"), (["--k", "0"], "--k"), (["--k", "x"], "--k"), (["--repeats", "-1"], "--repeats"),
    (["--sizes", ""], "--sizes"), (["--workers", "1,,2"], "--workers"), (["--batches", "0"], "--batches"),
    (["--memory-limit", "0"], "--memory-limit"), (["--selector", "nope"], "--selector"),
    (["--role", "baseline"], "--n"),
])
def test_bench_flags_refused_in_one_line(argv, flag, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err


def test_bench_quick_keeps_explicit_flags(monkeypatch, tmp_path) -> None:
    """--quick only fills the flags not given: explicit --sizes/--workers/--batches/--repeats win."""
    calls: list = []
    monkeypatch.setattr(bench, "bench_size", lambda n, w, b, r, *rest: calls.append((n, w, b, r)) or [])
    monkeypatch.setattr(bench, "bench_memory", lambda *args: calls.append(("memory", *args[:3])) or {})
    monkeypatch.setattr(bench, "scaling_model", lambda rows: {})
    monkeypatch.setattr(bench, "write_markdown", lambda result, path: path.write_text(""))
    out = str(tmp_path / "d.json")
    bench.main(["--quick", "--sizes", "1000,2000", "--workers", "3", "--batches", "7", "--repeats", "5",
                "--memory-limit", "0.25", "--out", out])
    assert calls == [(1000, [3], [7], 5), (2000, [3], [7], 5), ("memory", 1 << 18, 4, int(0.25 * 2**30))]
    calls.clear()
    bench.main(["--quick", "--skip-memory", "--out", out])
    assert calls == [(1 << 18, [1, 2], [256], 2)]


def _warm_kernels() -> None:
    """Compile (or load from Numba's cache) every kernel the tests use, here first: the workers then load
    them from the on-disk cache instead of compiling the same kernels three times over on two cores."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((40, E), dtype=np.float32) for _ in range(3))
    pos = np.arange(40) * 2
    for spec in ("topk", "window:width=4", "faiss-hnsw", "cluster:mode=block,n_clusters=4,n_probe=4"):
        for causal in (False, True):
            sa.sparse_attention(q, k, v, spec, k=8, is_causal=causal, query_positions=pos, key_positions=pos,
                                return_lse=True)
    for dtype in (np.float32, np.float64):
        for causal in (False, True):
            sa.sparse_attention(*(x.astype(dtype) for x in (q, k, v)), sa.SparsePattern.full(40, 40),
                                is_causal=causal, query_positions=pos, key_positions=pos, return_lse=True)
    sa.merge_attention(np.stack([q, k]), np.stack([q[:, 0], k[:, 0]]))


@pytest.fixture(scope="module")
def cluster():
    _warm_kernels()
    # Dask's nanny writes its pre-spawn variables (OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1, ...) into this
    # process's environment; later tests' subprocesses would inherit single-threaded BLAS.  Put it back.
    env = dict(os.environ)
    cl = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                                  silence_logs=logging.CRITICAL)
    client = distributed.Client(cl)
    try:
        yield cl, client
    finally:
        client.close()
        cl.close()
        os.environ.clear()
        os.environ.update(env)


@pytest.fixture(scope="module")
def client(cluster):
    return cluster[1]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    K = rng.standard_normal((S, E), dtype=np.float32)
    V = rng.standard_normal((S, E), dtype=np.float32)
    Q = (rng.standard_normal((L, E)) * 2).astype(np.float32)
    return Q, K, V


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def dense64(Q, K, V, **kw):
    """The float64 answer over every key (the truth both float32 answers are rounded from)."""
    f = [x.astype(np.float64) for x in (Q, K, V)]
    return sa.sparse_attention(*f, sa.SparsePattern.full(Q.shape[0], K.shape[0]), return_lse=True, **kw)


def shard_union_pattern(Q, K, bounds, k):
    """The union over shards of each shard's exact top-k, as one (L, S) pattern over the whole store."""
    rows = [[] for _ in range(Q.shape[0])]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        p = sa.get_selector("topk").build(K[lo:hi]).query(Q, k)
        for i in range(Q.shape[0]):
            rows[i].extend((p.row(i) + lo).tolist())
    return sa.SparsePattern.from_rows([sorted(r) for r in rows], K.shape[0])


def test_topk_equals_single_process_union(client, data) -> None:
    Q, K, V = data
    with ShardedKeyStore(client, K, V, n_shards=3, selector="topk") as store:
        assert len(store) == S and store.n_shards == 3
        assert store.nbytes == K.nbytes + V.nbytes
        out, lse = store.attend(Q, k=16, batch_size=64)
        bounds = [s.start for s in store.shards] + [S]
    ref, ref_lse = sa.sparse_attention(Q, K, V, shard_union_pattern(Q, K, bounds, 16), return_lse=True)
    assert out.dtype == np.float32 and out.shape == (L, E) and lse.shape == (L,)
    assert rel(out, ref) <= 1e-6
    assert np.abs(lse - ref_lse).max() <= 1e-6 * np.abs(ref_lse).max()


@pytest.mark.parametrize("causal", [False, True])
def test_store_scope_topk_equals_single_process_topk(client, data, causal) -> None:
    """k_scope="store": the k best keys of the whole store, exactly sparse_attention(..., "topk", k)."""
    Q, K, V = data
    qpos = np.sort(np.random.default_rng(4).integers(0, S, L)) if causal else None
    with ShardedKeyStore(client, K, V, n_shards=3, selector="topk") as store:
        out, lse = store.attend(Q, k=16, k_scope="store", is_causal=causal, query_positions=qpos, batch_size=80)
    ref, ref_lse = sa.sparse_attention(Q, K, V, "topk", k=16, is_causal=causal, query_positions=qpos,
                                       return_lse=True)
    assert rel(out, ref) <= 1e-6
    assert np.abs(lse - ref_lse).max() <= 1e-6 * np.abs(ref_lse).max()


def test_topk_all_keys_causal_kv_cache_equals_dense(client, data) -> None:
    """k >= shard size: every visible key, so the answer is dense causal attention (decode after a cache)."""
    Q, K, V = data
    qpos = np.sort(np.random.default_rng(1).integers(0, S, L))
    kw = dict(is_causal=True, query_positions=qpos)
    with ShardedKeyStore(client, K, V, n_shards=4, selector="topk") as store:
        out, lse = store.attend(Q, k=S, **kw)
    single, _ = sa.sparse_attention(Q, K, V, sa.SparsePattern.full(L, S), return_lse=True, **kw)
    truth, truth_lse = dense64(Q, K, V, **kw)
    # Over thousands of keys float32 rounding of the reference itself is ~1e-6: the sharded answer must be
    # at least as close to the float64 truth as the single-process float32 answer (and close to it).
    assert rel(out, truth) <= max(2 * rel(single, truth), 1e-6)
    assert rel(out, single) <= 1e-5
    assert np.allclose(lse, truth_lse, rtol=1e-6, atol=1e-5)


def test_window_causal_with_position_gaps_equals_single_process(client, data) -> None:
    Q, K, V = data
    kpos = np.cumsum(np.random.default_rng(2).integers(1, 3, S))  # gaps: positions are not row numbers
    qpos = np.sort(np.random.default_rng(3).integers(0, int(kpos[-1]) + 1, L))
    kw = dict(is_causal=True, query_positions=qpos)
    spec = "window:width=48"
    with ShardedKeyStore(client, K, V, n_shards=4, selector=spec, key_positions=kpos) as store:
        out, lse = store.attend(Q, k=48, batch_size=50, **kw)
        first = np.array([s.first_position for s in store.shards])
        expected_calls = sum(int((qpos[lo:lo + 50, None] >= first[None, :]).any(axis=0).sum())
                             for lo in range(0, L, 50))
        assert store.stats["calls"] == expected_calls < 4 * 4  # early batches skip the later shards
    ref, ref_lse = sa.sparse_attention(Q, K, V, spec, k=48, key_positions=kpos, return_lse=True, **kw)
    assert rel(out, ref) <= 1e-6
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.abs(lse[finite] - ref_lse[finite]).max() <= 1e-6 * np.abs(ref_lse[finite]).max()


def test_cluster_block_all_probes_equals_dense(client, data) -> None:
    Q, K, V = data
    with ShardedKeyStore(client, K, V, selector="cluster:mode=block,n_clusters=8,n_probe=8") as store:
        out, lse = store.attend(Q)
    single, _ = sa.sparse_attention(Q, K, V, sa.SparsePattern.full(L, S), return_lse=True)
    truth, truth_lse = dense64(Q, K, V)
    assert rel(out, truth) <= max(2 * rel(single, truth), 1e-6)
    assert np.allclose(lse, truth_lse, rtol=1e-6, atol=1e-5)


def test_approximate_selector_quality(client, data) -> None:
    """faiss-hnsw per shard: at least as good as one index over everything (it sees n_shards * k keys)."""
    Q, K, V = data
    spec = "faiss-hnsw"
    with ShardedKeyStore(client, K, V, selector=spec) as store:
        out, _ = store.attend(Q, k=32)
    single = sa.sparse_attention(Q, K, V, spec, k=32)
    truth, _ = dense64(Q, K, V)
    assert rel(out, truth) <= rel(single, truth) * 1.05 + 1e-6


def test_streamed_blocks_and_worker_side_loader(client, data) -> None:
    Q, K, V = data
    kpos = np.arange(S) * 3
    ref = sa.sparse_attention(Q, K, V, "topk", k=S, key_positions=kpos, is_causal=True,
                              query_positions=np.arange(L) * 100)
    blocks = ((K[i:i + 1000], V[i:i + 1000], kpos[i:i + 1000]) for i in range(0, S, 1000))
    with ShardedKeyStore(client, blocks, n_keys=S, n_shards=3) as store:
        out, _ = store.attend(Q, k=S, is_causal=True, query_positions=np.arange(L) * 100)
    assert rel(out, ref) <= 1e-5

    def loader(start: int, stop: int):
        return K[start:stop], V[start:stop], kpos[start:stop]

    with ShardedKeyStore(client, loader, n_keys=S, block_rows=1500) as store:
        out2, _ = store.attend(Q, k=S, is_causal=True, query_positions=np.arange(L) * 100)
    assert rel(out2, ref) <= 1e-5


def test_scheduler_address_string(cluster, data) -> None:
    Q, K, V = data
    store = ShardedKeyStore(cluster[0].scheduler_address, K[:1000], V[:1000], selector="topk")
    own = store.client
    out = store.attend(Q[:10], k=1000)[0]
    store.close()
    store.close()  # idempotent
    assert own.status == "closed"
    assert rel(out, sa.scaled_dot_product_attention(Q[:10], K[:1000], V[:1000])) <= 1e-5
    with pytest.raises(RuntimeError, match="closed"):
        store.attend(Q)


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(client=3), TypeError, "client"),
    (dict(values=None), ValueError, "values"),
    (dict(n_shards=0), ValueError, "n_shards"),
    (dict(n_shards=2.0), TypeError, "n_shards"),
    (dict(replicas=3), ValueError, "replicas"),
    (dict(selector="nope"), ValueError, "nope"),
    (dict(selector=3), TypeError, "selector"),
    (dict(key_positions=np.arange(100)[::-1].copy()), ValueError, "key_positions"),
    (dict(key_positions=np.arange(99)), ValueError, "key_positions"),
    # uint64 beyond int64 would wrap negative (a late key read as the earliest): refused
    (dict(key_positions=np.arange(2**63 - 50, 2**63 + 50, dtype=np.uint64)), ValueError,
     r"key_positions must fit in int64"),
    (dict(keys=np.zeros((100, 4), np.int32)), TypeError, "keys"),
    (dict(values=np.zeros((99, 4), np.float32)), ValueError, "values"),
    (dict(keys=iter([]), values=None), ValueError, "n_keys"),
    (dict(workers=["tcp://nowhere:1"]), ValueError, "workers"),
    (dict(timeout=-1), ValueError, "timeout"),
    # g sinks per shard would be g x n_shards sinks: refused, positions named instead
    (dict(selector="window:width=8+sinks:g=4", n_shards=2), ValueError, r"sinks:positions=0;1;2;3"),
    (dict(selector="sinks", n_shards=3), ValueError, r"each shard"),
])
def test_bad_construction_arguments(client, kwargs, exc, word) -> None:
    args = dict(client=client, keys=np.zeros((100, 4), np.float32), values=np.zeros((100, 4), np.float32))
    args.update(kwargs)
    with pytest.raises(exc, match=word):
        ShardedKeyStore(args.pop("client"), args.pop("keys"), args.pop("values"), **args)


def test_sinks_by_position_across_shards_equal_single_process(client, data) -> None:
    Q, K, V = data
    spec = "window:width=8+sinks:positions=0;1;2;3"
    with ShardedKeyStore(client, K[:2000], V[:2000], n_shards=4, selector=spec) as store:
        out, _ = store.attend(Q[:5], is_causal=True, query_positions=np.full(5, 1999))
    ref = sa.sparse_attention(Q[:5], K[:2000], V[:2000], spec, is_causal=True, query_positions=np.full(5, 1999))
    np.testing.assert_allclose(out, ref[0] if isinstance(ref, tuple) else ref, rtol=1e-5, atol=1e-6)


def test_positions_spanning_int64_are_ordered_without_overflow(client) -> None:
    # np.diff of [-2**63, 2**63 - 1] overflows int64: the order check compares neighbours instead
    K = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    pos = np.array([-2**63, 2**63 - 1], np.int64)
    with ShardedKeyStore(client, K, K, key_positions=pos, selector="topk") as store:
        out, _ = store.attend(K[:1], k=2)
        assert np.isfinite(out).all()
    with pytest.raises(ValueError, match="non-decreasing"):
        ShardedKeyStore(client, K, K, key_positions=pos[::-1].copy())


def test_bad_stream_length(client) -> None:
    blocks = [(np.zeros((10, 4), np.float32), np.zeros((10, 4), np.float32))]
    with pytest.raises(ValueError, match="n_keys"):
        ShardedKeyStore(client, iter(blocks), n_keys=25)


def test_bad_query_arguments(client, data) -> None:
    Q, K, V = data
    with ShardedKeyStore(client, K[:500], V[:500]) as store:
        for call, exc, word in [
            (lambda: store.attend(Q[:, :5]), ValueError, "queries"),
            (lambda: store.attend(Q[0]), ValueError, "queries"),
            (lambda: store.attend(Q, k=0), ValueError, "k"),
            (lambda: store.attend(Q, is_causal=1), TypeError, "is_causal"),
            (lambda: store.attend(Q, query_positions=np.arange(3)), ValueError, "query_positions"),
            (lambda: store.attend(Q, query_positions=np.full(Q.shape[0], 2**63 + 5, np.uint64), is_causal=True),
             ValueError, r"query_positions must fit in int64"),
            (lambda: store.attend(Q, scale=float("nan")), ValueError, "scale"),
            (lambda: store.attend(Q, batch_size=0), ValueError, "batch_size"),
            (lambda: store.attend(Q, k_scope="global"), ValueError, "k_scope"),
        ]:
            with pytest.raises(exc, match=word):
                call()


def test_store_scope_rejects_positional_selectors(client, data) -> None:
    Q, K, V = data
    with ShardedKeyStore(client, K[:500], V[:500], selector="window:width=8") as store:
        with pytest.raises(ValueError, match="k_scope"):
            store.attend(Q, k_scope="store")


def test_shard_that_raises_gives_a_clear_error(client, data) -> None:
    Q, K, V = data
    with ShardedKeyStore(client, K[:2000], V[:2000], n_shards=2) as store:
        store.actor(1, 0).clear().result()  # shard 1 loses its state: its computation now raises
        with pytest.raises(ShardError, match=r"shard 1 .*not built"):
            store.attend(Q, k=8)


def test_overflowing_queries_refused_before_sending_then_good_calls(client, data) -> None:
    """Queries whose scores would overflow are a ValueError naming them, sent nowhere; the store stays usable."""
    Q, K, V = data
    with ShardedKeyStore(client, K[:2000], V[:2000], n_shards=2, timeout=60) as store:
        for bad in (np.full((3, E), 3e38, np.float32),  # finite, but q.k overflows float32
                    np.full((3, E), 1e39, np.float64)):  # beyond float32, the store's dtype
            calls = store.stats["calls"]
            with pytest.raises(ValueError, match="queries"):
                bounded(lambda b=bad: store.attend(b, k=8))
            assert store.stats["calls"] == calls  # refused in the client: nothing was sent
        with pytest.raises(ValueError, match="scale"):
            store.attend(Q, scale=1e300)
        for _ in range(2):
            out, lse = bounded(lambda: store.attend(Q, k=2000))  # k >= shard size: every key
        truth, truth_lse = dense64(Q, K[:2000], V[:2000])
    assert rel(out, truth) <= 1e-5
    assert np.allclose(lse, truth_lse, rtol=1e-6, atol=1e-5)
    # Huge but safe magnitudes in a float64 store are answered, not refused: scores stay ~|q| |k| ~ 1e2.
    K64, V64, Q64 = K[:1000].astype(np.float64) * 1e200, V[:1000].astype(np.float64), Q.astype(np.float64) * 1e-200
    with ShardedKeyStore(client, K64, V64, n_shards=2) as store:
        out, lse = bounded(lambda: store.attend(Q64, k=1000))
        with pytest.raises(ValueError, match="queries could overflow"):
            store.attend(np.full((3, E), 1e110), k=8)  # |q| |k| ~ 5e311: beyond float64
    truth, truth_lse = dense64(Q64, K64, V64)
    assert out.dtype == np.float64 and rel(out, truth) <= 1e-12
    assert np.allclose(lse, truth_lse, rtol=1e-12)


@pytest.mark.parametrize("replicas", [1, 2])
def test_timeout_then_good_calls(client, data, replicas) -> None:
    """A call that times out fails with ShardError, but the live replicas stay in use for later calls."""
    Q, K, V = data
    big = np.random.default_rng(5).standard_normal((6000, E)).astype(np.float32)
    with ShardedKeyStore(client, K, V, n_shards=2, replicas=replicas) as store:
        with pytest.raises(ShardError, match=r"(?s)timeout=0.001 s.*still alive"):
            bounded(lambda: store.attend(big, k=16, batch_size=6000, timeout=0.001))
        out, lse = bounded(lambda: store.attend(Q, k=S))  # waits for the abandoned call, then answers
        out2, _ = bounded(lambda: store.attend(Q, k=S, timeout=60))
    truth, truth_lse = dense64(Q, K, V)
    assert rel(out, truth) <= 1e-5 and rel(out2, truth) <= 1e-5
    assert np.allclose(lse, truth_lse, rtol=1e-6, atol=1e-5)


def test_stalled_worker_fails_over_and_is_kept(client, data, monkeypatch) -> None:
    """A stopped (not dead) worker: the call times out there and is answered by the other replica; the
    stalled replica is not dropped, so it answers when the other one stalls in turn."""
    import sparseattn.distributed.replicas as replicas

    Q, K, V = data
    monkeypatch.setattr(replicas, "PING_TIMEOUT", 1.0)
    truth, _ = dense64(Q, K[:2000], V[:2000])
    with ShardedKeyStore(client, K[:2000], V[:2000], n_shards=1, replicas=2) as store:
        bounded(lambda: store.attend(Q, k=8))
        for w in store.shards[0].workers:  # stall one replica's worker, then the other's
            pid = client.run(os.getpid, workers=[w])[w]
            os.kill(pid, signal.SIGSTOP)
            try:
                out, _ = bounded(lambda: store.attend(Q, k=2000, timeout=1.0))
            finally:
                os.kill(pid, signal.SIGCONT)
            assert rel(out, truth) <= 1e-5
        assert store.stats["retries"] >= 1
        assert sorted(bounded(store.worker_memory)) == sorted(store.shards[0].workers)  # both still in use


def test_closed_client_with_another_client_connected_raises_at_once(cluster, data) -> None:
    """The store's client closed, another client of the cluster still open: a named error, no hang."""
    Q, K, V = data
    own = distributed.Client(cluster[0].scheduler_address, set_as_default=False)
    store = ShardedKeyStore(own, K[:1000], V[:1000])
    bounded(lambda: store.attend(Q[:5], k=8))
    own.close()
    for _ in range(2):
        with pytest.raises(ClientClosedError, match="client is closed"):
            bounded(lambda: store.attend(Q[:5], k=8), 20)
    with pytest.raises(ClientClosedError, match="new ShardedKeyStore"):
        bounded(lambda: store.worker_memory(), 20)
    bounded(store.close, 20)
    with pytest.raises(ClientClosedError, match="client is closed"):
        bounded(lambda: ShardedKeyStore(own, K[:1000], V[:1000]), 20)


def test_closed_client_alone_raises_named_error() -> None:
    """The only client of a cluster (in-process workers) closed: the same named error, not a hang or dask's
    internal error."""
    rng = np.random.default_rng(6)
    K, V, Q = (rng.standard_normal((n, 8)).astype(np.float32) for n in (300, 300, 4))
    with distributed.LocalCluster(n_workers=1, processes=False, dashboard_address=":0",
                                  silence_logs=logging.CRITICAL) as cl:
        own = distributed.Client(cl, set_as_default=False)
        store = ShardedKeyStore(own, K, V)
        out = bounded(lambda: store.attend(Q, k=300))[0]
        assert rel(out, dense64(Q, K, V)[0]) <= 1e-5
        own.close()
        with pytest.raises(ClientClosedError, match="client is closed"):
            bounded(lambda: store.attend(Q, k=8), 20)
        bounded(store.close, 20)


def _kill_worker(client, address: str) -> None:
    pid = client.run(os.getpid, workers=[address])[address]
    os.kill(pid, signal.SIGKILL)


def _kill_and_wait_until_noticed(client, address: str) -> None:
    """Kill a worker and wait until the scheduler has dropped it: the death falls *between* two calls."""
    _kill_worker(client, address)
    deadline = time.monotonic() + 30
    while address in client.nthreads():
        assert time.monotonic() < deadline, f"the scheduler did not notice that {address} died"
        time.sleep(0.1)


def test_worker_killed_between_calls_retried_on_live_replica(client, data) -> None:
    Q, K, V = data
    client.wait_for_workers(2, timeout=120)
    truth, truth_lse = dense64(Q, K[:2000], V[:2000])
    with ShardedKeyStore(client, K[:2000], V[:2000], n_shards=2, replicas=2) as store:
        assert rel(bounded(lambda: store.attend(Q, k=2000))[0], truth) <= 1e-5
        _kill_and_wait_until_noticed(client, store.shards[0].workers[0])
        for _ in range(2):  # the retry, then the lost replica skipped
            out, lse = bounded(lambda: store.attend(Q, k=2000))
            assert rel(out, truth) <= 1e-5
            assert np.allclose(lse, truth_lse, rtol=1e-6, atol=1e-5)
        assert store.stats["retries"] >= 1
        survivor = store.shards[0].workers[1]
        assert list(bounded(store.worker_memory)) == [survivor]  # the lost worker is left out, no error
        assert len(bounded(store.busy_seconds)) == 2  # both shards answer from the survivor


def test_worker_killed_between_calls_without_replica_raises_shard_error(client, data) -> None:
    Q, K, V = data
    client.wait_for_workers(2, timeout=120)
    with ShardedKeyStore(client, K[:2000], V[:2000], n_shards=2) as store:
        bounded(lambda: store.attend(Q, k=8))
        _kill_and_wait_until_noticed(client, store.shards[0].workers[0])
        for _ in range(2):
            with pytest.raises(ShardError, match=r"(?s)shard 0 .*was lost.*no replica is left"):
                bounded(lambda: store.attend(Q, k=8), 30)
    bounded(store.close, 20)


def test_killed_worker_retry_on_replica_then_clear_error(client, data) -> None:
    """Runs last: it kills both workers (the nanny restarts them; nothing here waits for that)."""
    Q, K, V = data
    client.wait_for_workers(2, timeout=120)
    ref = sa.sparse_attention(Q, K[:4000], V[:4000], "topk", k=4000)
    with ShardedKeyStore(client, K[:4000], V[:4000], replicas=2, timeout=120) as store:
        victim = store.shards[0].workers[0]
        survivor = store.shards[0].workers[1]
        _kill_worker(client, victim)
        out, _ = store.attend(Q, k=4000)  # every shard is answered by its surviving replica
        assert store.stats["retries"] >= 1
    assert rel(out, ref) <= 1e-5

    with ShardedKeyStore(client, K[:4000], V[:4000], n_shards=2, workers=[survivor], timeout=120) as store:
        _kill_worker(client, survivor)
        with pytest.raises(ShardError, match=r"shard 0 .*No partial answer"):
            store.attend(Q, k=8)
