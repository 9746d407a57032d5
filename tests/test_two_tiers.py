"""Two tiers (issue 42), the core's promises: exact at both ends of the recall budget, the recall
choice against a naive reference, padded rows and seeded runs, a bounded slow tier and its
counters, properties over random settings, and the refusals at load.

- Low end: with ``recall.budget: 0`` a two-tier policy is its evicting policy, token for token
  through ``generate()`` and slot for slot at every step (greedy and stochastic eviction).
- High end: a slow tier that holds everything and a recall buffer that holds the whole evicted
  history attend every position seen, as select mode with the same scorer and page size does, and
  the attention outputs are full attention's.
- The recall's choice is the top pages of a float64 reference computed from the slow tier's stored
  keys (Quest's bound, the landmark's ``q . mean k``), never from the tier's summaries.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
from hf_util import assert_rows_decode_as_alone, fresh, left_padded_prompt, tiny_qwen3  # noqa: E402
from hf_util import generate as _generate  # noqa: E402
from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402

from kvpolicy import EvictingCache, KVPolicyCache, PolicyError, load_policy  # noqa: E402
from kvpolicy.attend import attend  # noqa: E402
from kvpolicy.layouts.two_tier import TwoTierRows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97
B, HKV, HQ, D = 2, 2, 4, 16
LAYERS = 2


# -- policies ----------------------------------------------------------------------------------------------
def _spec(name: str, schedule: dict[str, Any], recall: dict[str, Any] | None = None) -> dict[str, Any]:
    """The built-in ``name`` as a dict, its schedule overridden, with ``recall`` (or without one)."""
    data = load_policy(name).config.to_dict()
    data["schedule"] = {**data["schedule"], **schedule}
    data.pop("recall", None)
    if recall is not None:
        data["recall"] = recall
    return data


#: SnapKV's greedy eviction, and VaSE-AttnV's sampled one (reservations, then a stochastic selector).
GREEDY, STOCHASTIC = "snapkv", "vase-attnv"


def _layout(cache: EvictingCache, layer: int) -> TwoTierRows:
    layout = cache.layers[layer].group.layout
    assert isinstance(layout, TwoTierRows)
    return layout


def _qkv(g: torch.Generator, t: int, b: int = B) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(b, HQ, t, D, generator=g), torch.randn(b, HKV, t, D, generator=g),
            torch.randn(b, HKV, t, D, generator=g))


# -- 1. the low end: recall budget 0 is the evicting policy, through generate() ---------------------------
class _Snapshots(StoppingCriteria):
    """After every generated token: each layer's kept positions (never stops generation)."""

    def __init__(self, cache: KVPolicyCache) -> None:
        self.cache = cache
        self.taken: list[list[torch.Tensor]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.taken.append([layer.positions.clone() for layer in self.cache.evicting.layers])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _generate_with_snapshots(model, policy, ids, mask, n: int, seed: int | None = None):
    m = fresh(model)
    cache = KVPolicyCache(policy, m, seed=seed)
    snaps = _Snapshots(cache)
    out = _generate(m, cache, ids, mask, n, stopping_criteria=StoppingCriteriaList([snaps]))
    return out, cache, snaps.taken


@pytest.mark.parametrize("name", [GREEDY, STOCHASTIC])
def test_recall_budget_zero_generates_and_keeps_exactly_what_the_evicting_policy_does(name):
    """A left-padded batch of two, 80 new tokens, evictions every 8: the same tokens and, after
    every token, the same kept positions on every layer; the slow tier fills and nothing moves."""
    model = tiny_qwen3(LAYERS, VOCAB)
    ids, mask = left_padded_prompt(VOCAB, batch=2, length=40, pads=(0, 7))
    schedule = {"budget": 32, "recent": 8, "interval": 8, "window": 8}
    recall = {"budget": 0, "page_size": 8, "interval": 1, "scorer": {"type": "quest", "page_size": 8}}
    evicting = load_policy(_spec(name, schedule))
    two_tier = load_policy(_spec(name, schedule, recall))
    assert evicting.config.recall is None and two_tier.config.recall is not None

    want, plain, want_snaps = _generate_with_snapshots(model, evicting, ids, mask, 80)
    got, tiered, got_snaps = _generate_with_snapshots(model, two_tier, ids, mask, 80)
    assert torch.equal(got, want)
    assert all(s.evictions >= 5 for s in plain.stats())
    assert [s.evictions for s in tiered.stats()] == [s.evictions for s in plain.stats()]
    assert len(got_snaps) == len(want_snaps) == 80
    for step, (a, b) in enumerate(zip(got_snaps, want_snaps, strict=True)):
        for layer, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"kept positions differ after token {step}, layer {layer}"
    stats = tiered.tier_stats()
    assert stats is not None and stats.slow_bytes > 0 and stats.written_bytes > 0
    assert stats.moved_bytes == stats.pages_recalled == stats.hits == stats.recall_bytes == 0


# -- 2. the high end: everything recalled attends every position, as select mode does -----------------------
@pytest.mark.parametrize("scorer", ["quest", "landmark"])
@pytest.mark.parametrize("name", [GREEDY, STOCHASTIC])
def test_recalling_the_whole_history_attends_every_position_as_select_mode(name, scorer):
    """Budget 64, evictions of 16 (two pages of 8) from a 70-token prompt: four evictions put 64
    tokens in the slow tier, which the recall buffer (64 slots) holds whole. Every decode step of
    every layer attends every position seen (each head), as select mode with the same scorer and
    page size does (its budget holds everything), and the outputs are full attention's."""
    schedule = {"budget": 64, "recent": 8, "interval": 16, "window": 16}
    recall = {"budget": 64, "page_size": 8, "interval": 1, "scorer": {"type": scorer, "page_size": 8}}
    cache = EvictingCache(load_policy(_spec(name, schedule, recall)), LAYERS)
    select = EvictingCache(load_policy({
        "name": f"{scorer}-select", "mode": "select", "schedule": {"budget": 256, "recent": 8, "interval": 1, "window": 1},
        "scorer": {"type": scorer, "page_size": 8}, "selector": {"type": "greedy"},
    }), LAYERS)
    g = torch.Generator().manual_seed(3)
    prompt, steps = 70, 62  # evictions at 80, 96, 112, 128 slots seen: 64 evicted, the buffer full
    history: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(LAYERS)]
    worst, checked = 0.0, 0
    for step in range(steps):
        t = prompt if step == 0 else 1
        seen = prompt + step
        for layer in range(LAYERS):
            q, k, v = _qkv(g, t)
            out = cache.attend(layer, q, k, v)
            history[layer].append((k, v))
            keys = torch.cat([x for x, _ in history[layer]], 2)
            values = torch.cat([y for _, y in history[layer]], 2)
            full = attend(q, keys, values)
            worst = max(worst, (out - full).abs().max().item())
            _, _, valid = select.step(layer, k, v, q)
            if step == 0:
                continue
            everything = set(range(seen))
            attended = _layout(cache, layer).attended_positions(layer)  # [B, Hkv, Rb + L]
            sel_pos = select.layers[layer].positions
            for r in range(B):
                for h in range(HKV):
                    cols = attended[r, h][attended[r, h] >= 0].tolist()
                    assert len(cols) == len(set(cols)), "a position attended twice"
                    assert set(cols) == everything, f"step {step} layer {layer} row {r} head {h}"
                    assert set(sel_pos[r, h][valid[r, h]].tolist()) == everything
                    checked += 1
    assert worst < 1e-5, worst
    stats = cache.tier_stats()
    assert all(s.evictions == 4 for s in cache.stats())
    # 64 evicted tokens per head, 8 pages, every one in the buffer: nothing short of the whole history
    for layer in range(LAYERS):
        layout = _layout(cache, layer)
        assert layout.slow.pages_held.tolist() == [8] * B
        assert int((layout.buffer.positions[layout.group.member[layer]] >= 0).sum()) == B * HKV * 64
    assert stats is not None and stats.moved_bytes > 0 and stats.hits > 0
    assert checked == (steps - 1) * LAYERS * B * HKV


