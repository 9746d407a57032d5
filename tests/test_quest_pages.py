"""Quest at page granularity (``granularity: page``): select mode ranks whole pages by their key
bounds and attends them, read as pages of the cache, plus the tail (the candidates' last, short
page and the recent buffer). The mechanism is a declaration (``Scorer.choice_page_size``), so a
plugin's scorer may choose pages too; bad compositions are refused at load, naming the field."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch
from helpers import Contract2Plugin
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import EvictingCache, PolicyError, Scorer, SelectionError, load_policy
from kvpolicy.policy import eviction_input
from kvpolicy.registry import get_registry, reset_registry
from kvpolicy.selection import choose_pages, page_plan, page_slots
from kvpolicy.stages import GreedySelector

pytestmark = pytest.mark.usefixtures("one_thread")


def _quest(budget: int, recent: int, page: int, granularity: str = "page", **top):
    data = load_policy("quest", budget=budget, recent=recent).config.to_dict()
    return load_policy({**data, **top, "scorer": {**data["scorer"], "page_size": page, "granularity": granularity}})


def _summaries(keys: torch.Tensor, p: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """What select mode's cache keeps: per whole page of ``keys [B, Hkv, N, D]`` its min and max."""
    full = keys.shape[2] // p
    pages = keys[:, :, : full * p].unflatten(2, (full, p))
    return {p: (pages.amin(3), pages.amax(3))}


def _packed_input(keys, values, queries, budget, recent, p):
    return eviction_input(keys, values, queries, budget=budget, recent=recent, seed=0, key_pages=_summaries(keys, p))


# -- the choice, by hand --------------------------------------------------------------------------
def test_page_choice_by_hand_equals_the_slot_level_greedy_choice_when_pages_align():
    """40 slots, recent 8, pages of 8: candidates are 4 whole pages, budget 24 leaves 16 free
    slots = 2 pages. Channel 0 of the keys peaks at 1, 5, 3, 4 in pages 0..3 and the query is
    (1, 0), so the bounds are those peaks: pages 1 and 3 are chosen, then the recent 8."""
    keys = torch.zeros(1, 1, 40, 2)
    for page, peak in enumerate([1.0, 5.0, 3.0, 4.0]):
        keys[0, 0, page * 8 + 3, 0] = peak
    keys[0, 0, :, 1] = torch.linspace(-1, 1, 40)  # the query ignores channel 1
    values = torch.randn(1, 1, 40, 2, generator=torch.Generator().manual_seed(0))
    query = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    assert page_plan(40, 24, 8, 8) == (2, 32)
    inp = _packed_input(keys, values, query, 24, 8, 8)
    policy = _quest(24, 8, 8)
    assert choose_pages(policy, inp).tolist() == [[[1, 3]]]
    want = [*range(8, 16), *range(24, 32), *range(32, 40)]
    assert page_slots(choose_pages(policy, inp), 8, 32, 40).tolist() == [[want]]
    slot_level = _quest(24, 8, 8, granularity="slot").select_from(inp)
    assert slot_level.tolist() == [[want]]


