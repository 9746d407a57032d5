"""Select mode: every token stays cached and each decode step attends only the slots the policy's
stages choose (oracle top-k, Quest pages, or any eviction policy's stages)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")
from helpers import make_input  # noqa: E402
from hf_util import assert_rows_decode_as_alone, fresh, left_padded_prompt, tiny_qwen3  # noqa: E402
from hf_util import generate as _generate  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvpolicy import EvictingCache, KVPolicyCache, PolicyError, SelectionError, load_policy  # noqa: E402
from kvpolicy.stages import QuestScorer  # noqa: E402

VOCAB = 512
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3():
    return tiny_qwen3(layers=2, vocab=VOCAB)


_fresh = fresh


def _prompt(batch=2, length=20, pads=(0, 5), seed=0):
    return left_padded_prompt(VOCAB, batch, length, pads, seed)


SELECT_POLICIES = {
    "oracle-topk": {"budget": 24},
    "quest": {"budget": 32, "recent": 8, "page_size": None},
    "vase-attnv@select": {"budget": 32, "recent": 8, "interval": 4, "window": 8},
    # Per-head budgets: each head chooses its own count out of the layer's pool.
    "ada-snapkv@select": {"budget": 32, "recent": 8, "interval": 4, "window": 8},
    "ada-vase-attnv@select": {"budget": 32, "recent": 8, "interval": 4, "window": 8},
}


def _select_policy(name: str, **extra):
    if name == "vase-attnv@select":
        return load_policy("vase-attnv", mode="select", **{**SELECT_POLICIES[name], **extra})
    over = {k: v for k, v in SELECT_POLICIES[name].items() if v is not None and k != "page_size"}
    return load_policy(name, **{**over, **extra})


# -- the policy file ------------------------------------------------------------------------------
def test_mode_is_validated_like_any_field():
    assert load_policy("oracle-topk").config.mode == "select"
    assert load_policy("snapkv").config.mode == "evict"
    assert load_policy("snapkv", mode="select").config.mode == "select"
    with pytest.raises(PolicyError, match="mode"):
        load_policy("snapkv", mode="sparse")
    with pytest.raises(PolicyError, match="compress_prompt"):
        load_policy("rkv", mode="select", compress_prompt=True)
    assert "mode: select" in load_policy("quest").to_yaml()


# -- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["oracle-topk", "quest", "vase-attnv@select", "ada-snapkv@select"])
def test_budget_above_the_length_is_token_identical_to_the_full_cache(qwen3, name):
    ids, mask = _prompt(seed=1)
    ref_model, model = _fresh(qwen3), _fresh(qwen3)
    ref = _generate(ref_model, DynamicCache(config=ref_model.config), ids, mask, 40)
    cache = KVPolicyCache(_select_policy(name, budget=256, recent=8), model)
    assert torch.equal(_generate(model, cache, ids, mask, 40), ref)


def _reference_oracle_step(q, keys, values, budget, recent):
    """float64, one decode step of one row: full attention restricted to each KV head's ``budget``
    slots of largest attention mass (mean over its query heads), the newest ``recent`` forced."""
    hq, d = q.shape[0], q.shape[-1]
    hkv, n = keys.shape[0], keys.shape[1]
    g = hq // hkv
    q, keys, values = q.double(), keys.double(), values.double()
    out = torch.empty(hq, d, dtype=torch.float64)
    for h in range(hkv):
        logits = (q[h * g:(h + 1) * g] @ keys[h].T) / math.sqrt(d)  # [G, N]
        mass = torch.softmax(logits, -1).mean(0)
        forced = set(range(n - recent, n))
        ranked = [j for j in mass.argsort(descending=True).tolist() if j not in forced]
        keep = sorted(forced | set(ranked[: budget - len(forced)]))
        for i in range(g):
            w = torch.softmax(logits[i, keep], -1)
            out[h * g + i] = w @ values[h, keep]
    return out


def test_oracle_topk_attends_exactly_the_top_slots_of_the_true_attention():
    budget, recent = 12, 1
    policy = load_policy("oracle-topk", budget=budget, recent=recent)
    cache = EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(3)
    hist_k, hist_v = [], []
    for step in range(40):
        t = 6 if step == 0 else 1
        k, v, q = torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 4, t, 8, generator=g)
        hist_k.append(k)
        hist_v.append(v)
        out = cache.attend(0, q, k, v)
        all_k, all_v = torch.cat(hist_k, 2), torch.cat(hist_v, 2)
        if all_k.shape[2] <= budget:
            continue
        for row in range(2):
            want = _reference_oracle_step(q[row, :, 0], all_k[row], all_v[row], budget, recent)
            torch.testing.assert_close(out[row, :, 0].double(), want, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].length == 45  # every token kept


def test_select_mode_step_reports_the_selection_as_validity():
    policy = load_policy("oracle-topk", budget=10)
    cache = EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(4)
    for step in range(20):
        t = 5 if step == 0 else 1
        k, v, q = torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 4, t, 8, generator=g)
        keys, _, valid = cache.step(0, k, v, q)
    assert keys.shape[2] == 24 and valid.sum(-1).tolist() == [[10, 10]]
    assert bool(valid[..., -1].all())  # the recent buffer (the current token)


# -- Quest -----------------------------------------------------------------------------------------
@given(
    n=st.integers(2, 70), page=st.integers(1, 9), d=st.integers(1, 8), g=st.integers(1, 3),
    seed=st.integers(0, 2**16), pad=st.integers(0, 10),
)
def test_quest_page_bound_is_an_upper_bound_of_every_key_in_the_page(n, page, d, g, seed, pad):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, n, d, generator=gen) * 3
    queries = torch.randn(2, 2 * g, 1, d, generator=gen) * 3
    slot_valid = torch.arange(n)[None, :].expand(2, n) >= torch.tensor([[0], [min(pad, n - 1)]])
    inp = make_input(keys, keys, queries, recent=1, slot_valid=slot_valid)
    stage = QuestScorer(page_size=page)
    bounds = stage.page_bounds(inp)  # [B, Hkv, G, pages]
    c = inp.num_candidates
    dots = torch.einsum("bhgd,bhnd->bhgn", queries[:, :, 0].view(2, 2, g, d), keys[:, :, :c])
    per_slot = bounds.repeat_interleave(page, -1)[..., :c]
    ok = (dots <= per_slot + 1e-4) | ~slot_valid[:, None, None, :c]
    assert bool(ok.all())
    # The bound is tight for a page of one slot.
    if page == 1:
        valid = slot_valid[:, None, None, :c].expand_as(dots)
        torch.testing.assert_close(per_slot[valid], dots[valid], atol=1e-4, rtol=1e-4)


def test_quest_chooses_whole_pages_by_their_bound():
    budget, recent, page = 40, 8, 8  # 32 free slots = 4 pages; 64 candidates = 8 pages
    policy = load_policy("quest", budget=budget, recent=recent)
    policy = load_policy({**policy.config.to_dict(), "scorer": {"type": "quest", "page_size": page}})
    g = torch.Generator().manual_seed(5)
    keys, values, queries = torch.randn(1, 2, 72, 16, generator=g), torch.randn(1, 2, 72, 16, generator=g), torch.randn(1, 4, 1, 16, generator=g)
    kept = policy.select(keys, values, queries)
    inp = make_input(keys, values, queries, recent=recent, budget=budget)
    bounds = QuestScorer(page_size=page).page_bounds(inp).amax(2)  # [1, Hkv, 8]
    for h in range(2):
        cand = [j for j in kept[0, h].tolist() if j < 64]
        pages = sorted({j // page for j in cand})
        assert len(cand) == 32 and all(sum(1 for j in cand if j // page == p) == page for p in pages)
        assert pages == sorted(bounds[0, h].topk(4).indices.tolist())


# -- select mode wherever eviction works --------------------------------------------------------------
@pytest.mark.parametrize("name", ["oracle-topk", "quest", "vase-attnv@select", "ada-snapkv@select", "ada-vase-attnv@select"])
def test_select_mode_padded_rows_decode_as_alone(qwen3, name):
    ids, mask = _prompt(pads=(0, 7), seed=2)
    assert_rows_decode_as_alone(_fresh(qwen3), _select_policy(name), ids, mask, 48)


def test_select_mode_keeps_every_token_and_reuses_a_selection_between_intervals():
    policy = _select_policy("vase-attnv@select")  # interval 4: a new selection every 4 steps
    cache = EvictingCache(policy, num_layers=2)
    g = torch.Generator().manual_seed(6)
    chosen = []
    for step in range(60):
        t = 10 if step == 0 else 1
        k, v, q = torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 4, t, 8, generator=g)
        for layer in range(2):
            cache.attend(layer, q, k, v)
        group = cache.layers[0].group
        chosen.append(bool(group.select.reselect.any()))
    assert cache.layers[0].length == 69 and cache.stats()[0].evictions == 0
    first = chosen.index(True)
    assert chosen[first:] == [(i % 4 == 0) for i in range(len(chosen) - first)]


def test_eval_stream_feeds_select_mode_step_by_step_once_over_budget(qwen3):
    from kvpolicy.eval.decoding import Stream

    model = _fresh(qwen3)
    policy = _select_policy("oracle-topk")
    ids = torch.randint(3, VOCAB, (80,), generator=torch.Generator().manual_seed(7)).tolist()
    chunked, single = Stream(model, policy), Stream(model, policy)
    got = torch.zeros(60, VOCAB)

    def keep(offset, logits):
        got[offset : offset + logits.shape[0]] = logits

    chunked.feed(ids[:20])
    chunked.feed(ids[20:], keep)
    single.feed(ids[:20])
    want = torch.stack([single.feed([t]) for t in ids[20:]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["oracle-topk", "quest", "vase-attnv@select"])
def test_a_selection_is_policy_select_on_the_cache_state(name):
    """Each selection of each layer is ``Policy.select`` on the cache's slots and window, given the
    layer and the row's selection count (stochastic selection included)."""
    policy = _select_policy(name, seed=3)
    cache = EvictingCache(policy, num_layers=2)
    g = torch.Generator().manual_seed(8)
    checked = 0
    for step in range(50):
        t = 10 if step == 0 else 1
        k, v, q = torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 4, t, 8, generator=g)
        for layer in range(2):
            cache.attend(layer, q, k, v)
            view, group = cache.layers[layer], cache.layers[layer].group
            if bool(group.select.reselect.all()):
                window, wvalid = view.window()
                want = policy.select(view.keys, view.values, window, query_valid=wvalid, layer_idx=layer,
                                     evictions=view.evictions, streams=view.streams)
                assert torch.equal(group.select.selection[group.member[layer]], want), (name, step, layer)
                checked += 1
    assert checked >= 10


