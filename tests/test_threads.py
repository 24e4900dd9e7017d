"""The thread context manager sets and restores Numba, BLAS and dense worker counts."""

from __future__ import annotations

import numba
import pytest

import sparseattn as sa


def test_threads_sets_and_restores_even_on_error():
    before = numba.get_num_threads()
    with sa.threads(1):
        assert numba.get_num_threads() == 1
        assert sa.get_num_threads() == 1
    assert numba.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"), sa.threads(1):
        raise RuntimeError("boom")
    assert numba.get_num_threads() == before
    assert sa.get_num_threads() == before


def test_threads_restores_faiss_threads():
    faiss = pytest.importorskip("faiss")
    before = faiss.omp_get_max_threads()
    with sa.threads(1):
        assert faiss.omp_get_max_threads() == 1
    assert faiss.omp_get_max_threads() == before


def test_threads_rejects_bad_counts():
    with pytest.raises(ValueError, match="n must be >= 1"), sa.threads(0):
        pass
    with pytest.raises(TypeError, match="n must be an integer"), sa.threads(1.5):
        pass
    with pytest.raises(ValueError, match="exceeds the"), sa.threads(numba.config.NUMBA_NUM_THREADS + 1):
        pass


def test_threads_is_the_module_and_calling_it_enters_the_block():
    import sys
    import types

    import sparseattn.threads as threads_module

    assert isinstance(sa.threads, types.ModuleType)
    assert sa.threads is threads_module is sys.modules["sparseattn.threads"]
    outer = sa.get_num_threads()
    with sa.threads(1) as n:
        assert n == 1 and threads_module.get_num_threads() == 1
    assert sa.get_num_threads() == outer