def test_recalling_the_whole_history_is_what_eviction_alone_misses():
    """The high-end test above is not vacuous: the same inputs with recall budget 0 attend far
    from full attention once eviction has run."""
    schedule = {"budget": 64, "recent": 8, "interval": 16, "window": 16}
    recall = {"budget": 0, "page_size": 8, "interval": 1, "scorer": {"type": "quest", "page_size": 8}}
    cache = EvictingCache(load_policy(_spec(GREEDY, schedule, recall)), LAYERS)
    g = torch.Generator().manual_seed(3)
    history: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(LAYERS)]
    worst = 0.0
    for step in range(30):
        for layer in range(LAYERS):
            q, k, v = _qkv(g, 70 if step == 0 else 1)
            out = cache.attend(layer, q, k, v)
            history[layer].append((k, v))
            full = attend(q, torch.cat([x for x, _ in history[layer]], 2), torch.cat([y for _, y in history[layer]], 2))
            worst = max(worst, (out - full).abs().max().item())
    assert worst > 1e-2


# -- 3. the recall's choice against a naive reference -------------------------------------------------------
def reference_page_scores(keys: torch.Tensor, positions: torch.Tensor, query: torch.Tensor, kind: str) -> list:
    """Per KV head ``h`` and page slot ``n`` of one row and layer: the page's score from its stored
    keys (``keys [Hkv, Np, P, D]``, ``positions [Hkv, Np, P]``, -1: no token), float64, loops;
    None for a slot without a page. ``query [Hq, D]``; ``kind``: quest (``sum_d max(q_d min_d,
    q_d max_d)``) or landmark (``q . mean k``), the max over the KV head's query heads."""
    hkv, np_, p, d = keys.shape
    group = query.shape[0] // hkv
    out: list[list[float | None]] = []
    for h in range(hkv):
        row: list[float | None] = []
        for n in range(np_):
            ks = [keys[h, n, s].double().tolist() for s in range(p) if int(positions[h, n, s]) >= 0]
            if not ks:
                row.append(None)
                continue
            best = -math.inf
            for gq in range(group):
                q = query[h * group + gq].double().tolist()
                if kind == "quest":
                    lo = [min(k[c] for k in ks) for c in range(d)]
                    hi = [max(k[c] for k in ks) for c in range(d)]
                    s = sum(max(q[c] * lo[c], q[c] * hi[c]) for c in range(d))
                else:
                    s = sum(q[c] * sum(k[c] for k in ks) / len(ks) for c in range(d))
                best = max(best, s)
            row.append(best)
        out.append(row)
    return out


