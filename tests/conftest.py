"""Shared test configuration: the hypothesis profile and fixtures (tensor helpers: helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvpolicy",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("kvpolicy")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # ``make test`` runs a pytest-xdist worker per core: each worker, and every command it starts,
    # runs one intra-op thread (two workers of the machine's every thread each ran slower).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine run ~10x faster on one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
