"""``Policy.select`` keeps every promise for every input, or refuses it with an error naming why.

The promise: ``[B, Hkv, min(N, budget)]`` ascending slot indices, no duplicates, every protected
slot kept (recent buffer, sinks, reservations). The refusal: a ``SelectionError`` (a
``ValueError``) naming the input (keys, values, queries) or the stage at fault.
"""

from __future__ import annotations

import re
from typing import ClassVar

import pytest
import torch
from helpers import (
    Contract2Plugin,
    assert_valid_selection,
    facts_for,
    load_fitting,
    make_input,
    make_tensors,
    prompt_for,
)
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import Reservation, Scorer, SelectionError, Selector
from kvpolicy.inputs import unread_values
from kvpolicy.registry import get_registry, reset_registry

INF = float("inf")


def sinks_policy(scorer: dict, budget: int = 16, recent: int = 4, **extra) -> kvpolicy.Policy:
    return kvpolicy.load_policy({
        "name": "sinks-recent",
        "schedule": {"budget": budget, "recent": recent, "interval": 4, "window": 4},
        "scorer": scorer,
        "reservations": [{"type": "sinks", "n": 4}, *extra.get("reservations", [])],
        "selector": {"type": extra.get("selector", "greedy")},
    })


def sinks_and_recent(b: int, hkv: int, n: int, recent: int) -> torch.Tensor:
    mask = torch.zeros(b, hkv, n, dtype=torch.bool)
    mask[..., :4] = True
    mask[..., n - recent :] = True
    return mask


# -- defect 1: non-finite and out-of-range inputs, float16 overflow -----------------------------
@pytest.mark.parametrize("scorer", [{"type": "value_magnitude"}, {"type": "attention"}, {"type": "key_norm"}])
@pytest.mark.parametrize("target", ["keys", "values", "queries"])
def test_inf_inputs_are_refused_naming_the_input(scorer, target):
    # +inf values score +inf under value_magnitude: they used to tie with the protected slots'
    # priority, and the recent buffer and sinks were dropped without an error.
    policy = sinks_policy(scorer)
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=40, d=8, w=4, seed=1)
    named = {"keys": k, "values": v, "queries": q}
    t = named[target]
    t.view(-1)[:: max(1, t.numel() // 13)] = INF  # many slots, more than the budget's free ones
    with pytest.raises(SelectionError, match=rf"^{target} hold \d+ non-finite entries \(\+inf\)"):
        policy.select(k, v, q)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.data())
def test_the_finite_check_finds_any_non_finite_entry_and_passes_finite_sums_that_overflow(n, data):
    """The float32 check sums (one reduction) and falls back to min and max when the sum is not
    finite: an inf or NaN anywhere is found, and finite entries whose sum overflows still pass."""
    from kvpolicy.stages.guards import _all_representable

    t = torch.randn(n)
    assert bool(_all_representable(t))
    huge = t.abs() + 3e38  # finite, yet any two of them add up to inf
    assert bool(_all_representable(huge))
    i = data.draw(st.integers(0, n - 1))
    for bad in (INF, -INF, float("nan")):
        for base in (t, huge):
            u = base.clone()
            u[i] = bad
            assert not bool(_all_representable(u))


def test_nan_in_a_padding_slot_is_refused_too():
    # Scorers read padding (leverage multiplies it by zero, which keeps NaN a NaN): all of it must be finite.
    policy = kvpolicy.load_policy("curdkv", budget=16, recent=4, window=4, interval=4)
    k, v, q = make_tensors(b=1, hkv=1, hq=1, n=40, d=8, w=4)
    slot_valid = torch.arange(40)[None] >= 5
    k[0, 0, 0, 0] = float("nan")
    with pytest.raises(SelectionError, match=r"keys hold 1 non-finite entries \(NaN\), the first at index \[0, 0, 0, 0\]"):
        policy.select(k, v, q, slot_valid=slot_valid)


def test_float64_beyond_float32_range_is_refused():
    # Scores are float32: 1e200 became +inf and tied with the protected slots.
    policy = sinks_policy({"type": "value_magnitude"})
    k, v, q = make_tensors(b=1, hkv=2, hq=2, n=40, d=8, w=4, seed=2, dtype=torch.float64)
    v[..., 8:30, :] *= 1e200
    with pytest.raises(SelectionError, match=r"^values are float64 with \d+ entries beyond float32's range"):
        policy.select(k, v, q)
    # within float32's range, float64 inputs are fine
    kept = policy.select(k, v / 1e200, q)
    assert_valid_selection(kept, 40, 16, sinks_and_recent(1, 2, 40, 4))


def test_float16_inputs_of_magnitude_300_are_scored_in_float32():
    # Q K^T in float16 overflowed (300 * 300 * 64 / 8 > 65504): reported as NaN scores before.
    policy = sinks_policy({"type": "attention"})
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=48, d=64, w=4, seed=3)
    k, v, q = (k * 300).half(), v.half(), (q * 300).half()
    kept = policy.select(k, v, q)
    assert_valid_selection(kept, 48, 16, sinks_and_recent(2, 2, 48, 4))
    # exactly what the same numbers give in float32
    assert torch.equal(kept, policy.select(k.float(), v.float(), q.float()))


