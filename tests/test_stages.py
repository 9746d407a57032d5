"""Each built-in stage against the naive reference of the spec (tests/reference.py)."""

from __future__ import annotations

import math

import pytest
import reference as ref
import torch
from helpers import left_padding, make_input, make_tensors

from kvpolicy.stages import (
    AttentionScorer,
    CombinationScorer,
    LeverageScorer,
    RedundancyScorer,
    SinksReservation,
    TopScoresReservation,
    ValueMagnitudeScorer,
    WeightedTerm,
)

VASE = dict(pooling="avg", kernel=5, group_reduce="mean", group_reduce_at="after_softmax", window_reduce="mean")
RKV = dict(pooling="max", kernel=7, group_reduce="max", group_reduce_at="before_softmax", window_reduce="mean")
SNAP_PREFILL = dict(pooling="max", kernel=7, group_reduce="mean", group_reduce_at="after_softmax", window_reduce="sum")


def _cand(score: torch.Tensor, inp) -> torch.Tensor:
    """Only the valid candidates are read by later stages: compare those."""
    mask = inp.candidate_mask.expand_as(score)
    return score[mask]


# -- attention --------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [VASE, RKV, SNAP_PREFILL], ids=["vase", "rkv", "snapkv-prefill"])
@pytest.mark.parametrize("hkv,hq", [(2, 2), (2, 8), (1, 3)])
def test_attention_matches_reference(params, hkv, hq):
    k, v, q = make_tensors(b=2, hkv=hkv, hq=hq, n=19, d=8, w=5, seed=hq)
    q = q * 2.0  # peakier attention, so pooling and group reduction matter
    inp = make_input(k, v, q, recent=4)
    got = AttentionScorer(**params).score(inp)
    assert got.shape == (2, hkv, 19) and got.dtype == torch.float32
    want = ref.attention(k, q, 15, **params)
    torch.testing.assert_close(_cand(got, inp).double(), _cand(want, inp), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooling", ["none", "avg", "max"])
@pytest.mark.parametrize("group_reduce", ["mean", "max"])
@pytest.mark.parametrize("at", ["after_softmax", "before_softmax"])
@pytest.mark.parametrize("window_reduce", ["mean", "sum"])
def test_attention_every_parameter_combination(pooling, group_reduce, at, window_reduce):
    k, v, q = make_tensors(b=1, hkv=2, hq=4, n=12, d=4, w=3, seed=7)
    params = dict(pooling=pooling, kernel=3, group_reduce=group_reduce, group_reduce_at=at, window_reduce=window_reduce)
    inp = make_input(k, v, q, recent=2)
    got = AttentionScorer(**params).score(inp)
    want = ref.attention(k, q * 1.0, 10, **params)
    torch.testing.assert_close(_cand(got, inp).double(), _cand(want, inp), rtol=1e-5, atol=1e-6)


def test_attention_uniform_logits_avg_pool_zero_padding_by_hand():
    # One query of zeros: softmax is uniform 1/5 over the 5 candidates. Avg-pool 5 with zero
    # padding 2 divides by 5 everywhere, so the edges see fewer real neighbours.
    k = torch.randn(1, 1, 7, 3)
    q = torch.zeros(1, 1, 1, 3)
    inp = make_input(k, k, q, recent=2)
    got = AttentionScorer(pooling="avg", kernel=5).score(inp)[0, 0, :5]
    torch.testing.assert_close(got, torch.tensor([0.12, 0.16, 0.20, 0.16, 0.12]))
    none = AttentionScorer(pooling="none").score(inp)[0, 0, :5]
    torch.testing.assert_close(none, torch.full((5,), 0.2))


def test_attention_softmax_then_pool_by_hand():
    # D=1, q=1, keys log(x): softmax(log x) = x / sum(x) = [.05, .1, .15, .2, .5].
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    k = torch.zeros(1, 1, 6, 1)
    k[0, 0, :5, 0] = x.log()
    q = torch.ones(1, 1, 1, 1)
    inp = make_input(k, k, q, recent=1)
    mx = AttentionScorer(pooling="max", kernel=3).score(inp)[0, 0, :5]
    torch.testing.assert_close(mx, torch.tensor([0.10, 0.15, 0.20, 0.50, 0.50]))
    avg = AttentionScorer(pooling="avg", kernel=3).score(inp)[0, 0, :5]
    torch.testing.assert_close(avg, torch.tensor([0.15, 0.30, 0.45, 0.85, 0.70]) / 3)
    summed = AttentionScorer(pooling="none", window_reduce="sum").score(
        make_input(k, k, q.expand(1, 1, 2, 1).contiguous(), recent=1)
    )[0, 0, :5]
    torch.testing.assert_close(summed, 2 * x / x.sum())


def test_attention_group_max_before_softmax_by_hand():
    # Two query heads on one KV head, keys [1, 0]: head 0 logits [1, 0], head 1 logits [-1, 0].
    k = torch.tensor([1.0, 0.0, 0.0]).view(1, 1, 3, 1)
    q = torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)
    inp = make_input(k, k, q, recent=1)
    e = math.e
    before = AttentionScorer(pooling="none", group_reduce="max", group_reduce_at="before_softmax").score(inp)
    torch.testing.assert_close(before[0, 0, :2], torch.tensor([e / (e + 1), 1 / (e + 1)]))
    after = AttentionScorer(pooling="none", group_reduce="mean").score(inp)
    torch.testing.assert_close(after[0, 0, :2], torch.tensor([0.5, 0.5]))
    after_max = AttentionScorer(pooling="none", group_reduce="max").score(inp)
    torch.testing.assert_close(after_max[0, 0, :2], torch.tensor([e / (e + 1), e / (e + 1)]))


