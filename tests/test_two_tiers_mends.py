"""Two tiers: promises an outside test found broken, each pinned by a test that failed before its fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpolicy import EvictingCache, PolicyError, load_policy
from kvpolicy.layouts.two_tier import TwoTierRows

pytestmark = pytest.mark.usefixtures("one_thread")

HKV, HQ, D = 2, 4, 16


def _policy(name: str, recall: dict[str, Any], **schedule: Any) -> Any:
    data = load_policy(name).config.to_dict()
    data["schedule"] = {**data["schedule"], "budget": 32, "recent": 8, "interval": 8, "window": 8, **schedule}
    data["recall"] = recall
    return load_policy(data)


def _layout(cache: EvictingCache, layer: int = 0) -> TwoTierRows:
    layout = cache.layers[layer].group.layout
    assert isinstance(layout, TwoTierRows)
    return layout


def _qkv(g: torch.Generator, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(b, HQ, t, D, generator=g), torch.randn(b, HKV, t, D, generator=g),
            torch.randn(b, HKV, t, D, generator=g))


@pytest.mark.parametrize("interval", [1, 3])
def test_a_padding_decode_token_does_not_recall_so_the_row_decodes_as_alone(interval):
    """Row 1 of a batch of two has a padding token (``token_valid`` False) at every fifth decode
    step. Its real tokens attend, and its recall buffer holds, exactly what they do with the row
    alone fed only its real tokens; the tier counters are the two rows' alone, summed. (A row
    recalled on its padding query whenever its count of real tokens, unchanged by the padding, was
    a multiple of the recall interval: its next real tokens attended pages chosen by padding, and
    every padding step counted recalls.) Eviction by key norm reads no query, so only the recall
    could tell the padding apart."""
    recall = {"budget": 16, "page_size": 8, "interval": interval, "scorer": {"type": "landmark", "page_size": 8}}
    policy = _policy("knorm", recall)
    batch = EvictingCache(policy, 1)
    alone = [EvictingCache(policy, 1), EvictingCache(policy, 1)]
    g = torch.Generator().manual_seed(5)
    checked = 0
    for step in range(60):
        t = 50 if step == 0 else 1
        q, k, v = _qkv(g, 2, t)
        padding = step > 0 and step % 5 == 0
        token_valid = torch.tensor([[True], [False]]) if padding else None
        out = batch.attend(0, q, k, v, token_valid)
        for r in (0, 1) if not padding else (0,):
            want = alone[r].attend(0, q[r : r + 1], k[r : r + 1], v[r : r + 1])
            torch.testing.assert_close(out[r : r + 1], want, rtol=0, atol=1e-6, msg=f"step {step} row {r}")
            ours, theirs = _layout(batch).buffer.positions[0, r], _layout(alone[r]).buffer.positions[0, 0]
            for h in range(HKV):
                assert set(ours[h][ours[h] >= 0].tolist()) == set(theirs[h][theirs[h] >= 0].tolist()), (step, r, h)
            checked += 1
    stats, rows = batch.tier_stats(), [a.tier_stats() for a in alone]
    assert stats.pages_recalled > 0 and checked > 100
    for name in ("moved_bytes", "written_bytes", "pages_recalled", "hits", "pages_dropped"):
        assert getattr(stats, name) == sum(getattr(s, name) for s in rows), name


@pytest.mark.parametrize("scorer", ["quest", "landmark"])
def test_a_recall_scorer_page_size_other_than_the_recalls_is_refused_not_ignored(scorer):
    """The slow tier's pages are ``recall.page_size`` tokens whatever the recall scorer's own
    ``page_size`` says: ``recall: {page_size: 8, scorer: {type: quest, page_size: 32}}`` loaded and
    recalled pages of 8, the 32 silently ignored. It is refused, naming both fields; a scorer that
    does not name its page size takes the recall's, so the policy's file says what it runs and
    reloads as it is."""
    spec = load_policy("snapkv").config.to_dict()
    spec["schedule"] = {**spec["schedule"], "budget": 64, "recent": 8, "interval": 32, "window": 8}
    spec["recall"] = {"budget": 32, "page_size": 8, "scorer": {"type": scorer, "page_size": 32}}
    with pytest.raises(PolicyError, match=r"recall\.scorer\.page_size 32 .*recall\.page_size 8"):
        load_policy(spec)
    spec["recall"] = {"budget": 32, "page_size": 16, "scorer": {"type": scorer}}  # landmark's default is 8, quest's 16
    policy = load_policy(spec)
    assert policy.config.recall is not None and policy.config.recall.scorer.page_size == 16
    described = policy.config.to_dict()
    assert described["recall"]["scorer"]["page_size"] == 16
    assert load_policy(described).config.recall == policy.config.recall
    # the same size written out loads as it did
    spec["recall"] = {"budget": 32, "page_size": 16, "scorer": {"type": scorer, "page_size": 16}}
    assert load_policy(spec).config.recall == policy.config.recall


def test_step_hands_the_recall_buffer_first_then_the_kept_slots():
    """``EvictingCache.step`` under a recall block, as its docs now say: once a recall has filled
    the buffer, ``[B, Hkv, Rb + L]``, the ``Rb`` recall-buffer slots first (``valid`` per KV head:
    the recalled pages' slots), then the kept slots (``slot < counts[r]``); attention of the step's
    query over them is ``attend``'s. (The docs said ``valid`` is ``slot < counts[r]`` over ``L``
    slots, which holds only until the first recall.)"""
    recall = {"budget": 16, "page_size": 8, "scorer": {"type": "landmark", "page_size": 8}}
    policy = _policy("snapkv", recall)
    stepped, attending = EvictingCache(policy, 1), EvictingCache(policy, 1)
    g = torch.Generator().manual_seed(1)
    widened = 0
    for step in range(30):
        q, k, v = _qkv(g, 2, 50 if step == 0 else 1)
        keys, values, valid = stepped.step(0, k, v, q)
        want = attending.attend(0, q, k, v)
        counts = torch.tensor(stepped.layers[0].counts)
        held = stepped.layers[0].length
        rb = keys.shape[2] - held
        assert rb in (0, 16)
        kept = torch.arange(held)[None, None, :] < counts[:, None, None]
        assert torch.equal(valid[:, :, rb:], kept.expand(-1, HKV, -1))
        if rb:
            buffer = _layout(stepped).buffer
            assert torch.equal(valid[:, :, :rb], buffer.positions[0] >= 0)
            assert torch.equal(keys[:, :, :rb], buffer.keys[0]) and torch.equal(values[:, :, :rb], buffer.values[0])
            widened += 1
        if step:
            group = HQ // HKV
            logits = (q @ keys.repeat_interleave(group, 1).transpose(-1, -2)) * D**-0.5
            logits = logits.masked_fill(~valid.repeat_interleave(group, 1)[:, :, None, :], float("-inf"))
            out = logits.softmax(-1) @ values.repeat_interleave(group, 1)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    assert widened > 10