def test_scorer_overflow_from_finite_inputs_names_the_scorer():
    policy = sinks_policy({"type": "attention"})
    k, v, q = make_tensors(b=1, hkv=1, hq=1, n=40, d=8, w=4, seed=4)
    msg = r"^scorer 'attention' produced non-finite scores .*: the scores overflowed float32 from finite inputs"
    with pytest.raises(SelectionError, match=msg):
        policy.select(k * 1e30, v, q * 1e30)  # float32 logits of 1e60


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("name", ["snapkv", "oracle-topk", "quest", "curdkv", "rkv"])
def test_finite_float32_inputs_whose_dot_products_overflow_are_refused_as_an_overflow(name, padded):
    """Entries of 1e19 are finite float32, but q . k (1e38 * D) is not. Every policy that multiplies
    them refuses with a message that says so, and what to do; none selects from the overflowed
    scores (current_attention and quest zeroed them, and attention did on padded batches)."""
    policy = kvpolicy.load_policy(name, budget=8, recent=2, interval=4, window=2)
    big = torch.full((2, 2, 16, 16), 1e19)
    queries = torch.full((2, 4, 2, 16), 1e19)
    slot_valid = torch.ones(2, 16, dtype=torch.bool)
    if padded:
        slot_valid[1, :3] = False  # row 1 left-padded: the masked paths of the scorers
    with pytest.raises(SelectionError) as err:
        policy.select(big, big, queries, slot_valid=slot_valid)
    message = str(err.value)
    assert message.startswith("scorer '"), message
    assert "the scores overflowed float32 from finite inputs" in message
    assert "entries reach 1e+19" in message and "Rescale the keys, values and queries" in message
    assert "check the inputs for NaN" not in message


def test_inf_priorities_never_tie_with_protected_slots(plugin):
    policy = sinks_policy({"type": "random"}, selector="inf_priority_test")
    k, v, q = make_tensors(b=2, hkv=2, hq=2, n=40, d=8, w=4, seed=5)
    kept = policy.select(k, v, q)
    assert_valid_selection(kept, 40, 16, sinks_and_recent(2, 2, 40, 4))


# -- test stages: a plugin registered at run time ------------------------------------------------
class EverySixteenth(Reservation):
    """Protects every 16th position: a count that grows with the sequence (and declares none)."""

    type_name: ClassVar[str] = "every_16th"

    def reserve(self, inp, protected):
        return (inp.positions % 16 == 0) & inp.slot_valid


class Understated(Reservation):
    """Protects the first 5 candidates but declares 2."""

    type_name: ClassVar[str] = "understated_test"

    def reserve(self, inp, protected):
        out = torch.zeros_like(protected)
        out[..., :5] = True
        return out

    def reserved_count(self, budget):
        return 2


class FlatReservation(Reservation):
    """Returns a [B, N] mask, or a float one."""

    type_name: ClassVar[str] = "flat_reservation_test"

    as_float: bool = False

    def reserve(self, inp, protected):
        if self.as_float:
            return protected.float()
        return protected[:, 0]


class FlatScorer(Scorer):
    """Returns ``[B, N]`` scores (one per row instead of per row and KV head)."""

    type_name: ClassVar[str] = "flat_test"

    def score(self, inp):
        return inp.keys.float().norm(dim=-1)[:, 0]


class InfPriority(Selector):
    """+inf for every slot: must still rank below protection."""

    type_name: ClassVar[str] = "inf_priority_test"

    def priority(self, scores, inp):
        return torch.full(inp.keys.shape[:3], INF)


