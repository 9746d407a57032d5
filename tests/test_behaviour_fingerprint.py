"""``benchmarks/behaviour_fingerprint.py`` (the before/after check of a refactor) runs the built-ins
whose settings its small schedule must adapt: a two-tier policy with pages larger than its
interval (``arkvale``, pages of 32), one that keeps the whole prompt (``random-prompt``), and a
plain one. It stopped at ``arkvale`` once, unnoticed, while every refactor relied on it."""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark

pytest.importorskip("transformers")
behaviour_fingerprint = load_benchmark("behaviour_fingerprint")


def test_the_adapted_built_ins_run_and_evict():
    threads = torch.get_num_threads()
    try:
        out = behaviour_fingerprint.fingerprint(["arkvale", "random-prompt", "snapkv"])
    finally:
        torch.set_num_threads(threads)  # the fingerprint runs on one thread
    for name in ("arkvale", "random-prompt", "snapkv"):
        rec = out[(name, 1)]
        assert rec["tokens"].shape[-1] > 28
        assert all(evictions > 0 for evictions, *_ in rec["stats"]), name  # the small schedule evicts
        assert isinstance(out[(name, "step-api")], torch.Tensor)
    assert behaviour_fingerprint.same(out, out)