def test_attention_scale_is_inverse_sqrt_head_dim():
    # D=4: logits [2, 0] / sqrt(4) = [1, 0].
    k = torch.zeros(1, 1, 3, 4)
    k[0, 0, 0] = torch.tensor([1.0, 1.0, 0.0, 0.0])
    q = torch.tensor([1.0, 1.0, 0.0, 0.0]).view(1, 1, 1, 4)
    got = AttentionScorer(pooling="none").score(make_input(k, k, q, recent=1))[0, 0, :2]
    torch.testing.assert_close(got, torch.tensor([math.e / (math.e + 1), 1 / (math.e + 1)]))


@pytest.mark.parametrize("params", [VASE, RKV], ids=["vase", "rkv"])
def test_attention_padding(params):
    k, v, q = make_tensors(b=3, hkv=2, hq=4, n=16, d=8, w=4, seed=3)
    slot_valid = left_padding(3, 16, [0, 3, 7])
    query_valid = torch.tensor([[True] * 4, [False, True, True, True], [False, False, False, True]])
    inp = make_input(k, v, q, recent=3, slot_valid=slot_valid, query_valid=query_valid)
    got = AttentionScorer(**params).score(inp)
    assert torch.isfinite(got).all()
    want = ref.attention(k, q, 13, **params, slot_valid=slot_valid, query_valid=query_valid)
    torch.testing.assert_close(_cand(got, inp).double(), _cand(want, inp), rtol=1e-5, atol=1e-6)
    # Padding never receives attention mass; each valid row's window mean sums to 1 before pooling.
    plain = AttentionScorer(pooling="none").score(inp)
    assert bool((plain[:, :, :13][~slot_valid[:, None, :13].expand(-1, 2, -1)] == 0).all())
    torch.testing.assert_close(plain.sum(-1), torch.ones(3, 2))


def test_attention_row_without_real_queries_scores_zero():
    k, v, q = make_tensors(b=2, n=10)
    query_valid = torch.tensor([[True] * 4, [False] * 4])
    got = AttentionScorer().score(make_input(k, v, q, recent=2, query_valid=query_valid))
    assert bool((got[1] == 0).all()) and bool((got[0, :, :8] > 0).all())