class NanPriority(Selector):
    type_name: ClassVar[str] = "nan_priority_test"

    def priority(self, scores, inp):
        return scores * float("nan")


class TestStagesPlugin(Contract2Plugin):
    @kvpolicy.hookimpl
    def kvpolicy_stages(self):
        return [EverySixteenth, Understated, FlatReservation, FlatScorer, InfPriority, NanPriority]


@pytest.fixture(autouse=True)
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


@pytest.fixture
def plugin():
    get_registry().register_plugin(TestStagesPlugin(), name="guarantees-test")


# -- defect 2: reservations protecting more than the budget keeps --------------------------------
def test_over_protecting_reservation_is_refused_naming_it(plugin):
    policy = kvpolicy.load_policy({  # loads: the stage declares no count
        "name": "every-16th",
        "schedule": {"budget": 64, "recent": 8, "interval": 64, "window": 8},
        "scorer": {"type": "attention"},
        "reservations": [{"type": "sinks", "n": 4}, {"type": "every_16th"}],
        "selector": {"type": "greedy"},
    })
    k, v, q = make_tensors(b=1, hkv=2, hq=2, n=500, d=8, w=8, seed=6)
    # 500 slots: every 16th position is 32 slots, with the sinks (3 more) and the recent buffer
    # (8, of which one is a multiple of 16) 42 <= 64: fine, and all of them are kept.
    kept = policy.select(k, v, q)
    protected = sinks_and_recent(1, 2, 500, 8)
    protected[..., ::16] = True
    assert_valid_selection(kept, 500, 64, protected)
    # 1100 slots: 8 recent + 4 sinks + 68 more multiples of 16 = 80 protected slots > 64 kept
    k, v, q = make_tensors(b=1, hkv=2, hq=2, n=1100, d=8, w=8, seed=6)
    msg = r"^reservation 'every_16th' protects 80 slots in some row/head but the budget keeps 64"
    with pytest.raises(SelectionError, match=msg):
        policy.select(k, v, q)


def test_reservation_adding_more_than_it_declares_is_refused(plugin):
    policy = kvpolicy.load_policy({
        "name": "understated",
        "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 4},
        "scorer": {"type": "attention"},
        "reservations": [{"type": "understated_test"}],
        "selector": {"type": "greedy"},
    })
    k, v, q = make_tensors(b=1, hkv=1, hq=1, n=40, d=8, w=4)
    msg = r"^reservation 'understated_test' protects 5 more candidate slots .* declares at most reserved_count\(16\) = 2"
    with pytest.raises(SelectionError, match=msg):
        policy.select(k, v, q)


@pytest.mark.parametrize(("as_float", "msg"), [
    (False, r"returned a protection mask of shape \(2, 40\), expected \[B, Hkv, N\] = \(2, 2, 40\)"),
    (True, r"returned a protection mask of dtype torch.float32, expected torch.bool"),
])
def test_reservation_output_is_checked(plugin, as_float, msg):
    policy = sinks_policy({"type": "attention"},
                          reservations=[{"type": "flat_reservation_test", "as_float": as_float}])
    k, v, q = make_tensors(b=2, hkv=2, hq=2, n=40, d=8, w=4)
    with pytest.raises(SelectionError, match=rf"^reservation 'flat_reservation_test' {msg}"):
        policy.select(k, v, q)


def test_recent_buffer_larger_than_the_budget_is_refused():
    policy = sinks_policy({"type": "attention"})
    k, v, q = make_tensors(b=1, hkv=1, hq=1, n=40, d=8, w=4)
    inp = make_input(k, v, q, recent=20, budget=16)
    with pytest.raises(SelectionError, match=r"^the recent buffer \(20 slots.* larger than the budget \(16"):
        policy.select_from(inp)


# -- defect 3: scorer and selector outputs -------------------------------------------------------
SHAPE_MSG = r"returned scores of shape \(2, 40\), expected \[B, Hkv, N\] = \(2, 2, 40\)"