@pytest.mark.parametrize("padded", [True, False])
def test_quest_page_summaries_kept_by_the_cache_equal_the_keys_reduction(padded):
    """In select mode the cache keeps each page's min/max as tokens arrive (padded rows and a
    page size that does not divide the chunk included; unpadded rows fold each decoded key into
    its page); Quest reading them scores exactly as Quest reducing the keys, so the cache's
    choice is ``Policy.select`` on its state."""
    base = load_policy("quest", budget=40, recent=8).config.to_dict()
    policy = load_policy({**base, "scorer": {"type": "quest", "page_size": 7}})
    assert policy.key_page_sizes == frozenset({7})
    cache = EvictingCache(policy, num_layers=2)
    g = torch.Generator().manual_seed(9)
    token_valid = torch.ones(2, 12, dtype=torch.bool)
    token_valid[1, :5] = not padded
    checked = 0
    for step in range(70):
        t = 12 if step == 0 else 1
        k, v, q = torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 4, t, 8, generator=g)
        for layer in range(2):
            cache.attend(layer, q, k, v, token_valid if step == 0 else None)
            group = cache.layers[layer].group
            lo, hi = group.select.key_pages[7]
            i = group.member[layer]
            for row, count in enumerate(group.counts.tolist()):
                full = count // 7
                keys = group.buffers.keys[i, row, :, : full * 7].unflatten(1, (full, 7))
                assert torch.equal(lo[i, row, :, :full], keys.amin(2))
                assert torch.equal(hi[i, row, :, :full], keys.amax(2))
            if bool(group.select.reselect.any()):
                view = cache.layers[layer]
                window, wvalid = view.window()
                for row in range(2):
                    if not bool(group.select.reselect[row]):
                        continue
                    count = int(group.counts[row])
                    want = policy.select(view.keys[row:row + 1, :, :count], view.values[row:row + 1, :, :count],
                                         window[row:row + 1], query_valid=wvalid[row:row + 1], layer_idx=layer)
                    assert torch.equal(group.select.selection[i, row:row + 1], want)
                    checked += 1
    assert checked > 20


