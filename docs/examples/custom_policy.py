"""Compose a new policy from built-in stages, as data, and validate it."""

import torch
import yaml

import kvpolicy

POLICY = """
name: snapkv-range
description: SnapKV-style greedy attention, with an eighth of the budget kept for large-Range values.
schedule: {budget: 512, recent: 32, interval: 32, window: 32}
scorer: {type: attention, pooling: max, kernel: 7}
reservations:
  - {type: sinks, n: 4}
  - type: top_scores
    scorer: {type: value_magnitude, metric: range}
    n: 0.125            # a fraction of the budget: 64 slots, sinks included
selector: {type: greedy}
"""

policy = kvpolicy.load_policy(yaml.safe_load(POLICY))
print(policy.to_yaml())

keys, values = torch.randn(1, 2, 900, 32), torch.randn(1, 2, 900, 32)
queries = torch.randn(1, 8, 32, 32)
kept = policy.select(keys, values, queries)
assert kept.shape == (1, 2, 512)

# Bad settings fail at load, before any tensor work, naming the field:
try:
    kvpolicy.load_policy(yaml.safe_load(POLICY), budget=16)
except kvpolicy.PolicyError as err:
    print(err)