@pytest.mark.parametrize(("spec", "named"), [
    ({"scorer": {"type": "flat_test"}}, "scorer 'flat_test'"),
    ({"scorer": {"type": "combination", "terms": [{"weight": 1.0, "scorer": {"type": "attention"}},
                                                  {"weight": 1.0, "scorer": {"type": "flat_test"}}]}},
     "scorer 'flat_test' (terms[1] of scorer 'combination')"),
    ({"scorer": {"type": "attention"},
      "reservations": [{"type": "top_scores", "n": 4, "scorer": {"type": "flat_test"}}]},
     "scorer 'flat_test' (in reservation 'top_scores')"),
])
def test_scorer_returning_b_n_is_refused_naming_it(plugin, spec, named):
    # B == Hkv: [B, N] used to broadcast silently over the heads.
    policy = kvpolicy.load_policy({
        "name": "flat", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 4},
        "selector": {"type": "greedy"}, **spec,
    })
    k, v, q = make_tensors(b=2, hkv=2, hq=2, n=40, d=8, w=4)
    with pytest.raises(SelectionError, match="^" + re.escape(named) + " " + SHAPE_MSG):
        policy.select(k, v, q)


def test_nan_priorities_are_refused_naming_the_selector(plugin):
    policy = sinks_policy({"type": "attention"}, selector="nan_priority_test")
    k, v, q = make_tensors(b=1, hkv=1, hq=1, n=40, d=8, w=4)
    with pytest.raises(SelectionError, match=r"^selector 'nan_priority_test' produced NaN priorities"):
        policy.select(k, v, q)


def test_selection_error_is_a_value_error():
    assert issubclass(SelectionError, ValueError)
    assert "SelectionError" in kvpolicy.__all__


# -- the property: every built-in policy, any input ---------------------------------------------
def _load_small(name: str) -> kvpolicy.Policy:
    try:
        return load_fitting(name, budget=16, recent=4, interval=4, window=4)
    except kvpolicy.PolicyError:  # streamingllm: recent is budget - 4
        return load_fitting(name, budget=16, interval=4, window=4)


@pytest.mark.parametrize("name", ["oracle-topk", "quest", "snapkv"])
def test_an_empty_query_window_is_refused_when_a_stage_reads_the_queries(name):
    """``[B, Hq, 0, D]`` queries: the newest-query scorers crashed (IndexError from argmax) and
    the window scorer ranked all-zero scores; now a SelectionError names the queries and stage."""
    policy = kvpolicy.load_policy(name, budget=8, recent=2, interval=4, window=2)
    keys, values, queries = make_tensors(b=2, hkv=2, hq=4, n=16, d=8, w=0, seed=0)
    with pytest.raises(SelectionError, match=r"queries hold no window entry \(shape \(2, 4, 0, 8\), W = 0\), but "
                                             r"scorer '\w+' reads them"):
        policy.select(keys, values, queries)
    # A window whose entries hold no query yet is well defined (those rows score no attention).
    keys, values, queries = make_tensors(b=2, hkv=2, hq=4, n=16, d=8, w=2, seed=0)
    kept = policy.select(keys, values, queries, query_valid=torch.zeros(2, 2, dtype=torch.bool))
    assert kept.shape == (2, 2, 8)
    # A policy that reads no query takes an empty window.
    assert kvpolicy.load_policy("curdkv", budget=8, recent=2, interval=4, window=0).select(
        *make_tensors(b=2, hkv=2, hq=4, n=16, d=8, w=0, seed=0)).shape == (2, 2, 8)


# Policy.select's promises; per-head allocations answer through Policy.select_heads, whose
# promises (counts, protected slots, reproducible draws) tests/test_allocation.py fuzzes.
def _serves_made_up_models(policy: kvpolicy.Policy) -> bool:
    """Whether made-up model facts serve the policy (``triattention`` is bound to its calibration's model)."""
    try:
        facts_for(policy, 1, 2, 2, 8)
    except kvpolicy.PolicyError:
        return False
    return True