# -- memory ----------------------------------------------------------------------------------------
def _full_bytes(layers, heads, n, d, dtype_bytes=4):
    return layers * heads * n * d * dtype_bytes * 2


@pytest.mark.parametrize("name", ["oracle-topk", "quest"])
def test_select_mode_holds_the_full_cache_plus_a_bounded_margin(name):
    """Every token is kept, in buffers that grow geometrically: from 512 tokens on the cache holds
    at most 1.25x a full cache's keys and values (page summaries, positions and the selection
    included), and reallocates O(log N) times, not at every step."""
    layers, heads, d = 2, 2, 64
    cache = EvictingCache(load_policy(name, budget=64), num_layers=layers)
    g = torch.Generator().manual_seed(10)
    capacities, n = set(), 0
    while n < 3000:
        # A prompt, one decode step (the first choice: the selection is allocated), then chunks
        # of 3 tokens (attended densely: growth is what is tested, and choosing is slow).
        t = 100 if n == 0 else 1 if n == 100 else 3
        k, q = torch.randn(1, heads, t, d, generator=g), torch.randn(1, 2 * heads, t, d, generator=g)
        for layer in range(layers):
            cache.attend(layer, q, k, k)
        n += t
        group = cache.layers[0].group
        capacities.add(group.buffers.capacity)
        assert group.buffers.capacity >= n
        if n >= 512:
            assert cache.memory_bytes() <= 1.25 * _full_bytes(layers, heads, n, d), n
    assert len(capacities) <= 40  # 1.1x steps from 100 to 3,000 tokens: about 36
    assert cache.layers[0].group.select._selection is not None


