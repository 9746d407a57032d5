"""Select mode's fast path reads declarations, not types: a scorer that defines
``Scorer.score_packed`` (a plugin's as much as ``quest``'s) lets select mode choose directly
under a selector that declares ``Selector.priority_is_score``, and the choice is exactly the full
pipeline's; a broken ``score_packed`` is refused, naming the scorer, never silently ranked."""

from __future__ import annotations

import re
from typing import ClassVar

import pytest
import torch
from helpers import Contract2Plugin

import kvpolicy
from kvpolicy import EvictingCache, Scorer, SelectionError, load_policy
from kvpolicy.policy import Policy, eviction_input
from kvpolicy.registry import get_registry, reset_registry
from kvpolicy.selection import choose_directly
from kvpolicy.stages import CurrentAttentionScorer, GreedySelector, QuestScorer, StochasticSelector

#: ``score_packed`` calls of the test scorers, by type name (stages are frozen models).
CALLS: list[str] = []


def _key_norms(inp):
    return inp.keys.float().norm(dim=-1)  # [B, Hkv, N]: finite for finite inputs


class DirectNorm(Scorer):
    """A plugin's scorer that declares it scores packed rows: key norms, as ``score`` gives them."""

    type_name: ClassVar[str] = "direct_norm_test"

    def score(self, inp):
        return _key_norms(inp).masked_fill(~inp.slot_valid, 0.0)

    def score_packed(self, inp):
        CALLS.append(self.type_name)
        return _key_norms(inp)  # every slot is valid: no mask


class RescoredNorm(DirectNorm):
    """Overrides ``score`` and inherits ``score_packed``: the promise was made for another
    score, so it runs the full pipeline."""

    type_name: ClassVar[str] = "rescored_norm_test"

    def score(self, inp):
        return -_key_norms(inp)


class RedeclaredNorm(RescoredNorm):
    """Declares again, for its own score."""

    type_name: ClassVar[str] = "redeclared_norm_test"

    def score_packed(self, inp):
        CALLS.append(self.type_name)
        return -_key_norms(inp)


class DecliningNorm(DirectNorm):
    """Scores packed rows only when the candidates are an even number."""

    type_name: ClassVar[str] = "declining_norm_test"

    def score_packed(self, inp):
        if inp.num_candidates % 2 == 0:
            return super().score_packed(inp)  # counts the call
        CALLS.append(self.type_name)
        return None


class BadPacked(DirectNorm):
    """Returns broken packed scores, picked by its ``how`` field."""

    type_name: ClassVar[str] = "bad_packed_test"
    how: str = "per_row"

    def score(self, inp):
        scores = super().score(inp)
        return scores.masked_fill(torch.isinf(inp.keys).any(-1), float("inf")) if self.how == "inf_both" else scores

    def score_packed(self, inp):
        scores = super().score_packed(inp)
        if self.how == "per_row":  # [B, N]: would broadcast
            return scores[:, 0]
        if self.how == "long":
            return scores.long()
        if self.how == "list":
            return scores.tolist()
        if self.how == "nan":  # score is finite there: the two methods disagree
            return scores.index_put((torch.tensor([1]), torch.tensor([0]), torch.tensor([5])), torch.tensor(float("nan")))
        if self.how == "inf_both":  # what score gives too: reported as select reports it
            return scores.masked_fill(torch.isinf(inp.keys).any(-1), float("inf"))
        raise AssertionError(self.how)


class ShiftedGreedy(GreedySelector):
    """Overrides ``priority`` and inherits ``priority_is_score``: not taken at its word."""

    type_name: ClassVar[str] = "shifted_greedy_test"

    def priority(self, scores, inp):
        return -scores


class PlainGreedy(GreedySelector):
    """A subclass that leaves ``priority`` alone keeps greedy's declaration."""

    type_name: ClassVar[str] = "plain_greedy_test"


class DirectPlugin(Contract2Plugin):
    @kvpolicy.hookimpl
    def kvpolicy_stages(self):
        return [DirectNorm, RescoredNorm, RedeclaredNorm, DecliningNorm, BadPacked, ShiftedGreedy, PlainGreedy]


@pytest.fixture(autouse=True)
def plugin():
    reset_registry()
    assert get_registry().register_plugin(DirectPlugin(), name="direct-choice-test")
    CALLS.clear()
    yield
    reset_registry()