POLICIES = {
    name: _load_small(name) for name in kvpolicy.available_policies()
    if not kvpolicy.load_policy(name).per_head and _serves_made_up_models(kvpolicy.load_policy(name))
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@st.composite
def eviction_cases(draw):
    name = draw(st.sampled_from(sorted(POLICIES)))
    b, hkv, g = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n = draw(st.integers(17, 80) if draw(st.integers(0, 4)) else st.integers(1, 16))  # mostly above the budget
    d, w = draw(st.integers(4, 16)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(DTYPES))
    pads = draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    query_valid = draw(st.lists(st.lists(st.booleans(), min_size=w, max_size=w), min_size=b, max_size=b))
    kind = draw(st.sampled_from(["huge", "nan", "+inf", "-inf", "huge", "beyond", "none", "none"]))
    targets = draw(st.sets(st.sampled_from(["keys", "values", "queries"]), min_size=1, max_size=3))
    count = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    return name, b, hkv, g, n, d, w, dtype, pads, query_valid, kind, sorted(targets), count, seed


def _inject(t: torch.Tensor, kind: str, count: int, gen: torch.Generator) -> None:
    if t.numel() == 0:
        return
    idx = torch.randint(0, t.numel(), (count,), generator=gen)
    sign = torch.where(torch.rand(count, generator=gen) < 0.5, -1.0, 1.0).double()
    if kind == "huge":  # finite, near the top of what the dtype or float32 can hold
        value = 6e4 if t.dtype == torch.float16 else 1e30
    elif kind == "beyond":  # float64 beyond float32's range; inf in narrower dtypes
        value = 1e300 if t.dtype == torch.float64 else INF
    else:
        value = {"nan": float("nan"), "+inf": INF, "-inf": -INF}[kind]
    t.view(-1)[idx] = (sign * value if kind in ("huge", "beyond") else torch.full((count,), value)).to(t.dtype)


@settings(max_examples=400, deadline=None)
@given(eviction_cases())
def test_select_keeps_its_promises_or_says_why(case):
    name, b, hkv, g, n, d, w, dtype, pads, query_valid, kind, targets, count, seed = case
    policy = POLICIES[name]
    gen = torch.Generator().manual_seed(seed)
    named = dict(zip(["keys", "values", "queries"], make_tensors(b=b, hkv=hkv, hq=hkv * g, n=n, d=d, w=w,
                                                                 seed=seed, dtype=dtype), strict=True))
    if kind != "none":
        for target in targets:
            _inject(named[target], kind, count, gen)
    slot_valid = torch.stack([torch.arange(n) >= p for p in pads])  # valid slots at the end
    qv = torch.tensor(query_valid, dtype=torch.bool)
    # Which inputs hold entries that float32 scores cannot use: these must be refused by name.
    unusable = [
        label for label, t in named.items()
        if not bool((t.double().abs() <= torch.finfo(torch.float32).max).all())
    ]
    huge = any(bool((t.double().abs() >= 1e29).any()) for t in named.values())
    model = None
    if policy.needs_model:  # made-up facts of this shape (RoPE pairs dimensions: an even D)
        assume(d % 2 == 0)
        model = facts_for(policy, 1, hkv, hkv * g, d)
    try:
        kept = policy.select(named["keys"], named["values"], named["queries"], slot_valid=slot_valid, query_valid=qv,
                             model=model, prompt_lengths=prompt_for(policy))
    except ValueError as exc:
        assert isinstance(exc, SelectionError), exc
        message = str(exc)
        if unusable:
            assert message.startswith(unusable[0] + " "), (unusable, message)
            event("refused: inputs")
            return
        # Only a float32 overflow in a scorer may refuse finite, in-range inputs.
        assert huge, f"{name} refused finite inputs ({dtype}, {kind}): {message}"
        assert message.startswith("scorer '") and "from finite inputs" in message, message
        event("refused: scorer overflow")
        return
    # Up to the budget every slot is kept without reading the inputs; beyond it they are checked.
    assert not unusable or n <= policy.budget, f"{name} accepted non-finite {unusable}"
    event("kept all" if n <= policy.budget else f"selected ({kind})")
    k_keep = min(n, policy.budget)
    protected = torch.zeros(b, hkv, n, dtype=torch.bool)
    if n > policy.budget:
        recent = policy.schedule.recent
        protected |= (torch.arange(n) >= n - recent) & slot_valid[:, None, :]
        if any(r.type_name == "sinks" for r in policy.config.reservations):
            positions = slot_valid.long().cumsum(-1) - 1
            protected |= ((positions < 4) & slot_valid)[:, None, :]
        if any(r.type_name == "prompt" for r in policy.config.reservations):
            positions = slot_valid.long().cumsum(-1) - 1
            protected |= ((positions < prompt_for(policy)) & slot_valid)[:, None, :]
    assert kept.shape == (b, hkv, k_keep)
    assert_valid_selection(kept, n, k_keep, protected)
    # padding is never kept while a valid slot is not
    valid_kept = torch.gather(slot_valid[:, None, :].expand(b, hkv, n), -1, kept).sum(-1)
    assert bool((valid_kept == slot_valid.sum(-1, keepdim=True).clamp_max(k_keep)).all())


# -- Policy.reads_values tells the truth --------------------------------------------------------------
ALL_POLICIES = {name: _load_small(name) for name in kvpolicy.available_policies()
                if _serves_made_up_models(kvpolicy.load_policy(name))}


@pytest.mark.parametrize("name", sorted(ALL_POLICIES))
@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(17, 48), st.integers(0, 2**16))
def test_a_policy_that_reads_no_values_keeps_the_same_slots_given_a_placeholder(name, b, n, seed):
    """vLLM skips gathering the values where no stage reads them (``Stage.reads_values``) and
    passes a ``meta`` tensor of their shape: every built-in that says so keeps the same slots as
    with the real values (a stage that read them would raise), and one that reads them refuses
    the placeholder by name."""
    policy, hkv = ALL_POLICIES[name], 3  # the bundled model's KV heads (DuoAttention's profile is for them)
    keys, values, queries = make_tensors(b=b, hkv=hkv, hq=2 * hkv, n=n, d=8, w=4, seed=seed)
    placeholder = unread_values(keys)  # what vLLM passes
    kwargs = dict(model=facts_for(policy, 1, hkv, 2 * hkv, 8), prompt_lengths=prompt_for(policy), seed=seed)
    select = policy.select_heads if policy.per_head else policy.select
    if policy.reads_values:
        with pytest.raises(ValueError, match=rf"policy '{re.escape(policy.name)}' reads the cached values \("):
            select(keys, placeholder, queries, **kwargs)
        return
    want, got = select(keys, values, queries, **kwargs), select(keys, placeholder, queries, **kwargs)
    for w, g in zip(want if policy.per_head else [want], got if policy.per_head else [got], strict=True):
        assert torch.equal(w, g), name