def _assert_top_pages(chosen: list[int], scores: list[float | None], k: int, where: str) -> None:
    """``chosen`` page slots are the ``k`` best of ``scores`` (ties within float32 rounding aside)."""
    held = {n: s for n, s in enumerate(scores) if s is not None}
    k = min(k, len(held))
    assert len(chosen) == k == len(set(chosen)), (where, chosen, k)
    assert all(n in held for n in chosen), (where, chosen)
    ranked = sorted(held.values(), reverse=True)
    kth = ranked[k - 1]
    eps = 1e-4 * max(1.0, abs(kth))
    others = [s for n, s in held.items() if n not in chosen]
    assert all(held[n] >= kth - eps for n in chosen), (where, [held[n] for n in chosen], kth)
    assert all(s <= kth + eps for s in others), (where, others, kth)
    exact = {n for n, s in held.items() if s > kth + eps}
    assert exact <= set(chosen), (where, exact, chosen)


@pytest.mark.parametrize("pages", ["position", "similar_keys"])
@pytest.mark.parametrize("scorer", ["quest", "landmark"])
def test_the_recall_buffer_holds_the_top_pages_of_a_naive_reference(scorer, pages):
    """Random inputs, budget 32, evictions of 8 (pages of 4), a recall buffer of 3 pages out of up
    to 16: after every layer's recalling step the buffer holds exactly the reference's top 3 pages
    of each head (scored from the slow tier's stored keys and the step's query), each page's
    positions, keys and values copied from the slow tier. With a recall interval of 3 the buffer
    changes only at recalling steps."""
    for interval in (1, 3):
        schedule = {"budget": 32, "recent": 4, "interval": 8, "window": 8}
        recall = {"budget": 12, "page_size": 4, "interval": interval, "pages": pages,
                  "scorer": {"type": scorer, "page_size": 4}}
        cache = EvictingCache(load_policy(_spec(GREEDY, schedule, recall)), LAYERS)
        g = torch.Generator().manual_seed(11)
        prompt, checked, unchanged = 40, 0, 0
        before: dict[int, torch.Tensor] = {}
        for step in range(40):
            for layer in range(LAYERS):
                q, k, v = _qkv(g, prompt if step == 0 else 1)
                cache.attend(layer, q, k, v)
                layout = _layout(cache, layer)
                i = layout.group.member[layer]
                slow, buffer = layout.slow, layout.buffer
                if step == 0 or not int(slow.pages_held.min()):
                    continue
                pages_now = buffer.pages[i].clone()
                if (prompt + step) % interval and layer in before:  # no recall at this step: the buffer stands
                    assert torch.equal(pages_now, before[layer])
                    unchanged += 1
                before[layer] = pages_now
                if (prompt + step) % interval:
                    continue
                for r in range(B):
                    ref = reference_page_scores(slow.keys[i, r], slow.positions[i, r], q[r, :, -1], scorer)
                    for h in range(HKV):
                        held = (slow.positions[i, r, h] >= 0).any(-1)
                        assert torch.equal(held, slow.page_valid[i, r, h])
                        chosen = [int(n) for n in buffer.pages[i, r, h] if n >= 0]
                        _assert_top_pages(chosen, ref[h], buffer.page_slots, f"{step}/{layer}/{r}/{h}")
                        for j, n in enumerate(buffer.pages[i, r, h].tolist()):
                            cols = slice(j * 4, (j + 1) * 4)
                            if n < 0:
                                assert bool((buffer.positions[i, r, h, cols] == -1).all())
                                continue
                            assert torch.equal(buffer.positions[i, r, h, cols], slow.positions[i, r, h, n])
                            assert torch.equal(buffer.keys[i, r, h, cols], slow.keys[i, r, h, n])
                            assert torch.equal(buffer.values[i, r, h, cols], slow.values[i, r, h, n])
                        checked += 1
            cache.evict_due()
        assert checked >= 20 * LAYERS * B * HKV // interval
        assert interval == 1 or unchanged > 0
        assert int(_layout(cache, 0).slow.pages_held.min()) > 3  # more pages than the buffer holds


