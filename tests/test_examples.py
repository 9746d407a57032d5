"""Every runnable example of the docs (docs/examples/*.py) runs as a script and passes its own checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_every_example_is_collected():
    # The docs include these files verbatim (pymdownx.snippets): each one is run below.
    assert {"select_basics.py", "custom_policy.py", "generate_with_policy.py",
            "custom_attention_module.py", "custom_loop_hf.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.strip(), "an example shows what it did"
