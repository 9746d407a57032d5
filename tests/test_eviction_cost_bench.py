"""``benchmarks/eviction_cost.py`` times one vLLM-shaped eviction per policy beside ``snapkv``'s. A
tiny run: the numbers are not checked, only that each policy asked for gets its row (``snapkv``
first, as the base of the ratios), stateful and model-reading ones included."""

from __future__ import annotations

import torch
from helpers import load_benchmark

eviction_cost = load_benchmark("eviction_cost")


def test_each_policy_gets_a_row_beside_snapkv(capsys):
    threads = torch.get_num_threads()
    try:
        eviction_cost.main(["cam", "lagkv", "expected-attention", "--requests", "2",
                            "--layers", "2", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|")[1].strip() for line in lines[2:]]
    assert rows == ["snapkv", "cam", "lagkv", "expected-attention"]
    assert lines[2].rstrip().endswith("| 1.00x |")
    assert all(line.split("|")[2].strip().startswith("4 x ") for line in lines[2:])  # 2 requests x 2 layers
