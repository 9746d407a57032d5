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