def test_query_attention_softmax_is_float32_for_float64_inputs():
    """The spec: softmax in float32 whatever the cache dtype. float64 logits, softmaxed in float32
    by hand, causal and over valid slots; ``window_attention`` already did this, ``query_attention``
    (G-KV's smoothed scorer) softmaxed float64 inputs in float64."""
    from kvpolicy.stages.attention import query_attention

    k, v, q = make_tensors(b=1, hkv=2, hq=4, n=12, d=8, w=3, seed=5)
    k, v, q = k.double() * 40, v.double(), q.double() * 40  # large logits: float32 rounding shows
    inp = make_input(k, v, q, recent=2)
    got = query_attention(inp)  # [1, Hkv, W, N]
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q.reshape(1, 2, 2, 3, 8) / math.sqrt(8), k)
    visible = inp.positions[:, :, None, :] <= inp.query_positions[:, None, :, None]  # [1, Hkv, W, N]
    want = torch.softmax(logits.float().masked_fill(~visible[:, :, None], float("-inf")), -1).mean(2)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("params", [VASE, RKV], ids=["vase", "rkv"])
def test_attention_low_precision_inputs(dtype, params):
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=40, d=16, w=4, seed=11)
    inp32 = make_input(k, v, q, recent=4)
    inp = make_input(k.to(dtype), v.to(dtype), q.to(dtype), recent=4)
    got = AttentionScorer(**params).score(inp)
    assert got.dtype == torch.float32
    want = AttentionScorer(**params).score(inp32)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got, want, rtol=tol * 5, atol=tol * want.max().item())
    # the top of the ranking is (mostly) the same set
    top_got = set(got[0, 0].topk(10).indices.tolist())
    top_want = set(want[0, 0].topk(10).indices.tolist())
    assert len(top_got & top_want) >= 8


def test_attention_rejects_even_kernel():
    with pytest.raises(ValueError, match="odd"):
        AttentionScorer(pooling="avg", kernel=4)
    AttentionScorer(pooling="none", kernel=4)  # unused kernel is fine


# -- redundancy -------------------------------------------------------------------------------------


def _keys_with_duplicates(b, h, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(b, h, 4, d, generator=g)
    pick = torch.randint(0, 4, (n,), generator=g)
    return base[:, :, pick] + 0.6 * torch.randn(b, h, n, d, generator=g)


@pytest.mark.parametrize("over", ["all", "candidates"])
@pytest.mark.parametrize("threshold", [0.5, None, 0.1])
def test_redundancy_matches_reference(over, threshold):
    k = _keys_with_duplicates(2, 2, 18, 6, seed=5)
    inp = make_input(k, k, torch.randn(2, 2, 1, 6), recent=5)
    got = RedundancyScorer(threshold=threshold, over=over).score(inp)
    want = ref.redundancy(k, 13, threshold=threshold, over=over)
    torch.testing.assert_close(_cand(got, inp).double(), _cand(want, inp), rtol=1e-5, atol=1e-7)


def test_redundancy_threshold_step_by_hand():
    # k0 == k1, k2 orthogonal: C = [[0,1,0],[1,0,0],[0,0,0]]. With threshold 0.5 the only
    # duplicates are zeroed (row 0 -> col 1, row 1 -> col 0; row 2 has none -> col 0), leaving
    # all zeros: uniform 1/3. Without it: mean columns [1/3, 1/3, 0] -> softmax.
    k = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]]).view(1, 1, 3, 2)
    inp = make_input(k, k, torch.zeros(1, 1, 1, 2), recent=0)
    got = RedundancyScorer(threshold=0.5).score(inp)[0, 0]
    torch.testing.assert_close(got, torch.full((3,), 1 / 3))
    no_thr = RedundancyScorer(threshold=None).score(inp)[0, 0]
    torch.testing.assert_close(no_thr, torch.softmax(torch.tensor([1 / 3, 1 / 3, 0.0]), -1))


def test_redundancy_keeps_latest_duplicate_only():
    # Three copies: row i zeroes only its most recent duplicate column.
    k = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]).view(1, 1, 4, 2)
    got = RedundancyScorer(threshold=0.5).score(make_input(k, k, torch.zeros(1, 1, 1, 2), recent=0))[0, 0]
    # C after the step: row0 [0,1,0,0], row1 [1,0,0,0], row2 [1,0,0,0], row3 0 -> means [2,1,0,0]/4
    torch.testing.assert_close(got, torch.softmax(torch.tensor([0.5, 0.25, 0.0, 0.0]), -1))