def _policy(scorer, selector="greedy", budget=10, recent=3, interval=1, reservations=()) -> Policy:
    return load_policy({
        "name": "direct-choice",
        "mode": "select",
        "schedule": {"budget": budget, "recent": recent, "interval": interval, "window": 1},
        "scorer": scorer if isinstance(scorer, dict) else {"type": scorer},
        "reservations": list(reservations),
        "selector": {"type": selector},
    })


def _input(n=40, budget=10, recent=3, dup=2, seed=0):
    """Keys repeated in blocks of ``dup``: equal norms, so the ranking has exact ties to break."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, n, 8, generator=g)
    keys = keys[:, :, ::dup].repeat_interleave(dup, dim=2)[:, :, :n]
    values, queries = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 4, 1, 8, generator=g)
    return eviction_input(keys, values, queries, budget=budget, recent=recent, seed=0)


# -- (a) a plugin's scorer takes the fast path and keeps what the pipeline keeps ---------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("n", "budget", "recent"), [(40, 10, 3), (13, 10, 3), (30, 12, 0), (25, 9, 8)])
def test_plugin_scorer_chooses_directly_exactly_what_select_from_keeps(seed, n, budget, recent):
    policy = _policy("direct_norm_test", budget=budget, recent=recent)
    inp = _input(n=n, budget=budget, recent=recent, seed=seed)
    got = choose_directly(policy, inp)
    assert CALLS == ["direct_norm_test"]
    assert got is not None and torch.equal(got, policy.select_from(inp))


def test_select_mode_takes_the_plugin_scorers_fast_path_and_attends_what_the_pipeline_chooses(monkeypatch):
    """Two caches on the same tokens: with the scorer's declaration, select mode chooses directly
    at every decode step and ``select_from`` never runs; with ``score_packed`` declining (None),
    every choice runs the full pipeline. They attend the very same slots."""
    g = torch.Generator().manual_seed(3)
    steps = [12] + [1] * 8
    chunks = [(torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 2, t, 8, generator=g),
               torch.randn(2, 4, t, 8, generator=g)) for t in steps]

    def run(policy):
        cache, out = EvictingCache(policy, num_layers=2), []
        for k, v, q in chunks:
            for layer in range(2):
                out.append(cache.step(layer, k, v, q)[2].clone())  # the slots this step attends
        return out

    direct, pipeline = _policy("direct_norm_test", budget=8, recent=2), _policy("direct_norm_test", budget=8, recent=2)
    full_select_from = Policy.select_from
    ran_pipeline = []

    def counting_select_from(self, inp, **kw):
        ran_pipeline.append(1)
        return full_select_from(self, inp, **kw)

    monkeypatch.setattr(Policy, "select_from", counting_select_from)
    fast = run(direct)
    decodes = 2 * sum(1 for t in steps[1:] if t == 1)  # layers x decode steps, each past the budget
    assert len(CALLS) == decodes and not ran_pipeline
    monkeypatch.setattr(DirectNorm, "score_packed", lambda self, inp: None)  # declines: the pipeline
    slow = run(pipeline)
    assert len(ran_pipeline) == decodes
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))
    assert any(not bool(m.all()) for m in fast)  # decode steps attended a choice, not everything


def test_a_declaration_counts_only_for_the_method_it_was_made_for():
    inp = _input()
    # score overridden, score_packed inherited: the full pipeline
    assert choose_directly(_policy("rescored_norm_test"), inp) is None
    assert CALLS == []
    # declared again for the new score: taken, and exact
    policy = _policy("redeclared_norm_test")
    got = choose_directly(policy, inp)
    assert CALLS == ["redeclared_norm_test"] and torch.equal(got, policy.select_from(inp))
    # priority overridden, priority_is_score inherited: the full pipeline
    assert choose_directly(_policy("direct_norm_test", selector="shifted_greedy_test"), inp) is None
    # a greedy subclass that keeps greedy's priority keeps its declaration
    policy = _policy("direct_norm_test", selector="plain_greedy_test")
    assert torch.equal(choose_directly(policy, inp), policy.select_from(inp))


def test_no_fast_path_with_a_reservation_or_another_selector():
    inp = _input()
    sinks = [{"type": "sinks", "n": 2}]
    assert choose_directly(_policy("direct_norm_test", reservations=sinks), inp) is None
    assert choose_directly(_policy("direct_norm_test", selector="stochastic"), inp) is None
    assert CALLS == []
    assert not StochasticSelector.priority_is_score


def test_a_scorer_may_decline_an_input():
    for n in (40, 41):  # 37 candidates: declined; 38: chosen
        policy = _policy("declining_norm_test")
        inp = _input(n=n)
        got = choose_directly(policy, inp)
        assert (got is None) == (inp.num_candidates % 2 == 1)
        if got is not None:
            assert torch.equal(got, policy.select_from(inp))
    assert CALLS == ["declining_norm_test"] * 2


def test_builtins_declare_it_and_plain_scorers_do_not():
    assert QuestScorer.score_packed is not Scorer.score_packed
    assert CurrentAttentionScorer.score_packed is not Scorer.score_packed
    assert GreedySelector.priority_is_score
    inp = _input()
    for name in ("quest", "oracle-topk", "tova@select"):
        policy = load_policy(name, budget=10, recent=3, **({"compress_prompt": False} if "@" in name else {}))
        assert torch.equal(choose_directly(policy, inp), policy.select_from(inp)), name
    # a built-in scorer that declares nothing: the full pipeline
    assert choose_directly(_policy("key_norm"), inp) is None


# -- (b) broken packed scores are refused, naming the scorer -----------------------------------------
BROKEN = {
    "per_row": r"^scorer 'bad_packed_test' score_packed returned scores of shape \(2, 40\), expected \[B, Hkv, N\] = \(2, 2, 40\)",
    "long": r"^scorer 'bad_packed_test' score_packed returned scores of dtype torch\.int64, expected a floating dtype",
    "list": r"^scorer 'bad_packed_test' score_packed returned list, expected scores as a \[B, Hkv, N\] = \(2, 2, 40\) tensor",
    "nan": r"^scorer 'bad_packed_test' score_packed produced non-finite scores \(NaN or inf\) for 1 candidate slot\(s\), "
           r"the first at \[row, head, slot\] = \[1, 0, 5\], where score gives finite ones",
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_broken_packed_scores_are_refused_naming_the_scorer(how):
    with pytest.raises(SelectionError, match=BROKEN[how]):
        choose_directly(_policy({"type": "bad_packed_test", "how": how}), _input())


def test_non_finite_packed_scores_that_score_shares_are_reported_as_select_reports_them():
    policy = _policy({"type": "bad_packed_test", "how": "inf_both"})
    inp = _input()
    inp.keys[0, 1, 3, 2] = float("inf")  # a hand-built input: select mode refuses it at the append
    with pytest.raises(SelectionError, match=r"^keys hold \d+ non-finite entries") as direct:
        choose_directly(policy, inp)
    with pytest.raises(SelectionError) as full:
        policy.select_from(inp)
    assert str(direct.value) == str(full.value)


def test_broken_packed_scores_are_refused_in_a_select_mode_cache():
    policy = _policy({"type": "bad_packed_test", "how": "per_row"}, budget=8, recent=2)
    cache = EvictingCache(policy, num_layers=1)
    k, v, q = torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 4, 12, 8)
    cache.step(0, k, v, q)  # the prompt attends densely: nothing chosen yet
    with pytest.raises(SelectionError, match=re.escape("scorer 'bad_packed_test' score_packed returned scores of shape")):
        cache.step(0, k[:, :, :1], v[:, :, :1], q[:, :, :1])


@pytest.mark.parametrize(("n", "recent", "page"), [(40, 3, 8), (37, 5, 4), (16, 0, 16), (21, 4, 16), (64, 8, 16)])
def test_quests_packed_scores_read_only_the_short_pages_keys(n, recent, page):
    """``QuestScorer.packed_reads == "short_page"``: given the page summaries, the keys of every
    slot but the candidates' last, short page ``[(C // P) * P, C)``, and every value, may be NaN
    (what vLLM's select mode hands it instead of gathering them): the direct choice keeps the
    same slots as with every key and value read."""
    from kvpolicy.selection import page_bounds, short_page_read

    policy = _policy({"type": "quest", "page_size": page}, budget=10, recent=recent)
    assert short_page_read(policy) == page
    g = torch.Generator().manual_seed(n)
    keys, values = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
    queries = torch.randn(2, 4, 1, 8, generator=g)
    pages = page_bounds(keys[:, :, : (n // page) * page], page)
    want = choose_directly(policy, eviction_input(keys, values, queries, budget=10, recent=recent, seed=0,
                                                   key_pages={page: pages}))
    c = n - recent
    short = torch.zeros(n, dtype=torch.bool)
    short[(c // page) * page : c] = True
    hidden = keys.masked_fill(~short[:, None], float("nan"))
    got = choose_directly(policy, eviction_input(hidden, torch.full_like(values, float("nan")), queries, budget=10,
                                                  recent=recent, seed=0, key_pages={page: pages}))
    assert want is not None and got is not None and torch.equal(got, want)
