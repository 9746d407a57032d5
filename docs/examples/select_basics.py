"""Load a built-in policy and run one eviction over random tensors."""

import torch

import kvpolicy

policy = kvpolicy.load_policy("vase-attnv", budget=256)  # any schedule field can be overridden
print(policy)

B, Hkv, Hq, N, W, D = 2, 4, 16, 1000, 64, 64  # GQA: 4 query heads share each KV head
keys = torch.randn(B, Hkv, N, D)
values = torch.randn(B, Hkv, N, D)
queries = torch.randn(B, Hq, W, D)  # the window of recent post-RoPE queries

kept = policy.select(keys, values, queries)  # a pure function: the same slots every call
print(kept.shape)  # torch.Size([2, 4, 256]): ascending slot indices per row and KV head

# The recent buffer (last 64 slots) and the 4 attention sinks are always kept.
assert kept[0, 0, -64:].tolist() == list(range(N - 64, N))
assert kept[0, 0, :4].tolist() == [0, 1, 2, 3]