def test_redundancy_all_uses_recent_rows_and_columns():
    k = _keys_with_duplicates(1, 2, 12, 4, seed=9)
    inp = make_input(k, k, torch.zeros(1, 2, 1, 4), recent=4)
    a = RedundancyScorer(over="all").score(inp)
    c = RedundancyScorer(over="candidates").score(inp)
    assert not torch.allclose(a[..., :8], c[..., :8])
    # over="candidates" is a softmax over the candidates: sums to 1; "all" drops recent columns.
    torch.testing.assert_close(c[..., :8].sum(-1), torch.ones(1, 2))
    assert bool((a[..., :8].sum(-1) < 1).all())


def test_redundancy_chunking_does_not_change_scores():
    k = _keys_with_duplicates(2, 2, 150, 8, seed=1)
    inp = make_input(k, k, torch.zeros(2, 2, 1, 8), recent=10)
    whole = RedundancyScorer(chunk_elements=1 << 25).score(inp)
    chunked = RedundancyScorer(chunk_elements=1 << 10).score(inp)  # 2 rows per chunk
    torch.testing.assert_close(whole, chunked)


def test_redundancy_padding():
    k = _keys_with_duplicates(2, 1, 14, 4, seed=2)
    slot_valid = left_padding(2, 14, [0, 5])
    inp = make_input(k, k, torch.zeros(2, 1, 1, 4), recent=3, slot_valid=slot_valid)
    for over in ("all", "candidates"):
        got = RedundancyScorer(over=over).score(inp)
        want = ref.redundancy(k, 11, over=over, slot_valid=slot_valid)
        torch.testing.assert_close(_cand(got, inp).double(), _cand(want, inp), rtol=1e-5, atol=1e-7)


def test_redundancy_fallback_column_of_a_left_padded_row_is_its_first_token():
    # Spec (Redundancy, R-KV): a row i with no column above the threshold zeroes column j = 0, the
    # first *cached token*. In a left-padded row that is the first valid slot, not slot 0 (padding,
    # whose similarity is 0 already): the row must score as it does alone. Independent float64
    # reference written from the spec text; wide random keys, so many rows have no match.
    g = torch.Generator().manual_seed(3)
    n, pad, d, recent = 16, 3, 32, 4
    k = torch.randn(1, 1, n, d, generator=g)
    kd = k[0, 0].double()
    kn = kd / (kd.norm(dim=-1, keepdim=True) + 1e-8)
    c = kn @ kn.T
    c.fill_diagonal_(0.0)
    for i in range(n):
        above = (c[i] > 0.5).nonzero().flatten()
        c[i, int(above.max()) if len(above) else 0] = 0.0
    want = torch.softmax(c.mean(0), -1)[: n - recent]
    assert not bool(((kn @ kn.T).fill_diagonal_(0.0) > 0.5).any(-1).all())  # some rows fall back
    padded = torch.cat([torch.zeros(1, 1, pad, d), k], 2)
    inp = make_input(padded, padded, torch.zeros(1, 1, 1, d), recent=recent, slot_valid=left_padding(1, n + pad, [pad]))
    got = RedundancyScorer(threshold=0.5, over="all").score(inp)[0, 0, pad : pad + n - recent]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-9)


# -- leverage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["kv_product", "key", "value", "mean"])
@pytest.mark.parametrize("local_window", [None, 4])
@pytest.mark.parametrize("projection", ["fixed", "resample"])
def test_leverage_matches_reference_given_projection(mode, local_window, projection):
    k, v, q = make_tensors(b=3, hkv=2, hq=2, n=21, d=8, seed=4)
    stage = LeverageScorer(rank=5, mode=mode, local_window=local_window, projection=projection)
    inp = make_input(k, v, q, recent=3, seed=0)
    p = stage.projections(inp)
    assert p.shape == (3, 8, 5)
    inp = make_input(k, v, q, recent=3, seed=0)
    got = stage.score(inp)
    want = ref.leverage(k, v, 18, p, mode=mode, local_window=local_window)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[..., :18].sum(-1), torch.ones(3, 2))


