"""``attend_split``: one decode query over two sets of slots equals attention over them joined."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.attend import attend, attend_split


def _joined(q, first, second, scaling):
    k = torch.cat([first[0], second[0]], dim=2)
    v = torch.cat([first[1], second[1]], dim=2)
    b, hkv = k.shape[:2]
    valid = [torch.ones(b, hkv, part[0].shape[2], dtype=torch.bool) if part[2] is None
             else part[2].expand(b, hkv, -1) for part in (first, second)]
    return attend(q, k, v, scaling=scaling, mask=torch.cat(valid, dim=-1)[:, :, None, :])


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 3), hkv=st.integers(1, 3), g=st.integers(1, 3), l1=st.integers(1, 9), l2=st.integers(1, 9),
    masked=st.sampled_from(["none", "first", "second", "both"]), seed=st.integers(0, 2**16),
)
def test_attend_split_is_attention_over_both_sets(b, hkv, g, l1, l2, masked, seed):
    gen = torch.Generator().manual_seed(seed)
    d = 8
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    parts = []
    for length, own in ((l1, masked in ("first", "both")), (l2, masked in ("second", "both"))):
        valid = None
        if own:
            valid = torch.rand(b, hkv, length, generator=gen) < 0.6
            valid[..., 0] = True  # every row keeps a slot in each set
        parts.append((torch.randn(b, hkv, length, d, generator=gen) * 3, torch.randn(b, hkv, length, d, generator=gen),
                      valid))
    out = attend_split(q, parts[0], parts[1], scaling=0.3)
    torch.testing.assert_close(out, _joined(q, parts[0], parts[1], 0.3), atol=1e-5, rtol=1e-5)


def test_a_set_with_no_valid_slot_is_left_out_entirely():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=gen)
    first = (torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen),
             torch.zeros(2, 2, 5, dtype=torch.bool))
    second = (torch.randn(2, 2, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen), None)
    want = attend(q, second[0], second[1])
    torch.testing.assert_close(attend_split(q, first, second), want, atol=1e-6, rtol=1e-5)


def test_low_precision_inputs_come_back_in_their_dtype_close_to_float32():
    gen = torch.Generator().manual_seed(1)
    parts = [(torch.randn(1, 2, n, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen), None) for n in (7, 9)]
    q = torch.randn(1, 4, 1, 16, generator=gen)
    want = attend_split(q, *parts)
    low = [(k.bfloat16(), v.bfloat16(), m) for k, v, m in parts]
    got = attend_split(q.bfloat16(), *low)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_more_than_one_query_is_refused():
    x = torch.zeros(1, 1, 3, 4)
    with pytest.raises(ValueError, match="one decode query"):
        attend_split(torch.zeros(1, 1, 2, 4), (x, x, None), (x, x, None))


@pytest.mark.parametrize(("dtype", "magnitude", "atol"), [(torch.float16, 100.0, 2e-3), (torch.float64, 1.0, 1e-12)])
def test_float16_and_float64_are_served_as_attend_serves_them(dtype, magnitude, atol):
    """Float16 logits were formed in float16: finite inputs of magnitude 100 (|q . k| > 65504)
    gave NaN outputs where ``attend`` is exact. Float64 inputs were rounded to a float32 softmax
    (errors near 1e-7, and a padded row then differed from the row alone). Now float16 logits
    are float32, float64 runs in float64."""
    gen = torch.Generator().manual_seed(2)
    q = (torch.randn(2, 4, 1, 64, generator=gen) * magnitude).to(dtype)
    parts = [((torch.randn(2, 2, n, 64, generator=gen) * magnitude).to(dtype),
              torch.randn(2, 2, n, 64, generator=gen).to(dtype), None) for n in (7, 13)]
    got = attend_split(q, *parts)
    want = _joined(q.double(), *[(k.double(), v.double(), m) for k, v, m in parts], None)
    assert got.dtype == dtype and bool(got.isfinite().all())
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_recall_cache_attends_float16_and_float64_as_float32_and_rows_alone(dtype):
    """Through ``EvictingCache`` under ``snapkv-recall`` (attention over the recall buffer and the
    kept slots is ``attend_split``): float16 keys and queries of magnitude 100 attend as the same
    numbers do in float32 (they were NaN), and in float64 a left-padded row attends as it does
    alone to float64's precision (it differed by ~1e-8)."""
    from kvpolicy import EvictingCache, load_policy

    policy = load_policy("snapkv-recall", budget=16, recent=4, interval=8, window=4)
    gen = torch.Generator().manual_seed(0)
    scale = 100.0 if dtype == torch.float16 else 1.0
    batch, alone, wide = (EvictingCache(policy, 1) for _ in range(3))
    pad = 3
    for i, t in enumerate([8] + [1] * 30):
        k = (torch.randn(2, 2, t, 32, generator=gen) * scale).to(dtype)
        v = torch.randn(2, 2, t, 32, generator=gen).to(dtype)
        q = (torch.randn(2, 4, t, 32, generator=gen) * scale).to(dtype)
        valid = torch.ones(2, t, dtype=torch.bool)
        if i == 0:
            valid[1, :pad] = False
        out = batch.attend(0, q, k, v, token_valid=valid if i == 0 else None)
        assert bool(out.isfinite().all())
        keep = valid[1]
        if dtype == torch.float16:  # (a padding query's output is meaningless: row 1's real tokens only)
            ref = wide.attend(0, q.float(), k.float(), v.float(), token_valid=valid if i == 0 else None)
            torch.testing.assert_close(out[0].float(), ref[0], atol=2e-3, rtol=0)
            torch.testing.assert_close(out[1][:, keep].float(), ref[1][:, keep], atol=2e-3, rtol=0)
        else:
            mine = alone.attend(0, q[1:2][:, :, keep], k[1:2][:, :, keep], v[1:2][:, :, keep])
            torch.testing.assert_close(out[1:2][:, :, keep], mine, atol=1e-12, rtol=0)
    assert batch.tier_stats().pages_recalled > 0