# -- 4. padded rows and seeded runs under generate() --------------------------------------------------------
def _stochastic_two_tier(scorer: str = "landmark") -> dict[str, Any]:
    return _spec(STOCHASTIC, {"budget": 32, "recent": 8, "interval": 8, "window": 8},
                 {"budget": 16, "page_size": 8, "interval": 1, "scorer": {"type": scorer, "page_size": 8}})


def test_padded_rows_of_a_stochastic_two_tier_policy_decode_as_alone():
    """Two rows of different prompt lengths (a left-padded batch) decode, under sampled eviction
    and landmark recall, as each does alone: the greedy tokens, and the tier counters summed."""
    model = tiny_qwen3(LAYERS, VOCAB)
    policy = load_policy(_stochastic_two_tier())
    ids, mask = left_padded_prompt(VOCAB, batch=2, length=40, pads=(0, 9))
    n = 40
    assert_rows_decode_as_alone(fresh(model), policy, ids, mask, n)

    batch, cache, _ = _generate_with_snapshots(model, policy, ids, mask, n)
    stats = cache.tier_stats()
    assert stats is not None and stats.moved_bytes > 0 and stats.hits > 0
    alone_stats = []
    for r in range(2):
        real = mask[r].bool()
        row_ids, row_mask = ids[r : r + 1, real], mask[r : r + 1, real]
        out, row_cache, _ = _generate_with_snapshots(model, policy, row_ids, row_mask, n)
        assert torch.equal(out[0, -n:], batch[r, -n:]), f"row {r}"
        kept = [layer.positions[0] for layer in row_cache.evicting.layers]
        for layer, want in zip(cache.evicting.layers, kept, strict=True):
            got = layer.positions[r]
            assert torch.equal(got[got >= 0], want[want >= 0])
        for layer in range(LAYERS):  # the same pages recalled, into the same buffer slots
            ours, alone = _layout(cache.evicting, layer), _layout(row_cache.evicting, layer)
            i = ours.group.member[layer]
            assert torch.equal(ours.buffer.positions[i, r], alone.buffer.positions[i, 0])
        alone_stats.append(row_cache.tier_stats())
    for name in ("moved_bytes", "written_bytes", "pages_recalled", "hits", "pages_dropped"):
        assert getattr(stats, name) == sum(getattr(s, name) for s in alone_stats), name


def test_seeded_stochastic_two_tier_runs_reproduce_and_the_seed_matters():
    """Two runs of a sampled eviction with Quest recall under one seed: the same tokens, kept
    positions after every token and tier counters; a third seed keeps other slots."""
    model = tiny_qwen3(LAYERS, VOCAB)
    policy = load_policy(_stochastic_two_tier("quest"))
    ids, mask = left_padded_prompt(VOCAB, batch=2, length=40, pads=(0, 5))
    runs = [_generate_with_snapshots(model, policy, ids, mask, 40, seed=seed) for seed in (7, 7, 8)]
    (a, ca, sa), (b, cb, sb), (_, _, sc) = runs
    assert torch.equal(a, b)
    assert ca.tier_stats() == cb.tier_stats() and ca.tier_stats().moved_bytes > 0
    assert all(torch.equal(x, y) for u, w in zip(sa, sb, strict=True) for x, y in zip(u, w, strict=True))
    # another seed keeps other slots (else the runs above would prove nothing about the draws)
    assert any(not torch.equal(x, y) for u, w in zip(sa, sc, strict=True) for x, y in zip(u, w, strict=True))


