"""The runnable examples for custom decoding loops run as scripts and pass their own checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


@pytest.mark.parametrize("script", ["custom_attention_module.py", "custom_loop_hf.py"])
def test_example_runs(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "KV memory" in res.stdout
