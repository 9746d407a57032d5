"""kvpolicy.vllm's paged gather and compaction on tensors laid out as vLLM's caches: no vLLM needed.

The reference writer below places each key and value element by the address formula of the CPU
backend's layout (one element at a time), independently of the views ``kvpolicy.vllm.paged``
takes; the engine tests (tests/engine_vllm/test_config.py) check the same layout against vLLM's
own cache writer.
"""

from __future__ import annotations

import torch

from kvpolicy.vllm.paged import compact, gather_slots, slot_address


def write_cpu_layout(cache: torch.Tensor, slot: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store ``key``, ``value`` ``[Hkv, D]`` at global slot ``slot`` of a ``[blocks, Hkv, bs, 2 * D]``
    cache: per block and head, the keys transposed (element d of offset o at ``d * bs + o``), then
    the values (``bs * D + o * D + d``)."""
    _, h, bs, d2 = cache.shape
    d = d2 // 2
    block, off = divmod(slot, bs)
    flat = cache[block].view(h, bs * d2)
    for head in range(h):
        for i in range(d):
            flat[head, i * bs + off] = key[head, i]
            flat[head, bs * d + off * d + i] = value[head, i]


def _filled(nb=8, h=2, bs=4, d=3, tokens=10, table=(6, 2, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(nb, h, bs, 2 * d, generator=g)  # garbage in unused slots
    keys, values = torch.randn(tokens, h, d, generator=g), torch.randn(tokens, h, d, generator=g)
    for t in range(tokens):
        write_cpu_layout(cache, table[t // bs] * bs + t % bs, keys[t], values[t])
    return cache, keys, values, torch.tensor([table])


def test_slot_address():
    blocks, offs = slot_address(torch.tensor([[5, 1, 3], [0, 2, 7]]), 7, 3)
    assert blocks.tolist() == [[5, 5, 5, 1, 1, 1, 3], [0, 0, 0, 2, 2, 2, 7]]
    assert offs.tolist() == [[0, 1, 2, 0, 1, 2, 0]] * 2


def test_gather_reads_what_the_cache_holds():
    cache, keys, values, table = _filled()
    blocks, offs = slot_address(table, 10, 4)
    k, v = gather_slots(cache, blocks, offs)
    assert k.shape == (1, 2, 10, 3)
    assert torch.equal(k[0], keys.transpose(0, 1)) and torch.equal(v[0], values.transpose(0, 1))


def test_compaction_moves_each_heads_kept_slots_to_the_front_in_order():
    bs, h, d, t = 4, 2, 3, 10
    cache, keys, values, table = _filled(bs=bs, h=h, d=d, tokens=t)
    other = torch.tensor([1, 3, 7])
    untouched = cache[other].clone()
    kept = torch.tensor([[0, 2, 3, 5, 8, 9], [1, 4, 5, 6, 7, 9]])  # per head, ascending
    blocks, offs = slot_address(table, t, bs)
    gathered = gather_slots(cache, blocks, offs)
    compact([cache], table, [gathered], kept[None, None], bs)
    k2, v2 = gather_slots(cache, *slot_address(table, 6, bs))
    for head in range(h):
        assert torch.equal(k2[0, head], keys[kept[head], head])
        assert torch.equal(v2[0, head], values[kept[head], head])
    assert torch.equal(cache[other], untouched)  # blocks outside the table are not written


def test_compaction_of_several_rows_and_layers_at_once():
    bs, h, d, t, k = 4, 2, 3, 12, 5
    tables = torch.tensor([[0, 5, 2], [7, 3, 6]])
    layers, truth = [], []
    for layer in range(3):
        g = torch.Generator().manual_seed(layer)
        cache = torch.randn(8, h, bs, 2 * d, generator=g)
        rows = []
        for r in range(2):
            keys, values = torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g)
            for s in range(t):
                write_cpu_layout(cache, int(tables[r, s // bs]) * bs + s % bs, keys[s], values[s])
            rows.append((keys, values))
        layers.append(cache)
        truth.append(rows)
    g = torch.Generator().manual_seed(9)
    kept = torch.rand(3, 2, h, t, generator=g).argsort(-1)[..., :k].sort(-1).values  # [Lyr, R, Hkv, K]
    blocks, offs = slot_address(tables, t, bs)
    gathered = [gather_slots(c, blocks, offs) for c in layers]
    compact(layers, tables, gathered, kept, bs)
    for layer, cache in enumerate(layers):
        k2, v2 = gather_slots(cache, *slot_address(tables, k, bs))
        for r in range(2):
            keys, values = truth[layer][r]
            for head in range(h):
                assert torch.equal(k2[r, head], keys[kept[layer, r, head], head])
                assert torch.equal(v2[r, head], values[kept[layer, r, head], head])