# -- Policy.stochastic tells the truth --------------------------------------------------------------
def test_a_null_seed_makes_per_layer_draws_stochastic():
    """CurDKV's fixed projection is drawn from the layer's seed: deterministic given a seed, but a
    null seed is resolved afresh at every select call, so the policy is then stochastic."""
    assert not POLICIES["curdkv"].stochastic
    assert POLICIES["curdkv"].with_overrides(seed=None).stochastic
    assert not POLICIES["snapkv"].with_overrides(seed=None).stochastic  # draws nothing
    assert POLICIES["vase-dkv"].stochastic and POLICIES["vase-dkv"].with_overrides(seed=7).stochastic


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), seed=st.sampled_from([None, 0, 12345]),
       data_seed=st.integers(0, 2**16), layer=st.integers(0, 40),
       calls=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3)), min_size=2, max_size=3))
def test_a_policy_that_is_not_stochastic_keeps_the_same_slots_on_every_call(name, seed, data_seed, layer, calls):
    """``Policy.stochastic == False`` promises: the same tensors and layer keep the same slots,
    whatever the eviction count, the stream and (for ``seed: null``) the seed each call resolves."""
    policy = POLICIES[name].with_overrides(seed=seed)
    keys, values, queries = make_tensors(b=2, hkv=2, hq=4, n=30, d=8, w=4, seed=data_seed)
    model = facts_for(policy, 41, 2, 4, 8)  # layers up to 40
    kept = [policy.select(keys, values, queries, layer_idx=layer, evictions=evictions, streams=stream, model=model,
                          prompt_lengths=prompt_for(policy))
            for evictions, stream in calls]
    if not policy.stochastic:
        assert all(torch.equal(kept[0], k) for k in kept[1:]), (name, seed)
    event(f"stochastic={policy.stochastic}")


@pytest.mark.parametrize("budget", [10.5, -3, True, 4])
def test_select_heads_refuses_a_budget_it_cannot_keep(budget):
    """A float budget reached ``topk`` as a TypeError, a negative one a message about the recent
    buffer's 'kept' slots (found from outside); 4 is the recent buffer itself: no candidate."""
    policy = kvpolicy.load_policy("ada-snapkv", budget=16, recent=4, interval=4, window=4)
    k, v, q = make_tensors(b=1, hkv=2, hq=4, n=30, d=8, w=4, seed=2)
    with pytest.raises(ValueError, match=r"budget must be an int above the recent buffer \(4\)"):
        policy.select_heads(k, v, q, budget=budget)