@settings(max_examples=40, deadline=None)
@given(
    pages=st.integers(2, 12), free=st.integers(1, 6), recent=st.integers(1, 10), p=st.sampled_from([1, 2, 4, 8, 16]),
    g=st.integers(1, 3), seed=st.integers(0, 2**16),
)
def test_page_choice_equals_slot_level_greedy_whenever_pages_align(pages, free, recent, p, g, seed):
    """Candidates a whole number of pages and ``budget - recent`` a multiple of ``P``: the slot
    ranking of the repeated page bounds takes whole pages, the same ones (random keys: no ties)."""
    free = min(free, pages - 1)
    n, budget = pages * p + recent, free * p + recent
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, 2, n, 8, generator=gen), torch.randn(2, 2, n, 8, generator=gen)
    queries = torch.randn(2, 2 * g, 1, 8, generator=gen)
    inp = _packed_input(keys, values, queries, budget, recent, p)
    k, tail = page_plan(n, budget, recent, p)
    assert (k, tail) == (free, pages * p)
    got = page_slots(choose_pages(_quest(budget, recent, p), inp), p, tail, n)
    assert torch.equal(got, _quest(budget, recent, p, granularity="slot").select_from(inp))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200), free_pages=st.integers(1, 8), recent=st.integers(0, 12), p=st.integers(1, 16),
    dup=st.integers(0, 3), seed=st.integers(0, 2**16),
)
def test_chosen_slots_are_whole_pages_within_the_budget_with_the_recent_buffer(n, free_pages, recent, p, dup, seed):
    """Any length, any alignment, ties too (repeated keys): the slots attended are whole
    candidate pages and the tail, at most ``budget`` of them, the recent buffer among them, each
    once, ascending; a choice is reproducible."""
    budget = free_pages * p + recent
    n = max(n, budget + 1)  # a choice is made only past the budget
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, n, 4, generator=gen)
    if dup:
        keys = keys[:, :, :: dup + 1].repeat_interleave(dup + 1, dim=2)[:, :, :n]
    values, queries = torch.randn(2, 2, n, 4, generator=gen), torch.randn(2, 4, 1, 4, generator=gen)
    inp = _packed_input(keys, values, queries, budget, recent, p)
    policy = _quest(budget, recent, p)
    chosen = choose_pages(policy, inp)
    k, tail = page_plan(n, budget, recent, p)
    c = n - recent
    assert tail == (c // p) * p and chosen.shape == (2, 2, k) and 0 <= k < c // p
    assert k == (budget - (n - tail)) // p  # as many whole pages as fit beside the tail
    assert bool((chosen < c // p).all()) and bool((chosen[..., 1:] > chosen[..., :-1]).all())
    slots = page_slots(chosen, p, tail, n)
    assert slots.shape[-1] == k * p + n - tail <= budget
    for row in slots.flatten(0, 1).tolist():
        assert row == sorted(set(row))  # no duplicates, ascending
        assert set(range(n - recent, n)) <= set(row)  # the recent buffer
        whole = [j for j in row if j < tail]
        assert all(sum(1 for i in whole if i // p == j // p) == p for j in whole)  # whole pages
    assert torch.equal(chosen, choose_pages(policy, inp))


# -- the cache: attention over the chosen pages ------------------------------------------------------
def _reference_page_step(q, keys, values, budget, recent, p):
    """float64, one decode step of one row, written as loops: each KV head ranks its whole
    candidate pages by ``max_g sum_d max(q_d * min_d, q_d * max_d) / sqrt(D)``, keeps as many as
    fit beside the tail ``[(C // P) * P, N)``, and attends those slots. ``(out [Hq, D], slots per head)``."""
    hq, d = q.shape[0], q.shape[-1]
    hkv, n = keys.shape[0], keys.shape[1]
    g = hq // hkv
    q, keys, values = q.double(), keys.double(), values.double()
    c = n - recent
    whole = c // p
    tail = list(range(whole * p, n))
    k = (budget - len(tail)) // p
    out, chosen = torch.empty(hq, values.shape[-1], dtype=torch.float64), []
    for h in range(hkv):
        bounds = []
        for page in range(whole):
            block = keys[h, page * p : (page + 1) * p]
            lo, hi = block.min(0).values, block.max(0).values
            best = max(sum(max(float(q[h * g + i, j] * lo[j]), float(q[h * g + i, j] * hi[j])) for j in range(d))
                       for i in range(g))
            bounds.append(best / math.sqrt(d))
        top = sorted(sorted(range(whole), key=lambda j: -bounds[j])[:k])
        slots = [s for page in top for s in range(page * p, (page + 1) * p)] + tail
        chosen.append(slots)
        for i in range(g):
            logits = q[h * g + i] @ keys[h, slots].T / math.sqrt(d)
            out[h * g + i] = torch.softmax(logits, -1) @ values[h, slots]
    return out, chosen


@pytest.mark.parametrize(("budget", "recent", "p", "interval"), [(28, 4, 8, 1), (36, 4, 4, 3), (21, 5, 16, 1)])
def test_attention_over_the_chosen_pages_equals_a_float64_reference(budget, recent, p, interval):
    """Step by step through ``EvictingCache``: each decode step's output is float64 attention over
    the reference's slot set, and the slots the step reports attending are that set (the tokens
    appended since the choice join the tail between choices)."""
    data = _quest(budget, recent, p).config.to_dict()
    policy = load_policy({**data, "schedule": {**data["schedule"], "interval": interval}})
    cache = EvictingCache(policy, num_layers=1)
    gen = torch.Generator().manual_seed(budget)
    hist_k, hist_v, checked, chosen_at, ref = [], [], 0, None, []
    for step in range(70):
        t = 20 if step == 0 else 1
        k, v = torch.randn(2, 2, t, 8, generator=gen), torch.randn(2, 2, t, 8, generator=gen)
        q = torch.randn(2, 4, t, 8, generator=gen)
        hist_k.append(k)
        hist_v.append(v)
        _, _, attended = cache.step(0, k, v, q)
        all_k, all_v = torch.cat(hist_k, 2), torch.cat(hist_v, 2)
        n = all_k.shape[2]
        if n <= budget:
            continue
        if bool(cache.layers[0].group.select.reselect.all()):  # chosen now, by this step's query
            chosen_at = n
            ref = [_reference_page_step(q[row, :, 0], all_k[row], all_v[row], budget, recent, p)[1] for row in range(2)]
        assert chosen_at is not None
        for row in range(2):
            for h in range(2):
                want = ref[row][h] + list(range(chosen_at, n))
                assert attended[row, h].nonzero().flatten().tolist() == want, (step, row, h)
        checked += 1
    assert checked > 40


@pytest.mark.parametrize(("budget", "recent", "p"), [(28, 4, 8), (20, 4, 16), (13, 5, 4)])
def test_attention_output_equals_float64_attention_over_the_reference_pages(budget, recent, p):
    policy = _quest(budget, recent, p)
    cache = EvictingCache(policy, num_layers=1)
    gen = torch.Generator().manual_seed(p)
    hist_k, hist_v, checked = [], [], 0
    for step in range(60):
        t = 10 if step == 0 else 1
        k, v = torch.randn(2, 2, t, 8, generator=gen), torch.randn(2, 2, t, 8, generator=gen)
        q = torch.randn(2, 4, t, 8, generator=gen)
        hist_k.append(k)
        hist_v.append(v)
        out = cache.attend(0, q, k, v)
        all_k, all_v = torch.cat(hist_k, 2), torch.cat(hist_v, 2)
        if all_k.shape[2] <= budget:
            continue
        for row in range(2):
            want, _ = _reference_page_step(q[row, :, 0], all_k[row], all_v[row], budget, recent, p)
            torch.testing.assert_close(out[row, :, 0].double(), want, atol=1e-5, rtol=1e-5)
        checked += 1
    assert checked > 30
    group = cache.layers[0].group
    assert group.buffers.capacity % p == 0  # buffers of whole pages
    assert cache.layers[0].length == 69 and cache.stats()[0].evictions == 0  # every token kept


def test_padded_rows_choose_and_attend_as_each_row_alone():
    """A left-padded batch (rows holding different counts choose apart): every decode step's
    output and attended slots of each row equal the row's run alone, exactly (the prompt's
    attention to rounding: SDPA's kernels over a padded length may round differently)."""
    policy = _quest(24, 4, 4)
    gen = torch.Generator().manual_seed(12)
    pads = [0, 5, 2]
    steps = [torch.randn(3, 2, 14, 8, generator=gen)] + [torch.randn(3, 2, 1, 8, generator=gen) for _ in range(40)]
    values = [torch.randn_like(k) for k in steps]
    queries = [torch.randn(3, 4, k.shape[2], 8, generator=gen) for k in steps]
    token_valid = torch.ones(3, 14, dtype=torch.bool)
    for row, pad in enumerate(pads):
        token_valid[row, :pad] = False

    batch = EvictingCache(policy, num_layers=2)
    alone = [EvictingCache(policy, num_layers=2) for _ in pads]
    for i, (k, v, q) in enumerate(zip(steps, values, queries, strict=True)):
        for layer in range(2):
            out = batch.attend(layer, q, k, v, token_valid if i == 0 else None)
            for row, cache in enumerate(alone):
                real = token_valid[row] if i == 0 else torch.ones(1, dtype=torch.bool)
                one = cache.attend(layer, q[row:row + 1, :, real], k[row:row + 1, :, real], v[row:row + 1, :, real])
                if i == 0:  # SDPA over a padded prompt may round apart from the row alone (AMD EPYC)
                    torch.testing.assert_close(out[row:row + 1, :, -1:], one[:, :, -1:], atol=1e-6, rtol=1e-6)
                else:  # chosen pages, and attention over them, exactly the row's own
                    assert torch.equal(out[row:row + 1, :, -1:], one[:, :, -1:]), (i, layer, row)
            if i > 0:
                group = batch.layers[layer].group
                for row, cache in enumerate(alone):
                    assert batch.layers[layer].counts[row] == cache.layers[layer].counts[0]
                    mine = cache.layers[layer].group
                    if bool(group.select.reselect[row]) and batch.layers[layer].counts[row] > 24:
                        k_row, _ = page_plan(batch.layers[layer].counts[row], 24, 4, 4)
                        assert torch.equal(group.select.pages[group.member[layer], row, :, :k_row],
                                           mine.select.pages[mine.member[layer], 0, :, :k_row])
    assert batch.layers[0].counts == [54 - pad for pad in pads]


def test_a_tiny_model_decodes_each_padded_row_as_alone():
    pytest.importorskip("transformers")
    from hf_util import assert_rows_decode_as_alone, fresh, left_padded_prompt, tiny_qwen3

    model = fresh(tiny_qwen3(layers=2, vocab=512))
    ids, mask = left_padded_prompt(512, 2, 20, (0, 7), 2)
    assert_rows_decode_as_alone(model, _quest(32, 8, 8), ids, mask, 48)


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("change", "match"), [
    ({"budget": 30, "recent": 8, "page_size": 8}, r"scorer\.page_size 8 with granularity page must divide schedule\.budget - schedule\.recent \(30 - 8 = 22\)"),
    ({"budget": 20, "recent": 8, "page_size": 16}, r"needs schedule\.budget \(20\) to hold the recent buffer \(8\) and at least one whole page: budget >= 24"),
    ({"budget": 24, "recent": 16, "page_size": 16}, r"budget >= 32"),
])
def test_page_sizes_that_do_not_fit_the_budget_are_refused_naming_the_field(change, match):
    with pytest.raises(PolicyError, match=match):
        _quest(change["budget"], change["recent"], change["page_size"])
    _quest(change["budget"], change["recent"], change["page_size"], granularity="slot")  # slots: any budget


def test_compositions_a_page_choice_cannot_serve_are_refused_at_load():
    data = _quest(40, 8, 8).config.to_dict()
    with pytest.raises(PolicyError, match=r"chooses whole pages of 8 slots \(granularity: page\), which only select mode does"):
        load_policy({**data, "mode": "evict"})
    assert load_policy("quest@evict").mode == "evict"  # the shipped quest ranks slots: it serves evict mode
    with pytest.raises(PolicyError, match="reservations cannot protect slots of a page choice"):
        load_policy({**data, "reservations": [{"type": "sinks", "n": 4}]})
    per_head = load_policy("ada-snapkv").config.to_dict()["allocation"]
    with pytest.raises(PolicyError, match=r"allocation '\w+' gives heads different counts"):
        load_policy({**data, "allocation": per_head})
    with pytest.raises(PolicyError, match=r"granularity"):
        load_policy({**data, "scorer": {**data["scorer"], "granularity": "block"}})


def test_policy_select_refuses_a_page_choice_naming_it():
    keys, values, queries = torch.randn(1, 2, 60, 8), torch.randn(1, 2, 60, 8), torch.randn(1, 4, 1, 8)
    with pytest.raises(SelectionError, match=r"policy 'quest' chooses whole pages of 8 slots .*Policy\.select ranks slots"):
        _quest(40, 8, 8).select(keys, values, queries)
    assert _quest(40, 8, 8, granularity="slot").select(keys, values, queries).shape == (1, 2, 40)


def test_the_shipped_quest_ranks_slots():
    """Documented choice (docs/selection.md): the shipped ``quest`` keeps slot granularity."""
    assert load_policy("quest").chooses_pages is None
    assert _quest(1024, 16, 16).chooses_pages == 16


# -- the declaration, for any scorer ------------------------------------------------------------------
class PageNorm(Scorer):
    """A plugin's scorer that chooses whole pages of 4 by their largest key norm."""

    type_name: ClassVar[str] = "page_norm_test"
    broken: bool = False

    @property
    def choice_page_size(self) -> int | None:
        return 4

    def score(self, inp):
        return inp.keys.float().norm(dim=-1)

    def score_pages(self, inp):
        full = inp.num_candidates // 4
        norms = inp.keys[:, :, : full * 4].float().norm(dim=-1).unflatten(-1, (full, 4)).amax(-1)
        return norms[:, 0] if self.broken else norms


class ReversedGreedy(GreedySelector):
    """Overrides ``priority`` and inherits ``priority_is_score``: not taken at its word."""

    type_name: ClassVar[str] = "reversed_greedy_test"

    def priority(self, scores, inp):
        return -scores


class PagePlugin(Contract2Plugin):
    @kvpolicy.hookimpl
    def kvpolicy_stages(self):
        return [PageNorm, ReversedGreedy]


@pytest.fixture
def page_plugin():
    reset_registry()
    assert get_registry().register_plugin(PagePlugin(), name="page-choice-test")
    yield
    reset_registry()


def _norm_policy(broken=False):
    return load_policy({
        "name": "page-norm", "mode": "select", "schedule": {"budget": 12, "recent": 4, "interval": 1, "window": 1},
        "scorer": {"type": "page_norm_test", "broken": broken}, "selector": {"type": "greedy"},
    })


@pytest.mark.usefixtures("page_plugin")
def test_a_plugin_scorer_declares_a_page_choice_and_select_mode_attends_its_pages():
    cache = EvictingCache(_norm_policy(), num_layers=1)
    gen = torch.Generator().manual_seed(1)
    hist = []
    for step in range(20):
        t = 9 if step == 0 else 1
        k, q = torch.randn(1, 2, t, 8, generator=gen), torch.randn(1, 4, t, 8, generator=gen)
        hist.append(k)
        _, _, attended = cache.step(0, k, k, q)
        keys = torch.cat(hist, 2)
        n = keys.shape[2]
        if n <= 12:
            continue
        k_pages, tail = page_plan(n, 12, 4, 4)
        norms = keys[0, :, :tail].norm(dim=-1).unflatten(-1, (tail // 4, 4)).amax(-1)
        for h in range(2):
            top = sorted(norms[h].topk(k_pages).indices.tolist())
            want = [s for page in top for s in range(4 * page, 4 * page + 4)] + list(range(tail, n))
            assert attended[0, h].nonzero().flatten().tolist() == want


@pytest.mark.usefixtures("page_plugin")
def test_a_selector_that_does_not_rank_by_the_score_is_refused_for_a_page_choice():
    data = _quest(40, 8, 8).config.to_dict()
    with pytest.raises(PolicyError, match=r"selector 'reversed_greedy_test' does not rank by the score"):
        load_policy({**data, "selector": {"type": "reversed_greedy_test"}})


@pytest.mark.usefixtures("page_plugin")
def test_a_broken_page_score_is_refused_naming_the_scorer():
    cache = EvictingCache(_norm_policy(broken=True), num_layers=1)
    cache.step(0, torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 4, 16, 8))
    with pytest.raises(SelectionError, match=r"scorer 'page_norm_test' score_pages returned page scores of shape \(1, 3\), "
                                             r"expected \[B, Hkv, C // P\] = \(1, 2, 3\)"):
        cache.step(0, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 4, 1, 8))