def test_leverage_projection_distribution():
    k, v, q = make_tensors(b=64, hkv=1, hq=1, n=4, d=32)
    stage = LeverageScorer(rank=20, projection="resample")
    p = stage.projections(make_input(k, v, q, seed=0, streams=torch.arange(64)))
    # entries N(0, 1) / sqrt(r): variance 1 / 20
    assert abs(p.var().item() * 20 - 1) < 0.05
    assert abs(p.mean().item()) < 0.01


def test_leverage_resample_differs_per_row_and_call():
    k, v, q = make_tensors(b=3, n=10)
    stage = LeverageScorer(projection="resample")
    rows = torch.arange(3)
    p1 = stage.projections(make_input(k, v, q, evictions=0, streams=rows))
    p2 = stage.projections(make_input(k, v, q, evictions=1, streams=rows))
    assert not torch.allclose(p1[0], p1[1]) and not torch.allclose(p1[1], p1[2])
    assert not torch.allclose(p1, p2)
    # ...but the same seed, layer, stream and eviction count reproduce them...
    p3 = stage.projections(make_input(k, v, q, evictions=0, streams=rows))
    torch.testing.assert_close(p1, p3)
    # ...and rows of one stream (the default) draw alike: a row's draws depend on that row alone.
    shared = stage.projections(make_input(k, v, q, evictions=0))
    assert all(torch.equal(shared[0], shared[i]) for i in range(3))


def test_leverage_fixed_same_per_layer_seed():
    k, v, q = make_tensors(b=4, n=10)
    stage = LeverageScorer(projection="fixed")
    assert not stage.stochastic  # deterministic given the seed
    p1 = stage.projections(make_input(k, v, q, layer_idx=7, evictions=1))
    p2 = stage.projections(make_input(k, v, q, layer_idx=7, evictions=torch.tensor([2, 3, 4, 5])))
    torch.testing.assert_close(p1, p2)  # independent of the eviction: reused every eviction
    assert all(torch.equal(p1[0], p1[i]) for i in range(4))  # one P for all rows of the layer
    p3 = stage.projections(make_input(k, v, q, layer_idx=8))
    assert not torch.allclose(p1, p3)
    # two stacked layers of two rows each: rows follow their layer's projection
    stacked = stage.projections(make_input(k, v, q, layer_idx=torch.tensor([7, 7, 8, 8])))
    torch.testing.assert_close(stacked[:2], p1[:2])
    torch.testing.assert_close(stacked[2:], p3[:2])


def test_leverage_padding():
    k, v, q = make_tensors(b=2, hkv=2, n=12, d=6, seed=8)
    slot_valid = left_padding(2, 12, [0, 4])
    stage = LeverageScorer(rank=4)
    inp = make_input(k, v, q, recent=2, slot_valid=slot_valid, layer_idx=3)
    got = stage.score(inp)
    want = ref.leverage(k, v, 10, stage.projections(inp), slot_valid=slot_valid)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    assert bool((got[1, :, :4] == 0).all())


# -- value magnitude --------------------------------------------------------------------------------


def test_value_magnitude_by_hand():
    v = torch.tensor([1.0, -2.0, 3.0, 0.5]).view(1, 1, 1, 4)
    inp = make_input(v, v, torch.zeros(1, 1, 1, 4), recent=0)
    assert ValueMagnitudeScorer(metric="range").score(inp).item() == pytest.approx(5.0)
    assert ValueMagnitudeScorer(metric="variance").score(inp).item() == pytest.approx(3.171875)
    assert ValueMagnitudeScorer(metric="l2").score(inp).item() == pytest.approx(math.sqrt(14.25))


