"""Shared fixtures: seeded generators (never a global seed) and the hypothesis profile for CI."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Numba compiles on first use: a per-example deadline would flag compilation, not slowness.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Tolerances per computation dtype, used by tests that compare against float64 or torch oracles.
TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


def make_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)
