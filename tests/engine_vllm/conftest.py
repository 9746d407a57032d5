"""vLLM engine tests: run in their own venv (``make test-vllm``), skipped elsewhere.

Engines run in the test's process (``engine_util.make_llm``: about 5 s to start on two cores,
against 30 for vLLM's engine-core and worker processes, which the modules testing across process
boundaries still start); each module starts the few it needs once. The
plugin's pure parts (ledger, paged compaction, layouts, settings) are tested in the main suite
(``tests/test_vllm_*.py``), without vLLM. This folder is not named ``vllm``: pytest puts test
folders on ``sys.path``, and a folder of that name would shadow the package.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("vllm") is None:
    # The main venv has no vLLM: nothing here is collected (the main suite stays fast).
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if os.environ.get("PYTEST_XDIST_WORKER") and importlib.util.find_spec("vllm") is not None:
    # Under pytest-xdist (``make test-vllm``: a worker per core) each worker, and every vLLM process
    # it starts, runs one thread: vLLM's own binding would give each the machine's every core, and
    # OpenMP threads of two workers spinning on the same cores ran the suite several times slower.
    import torch

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/engine_vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)