@pytest.mark.parametrize("metric", ["range", "variance", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_value_magnitude_matches_reference(metric, dtype):
    k, v, q = make_tensors(b=2, hkv=3, n=9, d=7, seed=6, dtype=dtype)
    got = ValueMagnitudeScorer(metric=metric).score(make_input(k, v, q))
    assert got.dtype == torch.float32 and got.shape == (2, 3, 9)
    want = ref.value_magnitude(v, metric)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_combination_is_weighted_sum():
    k, v, q = make_tensors(b=2, n=12, seed=2)
    inp = make_input(k, v, q, recent=2)
    a, r = AttentionScorer(), ValueMagnitudeScorer()
    combo = CombinationScorer(terms=[WeightedTerm(weight=0.3, scorer=a), WeightedTerm(weight=-2.0, scorer=r)])
    torch.testing.assert_close(combo.score(inp), 0.3 * a.score(inp) - 2.0 * r.score(inp))
    assert combo.may_be_negative
    also = CombinationScorer(terms=[{"weight": 1.0, "scorer": {"type": "value_magnitude", "metric": "l2"}}])
    assert isinstance(also.terms[0].scorer, ValueMagnitudeScorer)


# -- reservations -----------------------------------------------------------------------------------


def test_sinks_follow_positions_not_slots():
    k, v, q = make_tensors(b=2, hkv=2, n=12)
    slot_valid = left_padding(2, 12, [0, 3])
    inp = make_input(k, v, q, recent=2, slot_valid=slot_valid)
    got = SinksReservation(n=4).reserve(inp, torch.zeros(2, 2, 12, dtype=torch.bool))
    assert got[0, 0].nonzero().squeeze(-1).tolist() == [0, 1, 2, 3]
    assert got[1, 1].nonzero().squeeze(-1).tolist() == [3, 4, 5, 6]


@pytest.mark.parametrize("include_prior", [True, False])
@pytest.mark.parametrize("n", [5, 0.25, 0])
def test_top_scores_reservation_matches_reference(include_prior, n):
    k, v, q = make_tensors(b=2, hkv=3, n=30, d=8, seed=12)
    inp = make_input(k, v, q, recent=4, budget=20)
    prior = SinksReservation(n=3).reserve(inp, torch.zeros(2, 3, 30, dtype=torch.bool))
    prior = prior | (torch.arange(30) >= 26)
    stage = TopScoresReservation(scorer={"type": "value_magnitude", "metric": "range"}, n=n,
                                 include_prior=include_prior)
    got = stage.reserve(inp, prior)
    count = n if isinstance(n, int) else int(n * 20)
    rng = ref.value_magnitude(v, "range")
    for b in range(2):
        for h in range(3):
            prot = set(prior[b, h].nonzero().squeeze(-1).tolist())
            want = ref.top_reservation(rng[b, h], list(range(26)), prot, count, include_prior)
            assert set(got[b, h].nonzero().squeeze(-1).tolist()) == want


@pytest.mark.parametrize("softmax_over", ["all", "candidates"])
def test_window_attention_hides_a_slot_whose_logit_overflows(softmax_over):
    """The mask is a bias added to the logits (0 or -inf): a hidden slot whose logit overflows to
    +inf would turn NaN under it. Hidden it must stay, as a masked fill hides it: a slot after
    every query (causal) or a padding slot, its key large enough that q . k is +inf in float32."""
    import dataclasses

    from kvpolicy.stages.attention import window_attention

    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=10, d=8, w=3, seed=3)
    q = q.abs() + 0.5
    k[:, :, 9] = 3e38  # q . k / sqrt(8) overflows
    slot_valid = torch.ones(2, 10, dtype=torch.bool)
    slot_valid[1, 9] = False  # row 1: padding
    inp = make_input(k, v, q, recent=0, slot_valid=slot_valid)
    inp = dataclasses.replace(inp, query_positions=torch.tensor([[6, 7, 8], [6, 7, 8]]))  # row 0: slot 9 after them
    weights = torch.ones(2, 3)
    got = window_attention(inp, weights, softmax_over=softmax_over)  # [B, Hkv, G, N]
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q.reshape(2, 2, 2, 3, 8) / math.sqrt(8), k)
    seen = slot_valid[:, None, None, None, :].expand_as(logits).clone()
    if softmax_over == "all":
        seen &= inp.positions[:, :, None, None, :] <= inp.query_positions[:, None, None, :, None]
    want = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1).sum(3)
    rows = [0, 1] if softmax_over == "all" else [1]  # candidates: row 0 sees its slot 9 and overflows, as it should
    assert torch.isfinite(got[rows]).all()
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-6, atol=1e-6)