def test_select_growth_is_configurable_and_checked():
    k = torch.randn(1, 2, 1000, 8)
    for growth, capacity in ((1.1, 1100), (2.0, 2000), (1.001, 1016)):
        cache = EvictingCache(load_policy("quest", budget=64), num_layers=1, select_growth=growth)
        cache.step(0, k, k, torch.randn(1, 4, 1000, 8))
        assert cache.layers[0].group.buffers.capacity == capacity  # at least 16 slots of headroom
    for bad in (1.0, 0.5, float("nan"), float("inf"), 17, "2", True):
        with pytest.raises(ValueError, match="select_growth"):
            EvictingCache(load_policy("quest"), num_layers=1, select_growth=bad)


# -- a step whose cost follows what it reads --------------------------------------------------------
def _page_summaries(keys, p):
    """``(min, max)`` of every whole page of ``keys [B, Hkv, N, D]``, as the cache keeps them."""
    full = keys.shape[2] // p
    pages = keys[:, :, : full * p].unflatten(2, (full, p))
    return pages.amin(3), pages.amax(3)


@given(
    n=st.integers(20, 200), budget=st.integers(10, 60), recent=st.integers(1, 9), page=st.integers(1, 17),
    g=st.integers(1, 3), dup=st.integers(0, 3), seed=st.integers(0, 2**16), oracle=st.booleans(),
)
def test_direct_choice_keeps_exactly_what_policy_select_keeps(n, budget, recent, page, g, dup, seed, oracle):
    """Select mode's direct path (page scores written into the priorities, the oracle's single
    ``q . K`` pass) keeps the very slots ``Policy.select_from`` keeps: ties too (repeated keys
    give equal oracle masses; Quest's scores are equal within a page), since the same ``topk``
    ranks the same priorities."""
    from kvpolicy.policy import eviction_input
    from kvpolicy.selection import choose_directly

    budget = max(budget, recent + 1)
    if oracle:
        policy = load_policy("oracle-topk", budget=budget, recent=recent)
    else:
        base = load_policy("quest", budget=budget, recent=recent).config.to_dict()
        policy = load_policy({**base, "scorer": {"type": "quest", "page_size": page}})
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, n, 8, generator=gen)
    if dup:  # blocks of identical keys: exact ties
        keys = keys[:, :, :: dup + 1].repeat_interleave(dup + 1, dim=2)[:, :, :n]
    values, queries = torch.randn(2, 2, n, 8, generator=gen), torch.randn(2, 2 * g, 1, 8, generator=gen)
    inp = eviction_input(keys, values, queries, budget=budget, recent=recent, seed=0,
                         key_pages={page: _page_summaries(keys, page)})
    want = policy.select_from(inp)
    got = choose_directly(policy, inp)
    assert got is not None and torch.equal(got, want)


