"""vLLM integration tests: run in their own venv (``make test-vllm``), skipped elsewhere.

Engines start slowly (20-90 s on two cores): each module starts the few it needs once.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _has_vllm() -> bool:
    # Not `find_spec("vllm") is not None` alone: with tests/ on sys.path this very folder is a
    # namespace package named "vllm"; the real one is a regular package with an __init__.py.
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


collect_ignore_glob: list[str] = []
if not _has_vllm():
    # The main venv has no vLLM: nothing here is collected (the main suite stays fast).
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)