# -- 5. a bounded slow tier and the counters --------------------------------------------------------------
def _token_bytes(dtype: torch.dtype = torch.float32) -> int:
    """One token's bytes in the slow tier: its key, its value and its int64 position."""
    size = torch.empty(0, dtype=dtype).element_size()
    return 2 * D * size + 8


def _assert_buffer_consistent(layout: TwoTierRows, i: int, budget: int) -> None:
    """The recall buffer of layer index ``i`` references only pages the slow tier holds, each
    holding that page's positions; no page twice per head; at most ``budget`` slots per head;
    where it says every slot holds a token (attention then masks none), every slot does."""
    buffer, slow, p = layout.buffer, layout.slow, layout.buffer.page_size
    if buffer.view(i)[2] is None:
        assert bool((buffer.positions[i] >= 0).all()), "a slot without a token read as full"
    for r in range(buffer.pages.shape[1]):
        for h in range(HKV):
            pages = buffer.pages[i, r, h].tolist()
            held = [n for n in pages if n >= 0]
            assert len(held) == len(set(held)), ("a page twice", pages)
            assert int((buffer.positions[i, r, h] >= 0).sum()) <= budget
            for j, n in enumerate(pages):
                cols = buffer.positions[i, r, h, j * p : (j + 1) * p]
                if n < 0:
                    assert bool((cols == -1).all())
                    continue
                assert bool(slow.page_valid[i, r, h, n]), ("references a dropped page", n)
                assert torch.equal(cols, slow.positions[i, r, h, n])