def test_direct_choice_is_only_for_the_selection_native_compositions():
    from kvpolicy.selection import choose_directly

    keys, values, queries = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 4, 4, 8)
    from kvpolicy.policy import eviction_input

    inp = eviction_input(keys, values, queries, budget=20, recent=4, seed=0)
    for name in ("vase-attnv", "snapkv"):
        assert choose_directly(load_policy(name, budget=20, recent=4, window=4), inp) is None
    assert choose_directly(load_policy("streamingllm", budget=20), inp) is None
    with_sinks = load_policy({**load_policy("quest", budget=20, recent=4).config.to_dict(),
                              "reservations": [{"type": "sinks", "n": 4}]})
    assert choose_directly(with_sinks, inp) is None


@pytest.mark.parametrize("target", ["keys", "values", "queries"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_select_mode_refuses_non_finite_input_at_append(target, bad):
    """Select mode checks each token once, as it enters the cache (not the whole cache at each
    choice): a NaN or inf key, value or window query is refused at the append that brings it,
    naming the layer and the input, and the cache is left as it was."""
    policy = load_policy("oracle-topk", budget=8)
    cache = EvictingCache(policy, num_layers=2)
    g = torch.Generator().manual_seed(11)

    def step(t, poison=False):
        k, v, q = torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 4, t, 8, generator=g)
        for layer in range(2):
            x = {"keys": k, "values": v, "queries": q}
            if poison and layer == 1:
                x[target] = x[target].clone()
                x[target][0, 1, t - 1, 3] = bad
            cache.attend(layer, x["queries"], x["keys"], x["values"])

    step(12)
    step(1)
    held = cache.layers[1].keys.clone()
    kind = "NaN" if bad != bad else "+inf"
    with pytest.raises(SelectionError, match=rf"layer 1: .*{target}.* 1 non-finite entries \({re.escape(kind)}\), the first at \[row, head, token, channel\] = \[0, 1, 0, 3\]"):
        step(1, poison=True)
    assert torch.equal(cache.layers[1].keys, held)  # nothing of the refused step entered layer 1


def test_select_mode_does_not_read_padding_it_never_stores():
    """Padding tokens are never stored in select mode, so garbage in them is not refused."""
    cache = EvictingCache(load_policy("quest", budget=8, recent=2), num_layers=1)
    k, v, q = torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 4, 12, 8)
    token_valid = torch.ones(2, 12, dtype=torch.bool)
    token_valid[1, :3] = False
    k[1, :, :3] = float("nan")
    cache.attend(0, q, k, v, token_valid)
    assert cache.layers[0].counts == [12, 9]
    out = cache.attend(0, torch.randn(2, 4, 1, 8), torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("name", ["oracle-topk", "quest", "snapkv"])
def test_values_wider_than_keys_in_either_mode(name):
    """Values ``[B, Hkv, T, Dv]`` with ``Dv != D``: a decode step of grouped queries (``G > 1``)
    shaped its output with the queries' width and failed, in either mode, and the selecting step
    allocated its output the same way. Attention is linear in the values
    and these choices read keys and queries only, so the output of values ``[..., 16]`` is the
    outputs of their two halves, each attended alone, side by side."""
    torch.manual_seed(3)
    steps = [(torch.randn(2, 4, t, 8), torch.randn(2, 2, t, 8), torch.randn(2, 2, t, 16)) for t in (24, 1, 1, 1, 1, 1)]
    outputs = []
    for part in (slice(None), slice(0, 8), slice(8, 16)):
        small = {"recent": 4, "interval": 4, "window": 4} if name == "snapkv" else {}
        cache = EvictingCache(load_policy(name, budget=20, **small), 1)
        outputs.append([cache.attend(0, q, k, v[..., part]) for q, k, v in steps])
    for whole, first, second in zip(*outputs, strict=True):
        assert whole.shape[-1] == 16
        torch.testing.assert_close(whole, torch.cat([first, second], -1), rtol=0, atol=1e-6)