@pytest.mark.parametrize("drop", ["oldest", "lowest"])
def test_a_bounded_slow_tier_drops_by_its_rule_and_counts(drop):
    """Capacity 16 slots (4 pages of 4) under evictions of 16 then 8 per head: the tier holds at
    most 4 pages per head; ``oldest`` keeps the newest-written pages (by ``page_age``),
    ``lowest`` drops the pages of lowest score at the last recall; the recall buffer lets go of a
    dropped page; ``pages_dropped`` counts them, ``moved_bytes`` is the missed pages' bytes."""
    capacity, page, per_token = 16, 4, _token_bytes()
    schedule = {"budget": 32, "recent": 4, "interval": 8, "window": 8}
    recall = {"budget": 8, "page_size": page, "interval": 1, "capacity": capacity, "drop": drop,
              "scorer": {"type": "quest", "page_size": page}}
    cache = EvictingCache(load_policy(_spec(GREEDY, schedule, recall)), LAYERS)
    g = torch.Generator().manual_seed(5)
    writes: list[int] = []  # pages per head each eviction wrote (every row and layer alike here)
    dropped_expected = 0
    for step in range(48):
        for layer in range(LAYERS):
            q, k, v = _qkv(g, 40 if step == 0 else 1)
            cache.attend(layer, q, k, v)
        layouts = [_layout(cache, layer) for layer in range(LAYERS)]
        layout = layouts[0]
        slow = layout.slow
        held_before = slow.pages_held.clone()
        valid_before, age_before = slow.page_valid.clone(), slow.page_age.clone()
        score_before = slow.page_score.clone()
        evictions = sum(s.evictions for s in cache.stats())
        cache.evict_due()
        if sum(s.evictions for s in cache.stats()) > evictions:
            new = (16 if not writes else 8) // page  # the first eviction (48 slots) evicts 16, then 8
            writes.append(new)
            over = max(0, int(held_before[0]) + new - capacity // page)
            dropped_expected += over * LAYERS * B * HKV
            # a slot whose page went: no longer valid, or holding a page of this write (the tier
            # may have grown: its new slots held nothing before)
            n = valid_before.shape[-1]
            gone = valid_before & (~slow.page_valid[..., :n] | (slow.page_age[..., :n] != age_before))
            assert int(gone.sum()) == over * LAYERS * B * HKV
            if drop == "lowest" and over:
                survived = valid_before & ~gone
                for i in range(LAYERS):
                    for r in range(B):
                        for h in range(HKV):
                            lost = score_before[i, r, h][gone[i, r, h]]
                            kept = score_before[i, r, h][survived[i, r, h]]
                            assert float(lost.max()) <= float(kept.min()), (lost, kept)
        assert slow.pages_held.tolist() == slow.page_valid[0, :, 0].sum(-1).tolist()
        assert int(slow.page_valid.sum(-1).max()) <= capacity // page
        assert slow.page_slots <= capacity // page
        for layer in range(LAYERS):
            _assert_buffer_consistent(layouts[layer], layouts[layer].group.member[layer], 8)
        if drop == "oldest" and writes:
            # the newest-written capacity // page pages per head survive, by write
            want: list[int] = []
            for age in range(len(writes) - 1, -1, -1):
                want += [age] * min(writes[age], capacity // page - len(want))
            for i in range(LAYERS):
                for r in range(B):
                    for h in range(HKV):
                        ages = sorted(slow.page_age[i, r, h][slow.page_valid[i, r, h]].tolist(), reverse=True)
                        assert ages == want, (ages, want)
    stats = cache.tier_stats()
    assert len(writes) >= 5 and stats.pages_dropped == dropped_expected > 0
    assert stats.moved_bytes == (stats.pages_recalled - stats.hits) * page * per_token
    assert stats.moved_bytes > 0 and stats.hits > 0
    held_pages = int(layout.slow.page_valid.sum())
    assert stats.written_bytes == (held_pages + stats.pages_dropped) * page * per_token


def test_a_prompt_larger_than_the_whole_slow_tier_counts_its_cut_pages_as_written_and_dropped():
    """A 100-token prompt's first eviction brings more pages than a tier of 4 pages holds: the
    oldest are cut at once, counted as written and dropped, so ``written_bytes`` is still
    ``(held + dropped)`` pages (it counted only the pages kept, while they counted as dropped)."""
    page, per_token = 4, _token_bytes()
    recall = {"budget": 8, "page_size": page, "interval": 1, "capacity": 16, "drop": "oldest",
              "scorer": {"type": "quest", "page_size": page}}
    cache = EvictingCache(load_policy(_spec(GREEDY, {"budget": 32, "recent": 4, "interval": 8, "window": 8}, recall)),
                          num_layers=1)
    g = torch.Generator().manual_seed(0)
    cache.attend(0, *_qkv(g, 100, b=1))
    for _ in range(9):
        cache.attend(0, *_qkv(g, 1, b=1))
    stats, slow = cache.tier_stats(), _layout(cache, 0).slow
    held_pages = int(slow.page_valid.sum())
    assert held_pages <= 4 * HKV and stats.pages_dropped > 0
    assert stats.written_bytes == (held_pages + stats.pages_dropped) * page * per_token


def test_moved_bytes_count_only_missed_pages_unbounded():
    """Unbounded tier, quest recall of 2 pages out of many at every step: ``moved_bytes`` is the
    missed pages' keys, values and positions; ``written_bytes`` every evicted page's."""
    page, per_token = 4, _token_bytes()
    schedule = {"budget": 32, "recent": 4, "interval": 8, "window": 8}
    recall = {"budget": 8, "page_size": page, "interval": 1, "scorer": {"type": "quest", "page_size": page}}
    cache = EvictingCache(load_policy(_spec(GREEDY, schedule, recall)), LAYERS)
    g = torch.Generator().manual_seed(9)
    for step in range(40):
        for layer in range(LAYERS):
            cache.attend(layer, *_qkv(g, 40 if step == 0 else 1))
        cache.evict_due()
    stats = cache.tier_stats()
    assert stats.pages_dropped == 0 and stats.hits > 0 and stats.pages_recalled > stats.hits
    assert stats.moved_bytes == (stats.pages_recalled - stats.hits) * page * per_token
    held = sum(int(_layout(cache, layer).slow.page_valid.sum()) for layer in range(1))
    assert stats.written_bytes == held * page * per_token


# -- 6. properties over random settings -------------------------------------------------------------------
def _assert_attends(out: torch.Tensor, q: torch.Tensor, *parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """``out [B, Hq, 1, D]`` is softmax attention of ``q`` over the valid slots of ``parts``
    (``keys [B, Hkv, L, D]``, ``values``, ``valid [B, Hkv, L]`` each), per row and query head, in
    float64."""
    group = q.shape[1] // HKV
    for r in range(q.shape[0]):
        for hq in range(q.shape[1]):
            h = hq // group
            ks = torch.cat([k[r, h][ok[r, h]] for k, _, ok in parts]).double()
            vs = torch.cat([v[r, h][ok[r, h]] for _, v, ok in parts]).double()
            w = torch.softmax(ks @ q[r, hq, -1].double() * D**-0.5, dim=0)
            assert torch.allclose(out[r, hq, -1].double(), w @ vs, atol=1e-5), (r, hq)


@settings(max_examples=25, deadline=None)
@given(
    budget=st.sampled_from([16, 24, 32]),
    page=st.sampled_from([2, 4, 8]),
    interval_pages=st.sampled_from([1, 2]),
    recall_pages=st.integers(1, 3),
    recall_interval=st.integers(1, 3),
    scorer=st.sampled_from(["quest", "landmark"]),
    pages=st.sampled_from(["position", "similar_keys"]),
    capacity_pages=st.sampled_from([None, 3, 6]),
    drop=st.sampled_from(["oldest", "lowest"]),
    name=st.sampled_from([GREEDY, STOCHASTIC]),
    extra=st.integers(0, 20),
    pad=st.sampled_from([0, 3]),
    more=st.integers(1, 16),
    compress_prompt=st.booleans(),
    precision=st.sampled_from(["keys", "int8"]),
    seed=st.integers(0, 2**16),
)
def test_properties_of_the_recall_buffer_and_the_kept_slots(
    budget, page, interval_pages, recall_pages, recall_interval, scorer, pages, capacity_pages, drop, name, extra, pad,
    more, compress_prompt, precision, seed,
):
    """Whatever the settings (rows of different lengths among them): the recall buffer holds no
    page twice per head, no position the kept slots hold, at most ``recall.budget`` slots per
    head, only pages the slow tier holds; the kept slots are exactly those of the evicting policy
    alone on the same inputs; a decode step attends exactly the kept and the recalled slots."""
    interval = page * interval_pages
    recall_budget = min(recall_pages * page, budget - budget % page)
    capacity = None if capacity_pages is None else max(capacity_pages * page, recall_budget)
    schedule = {"budget": budget, "recent": 4, "interval": interval, "window": min(4, interval),
                "compress_prompt": compress_prompt}
    recall = {"budget": recall_budget, "page_size": page, "interval": recall_interval, "pages": pages,
              "capacity": capacity, "drop": drop, "summary_precision": precision,
              "scorer": {"type": scorer, "page_size": page}}
    tiered = EvictingCache(load_policy(_spec(name, schedule, recall)), LAYERS)
    plain = EvictingCache(load_policy(_spec(name, schedule)), LAYERS)
    g = torch.Generator().manual_seed(seed)
    prompt = budget + extra
    steps = 2 * interval + more  # at least one eviction, then recalls
    valid = torch.ones(B, prompt, dtype=torch.bool)
    valid[1, :pad] = False
    for step in range(steps):
        t = prompt if step == 0 else 1
        for layer in range(LAYERS):
            q, k, v = _qkv(g, t)
            token_valid = valid if step == 0 else None
            out = tiered.attend(layer, q, k, v, token_valid)
            plain.attend(layer, q, k, v, token_valid)
            layout = _layout(tiered, layer)
            i = layout.group.member[layer]
            _assert_buffer_consistent(layout, i, recall_budget)
            kept = tiered.layers[layer].positions
            assert torch.equal(kept, plain.layers[layer].positions)
            recalled = layout.buffer.positions[i]
            for r in range(B):
                for h in range(HKV):
                    here = set(kept[r, h][kept[r, h] >= 0].tolist())
                    back = set(recalled[r, h][recalled[r, h] >= 0].tolist())
                    assert not here & back, (here & back)
                    assert max(here | back) < prompt - (pad if r else 0) + step
            if step:  # the step's output: attention over the kept and the recalled slots, nothing else
                view = tiered.layers[layer]
                _assert_attends(out, q, (view.keys, view.values, view.valid),
                                (layout.buffer.keys[i], layout.buffer.values[i], recalled >= 0))
            if capacity is not None:
                assert int(layout.slow.page_valid.sum(-1).max()) <= capacity // page
        tiered.evict_due()
        plain.evict_due()
    assert [s.evictions for s in tiered.stats()] == [s.evictions for s in plain.stats()]
    assert all(s.evictions >= 1 for s in plain.stats())
    assert tiered.tier_stats().pages_recalled > 0


# -- 7. refusals at load ----------------------------------------------------------------------------------
_SCHED = {"budget": 64, "recent": 8, "interval": 16, "window": 16}
_OK = {"budget": 16, "page_size": 8}


@pytest.mark.parametrize(
    ("recall", "extra", "names"),
    [
        ({"budget": 4, "page_size": 8}, {}, ["recall.budget", "no room", "recall.page_size"]),
        ({"budget": 12, "page_size": 8}, {}, ["recall.budget", "whole pages"]),
        ({"budget": "schedule", "page_size": 8}, {"schedule": {**_SCHED, "budget": 60}}, ["recall.budget 60", "whole pages"]),
        ({"budget": 80, "page_size": 8}, {}, ["recall.budget 80", "schedule.budget 64"]),
        ({"budget": 24, "page_size": 12}, {}, ["recall.page_size 12", "schedule.interval 16"]),
        (_OK, {"mode": "select"}, ["recall", "select mode"]),
        ({**_OK, "scorer": {"type": "attention"}}, {}, ["recall.scorer", "'attention'", "recall_summaries"]),
        ({**_OK, "summaries": ["key_median"]}, {}, ["recall.summaries", "key_median"]),
        ({**_OK, "capacity": 20}, {}, ["recall.capacity", "whole pages"]),
        ({**_OK, "capacity": 8}, {}, ["recall.capacity", "recall.budget"]),
        (_OK, {"allocation": {"type": "adaptive", "floor": 0.2}}, ["recall", "'adaptive'"]),
        (_OK, {"allocation": {"type": "pyramid", "beta": 20}}, ["recall", "'pyramid'", "layers keep different budgets"]),
        (_OK, {"merge": {"type": "similar"}}, ["recall", "merge 'similar'"]),
        (_OK, {"scorer": {"type": "key_norm"}, "schedule": {**_SCHED, "window": 0}}, ["recall", "schedule.window"]),
        ({"budget": 16, "page_size": 16}, {"scorer": {"type": "quest", "page_size": 16}},
         ["schedule.budget 64 - schedule.recent 8 = 56", "recall.page_size 16", "'quest'", "budget 72"]),
    ],
    ids=["no-room", "not-whole-pages", "schedule-not-whole-pages", "above-schedule-budget", "page-not-dividing-interval",
         "select-mode", "scorer-without-summaries", "unknown-summary", "capacity-not-whole-pages", "capacity-below-budget",
         "per-head-allocation", "per-layer-allocation", "merge", "window-0", "eviction-ranks-part-of-a-page"],
)
def test_refused_at_load_naming_the_field(recall, extra, names):
    data = {**_spec(GREEDY, _SCHED), **copy.deepcopy(extra), "recall": recall}
    with pytest.raises(PolicyError) as err:
        load_policy(data)
    message = str(err.value)
    for name in names:
        assert name in message, (name, message)
    # the same policy without its recall block loads: the refusal is the recall's
    del data["recall"]
    load_policy(data)


@settings(max_examples=12, deadline=None)
@given(prompt=st.integers(1, 300), steps=st.integers(40, 260), seed=st.integers(0, 2**16))
def test_arkvale_evicts_and_recalls_whole_pages(prompt, steps, seed):
    """ArkVale's unit is the page: eviction ranks pages of 32 by their bound and every page it
    drops goes to the slow tier as it was, so each slow-tier page holds 32 consecutive positions
    from a multiple of 32, whatever the prompt's length (a recent buffer of 16 once made every
    eviction keep half a page and send slow pages of scattered positions)."""
    cache = EvictingCache(load_policy("arkvale", budget=128), num_layers=1, seed=0)
    g = torch.Generator().manual_seed(seed)
    cache.attend(0, *_qkv(g, prompt, b=1))
    for _ in range(steps):
        cache.attend(0, *_qkv(g, 1, b=1))
    slow = _layout(cache, 0).slow
    held = slow.positions[0, 0][slow.page_valid[0, 0]]  # [pages, 32] over both heads
    assert prompt + steps <= 160 or held.shape[0] > 0  # it evicted by then (budget 128 + interval 32)
    whole = torch.arange(32) + held[:, :1]
    assert torch.equal(held, whole) and bool((held[:, 0] % 32 == 0).all()), held


def test_built_in_refusals_compose_with_a_recall_block():
    """Built-in evicting policies refused with a recall block: a per-head allocation (ada-snapkv)
    and a merge (snapkv-merge); select mode (quest)."""
    for name, words in (("ada-snapkv", "'adaptive'"), ("snapkv-merge", "merge 'similar'"), ("quest", "select mode")):
        data = load_policy(name).config.to_dict()
        data["schedule"] = {**data["schedule"], "budget": 64, "recent": 16, "interval": 16, "window": 16}
        data["recall"] = {"budget": 16, "page_size": 16}
        with pytest.raises(PolicyError, match=words):
            load_policy(data)
