"""The built-in ``duo-attention`` policy and its ``duo`` allocation: per-head counts against a
hand-computed reference (``reference.duo_counts``), the slots each class of head keeps against
float64 references, bad profiles and compositions refused before any work, and a run through
``generate()`` where every streaming head ends holding only its sinks and newest tokens."""

from __future__ import annotations

import itertools

import pytest
import reference as ref
import torch
from helpers import make_tensors
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import PolicyError
from kvpolicy.profiles import HeadProfile

R, S = "retrieval", "streaming"


def _profile(tmp_path, classes=None, weights=None, name="heads.yaml"):
    path = tmp_path / name
    data = {"kvpolicy_profile": 1, "num_layers": len(classes or weights), "num_kv_heads": len((classes or weights)[0])}
    HeadProfile.parse({**data, **({"classes": classes} if classes else {"weights": weights})}).save(path)
    return str(path)


def _policy(path, budget=16, recent=4, sinks=2, interval=4, alloc_sinks=None, compress=False, window=4, **alloc):
    return kvpolicy.load_policy({
        "name": "duo-small",
        "schedule": {"budget": budget, "recent": recent, "interval": interval, "window": window,
                     "compress_prompt": compress},
        "scorer": {"type": "attention"},
        "reservations": [{"type": "sinks", "n": sinks}],
        "selector": "greedy",
        "allocation": {"type": "duo", "path": path, "sinks": sinks if alloc_sinks is None else alloc_sinks, **alloc},
    })


def test_defaults():
    policy = kvpolicy.load_policy("duo-attention")
    alloc = policy.allocation
    s = policy.schedule
    assert (s.budget, s.recent, s.interval, s.window, s.compress_prompt) == (1024, 64, 64, 64, True)
    assert (alloc.type_name, alloc.streaming_fraction, alloc.sinks) == ("duo", 0.5, 4)
    assert [(r.type_name, r.n) for r in policy.config.reservations] == [("sinks", 4)]
    assert alloc.retrieval.shape == (30, 3) and int(alloc.retrieval.sum()) == 45  # half of the 90 heads stream
    # The streaming half is the lowest-weighted half of the shipped passkey profile.
    w = HeadProfile.load(kvpolicy.stages.duo.resolve_profile_path(alloc.path)).head_weights()
    assert float(w[~alloc.retrieval].max()) <= float(w[alloc.retrieval].min())
    budgets = alloc.layer_budgets(1024, 30, 64)
    assert sum(budgets) == 30 * 1024
    for layer, b in enumerate(budgets):
        heads = alloc.head_budgets(layer, b, 64)
        assert sum(heads) == 3 * b
        assert all(h == 68 for h, r in zip(heads, alloc.retrieval[layer].tolist(), strict=True) if not r)
    assert policy.couples_heads  # a per-head allocation: refused where heads are sharded


def test_the_builtin_on_its_model_shape():
    """The shipped policy at a small budget on tensors of the bundled model's shape (3 KV heads):
    streaming heads keep their 4 sinks and 8 recent slots, retrieval heads the rest."""
    policy = kvpolicy.load_policy("duo-attention", budget=40, recent=8, window=8, interval=8)
    budgets = policy.allocation.layer_budgets(40, 30, 8)
    for layer in (0, 1, 5):
        # Every head holds more than its share (else a retrieval head keeps all and lends the rest).
        k, v, q = make_tensors(b=2, hkv=3, hq=9, n=3 * budgets[layer] + 8, d=8, w=8, seed=layer)
        keep, counts = policy.select_heads(k, v, q, layer_idx=layer, budget=budgets[layer])
        n = k.shape[2]
        assert counts.sum(-1).tolist() == [3 * budgets[layer]] * 2
        for h, is_r in enumerate(policy.allocation.retrieval[layer].tolist()):
            if not is_r:
                assert keep[:, h].nonzero()[:, 1].tolist() == [*range(4), *range(n - 8, n)] * 2
            else:
                assert bool(keep[:, h, :4].all()) and bool(keep[:, h, -8:].all())


def test_counts_match_the_reference(tmp_path):
    classes = [[R, S], [S, S], [R, R]]
    policy = _policy(_profile(tmp_path, classes))
    want = ref.duo_counts([[c == R for c in row] for row in classes], budget=16, recent=4, sinks=2)
    assert want == [[26, 6], [6, 6], [26, 26]]
    alloc = policy.allocation
    budgets = alloc.layer_budgets(16, 3, 4)
    assert budgets == [sum(row) // 2 for row in want]
    assert [alloc.head_budgets(layer, b, 4) for layer, b in enumerate(budgets)] == want
    assert [s.budget for s in policy.layer_schedules(3, 2)] == budgets


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_counts_add_up_for_any_profile(tmp_path_factory, data):
    layers = data.draw(st.integers(1, 6), label="layers")
    heads = data.draw(st.integers(1, 4), label="heads")
    classes = data.draw(st.lists(st.lists(st.sampled_from([R, S]), min_size=heads, max_size=heads),
                                 min_size=layers, max_size=layers), label="classes")
    if not any(R in row for row in classes):
        classes[0][0] = R
    recent, sinks = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 4))
    budget = data.draw(st.integers(recent + sinks + 1, 200), label="budget")
    alloc = _policy(_profile(tmp_path_factory.mktemp("p"), classes), budget=budget, recent=recent, sinks=sinks,
                    interval=1, window=1).allocation
    budgets = alloc.layer_budgets(budget, layers, recent)
    assert sum(budgets) == layers * budget
    per_head = [alloc.head_budgets(layer, b, recent) for layer, b in enumerate(budgets)]
    flat_r = [c for row, cls in zip(per_head, classes, strict=True) for c, k in zip(row, cls, strict=True) if k == R]
    for row, cls, b in zip(per_head, classes, budgets, strict=True):
        assert sum(row) == heads * b
        assert all(c == recent + sinks for c, k in zip(row, cls, strict=True) if k == S)
    assert max(flat_r) - min(flat_r) <= heads  # retrieval heads share equally, up to rounding per layer
    assert min(flat_r) > recent + sinks


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_no_head_ever_keeps_more_than_its_layers_largest_share(tmp_path_factory, data):
    """``layer_head_cap`` (what vLLM reserves per head in a layer's blocks) bounds every head at
    every eviction of ``EvictingCache``, for any profile, budget, prompt and data: a streaming head
    that takes a layer's spare slots early, and a retrieval head past its share, included."""
    layers, heads = data.draw(st.integers(1, 3), label="layers"), data.draw(st.integers(1, 3), label="heads")
    classes = data.draw(st.lists(st.lists(st.sampled_from([R, S]), min_size=heads, max_size=heads),
                                 min_size=layers, max_size=layers), label="classes")
    if not any(R in row for row in classes):
        classes[0][0] = R
    recent, sinks = data.draw(st.integers(1, 6), label="recent"), data.draw(st.integers(1, 3), label="sinks")
    budget = data.draw(st.integers(recent + sinks + 1, 40), label="budget")
    interval = data.draw(st.integers(1, 8), label="interval")
    prompt = data.draw(st.integers(1, 80), label="prompt")
    total = prompt + data.draw(st.integers(50, 80), label="decoded")  # past budget + interval: it evicts
    policy = _policy(_profile(tmp_path_factory.mktemp("p"), classes), budget=budget, recent=recent, sinks=sinks,
                     interval=interval, window=min(4, recent), compress=data.draw(st.booleans(), label="compress"))
    alloc = policy.allocation
    schedules = policy.layer_schedules(layers, heads)
    caps = [alloc.layer_head_cap(layer, s.budget, heads, recent) for layer, s in enumerate(schedules)]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999), label="data seed"))
    k, v, q = (torch.randn(1, heads, total, 8, generator=g) for _ in range(3))
    k = k * (1 + 4 * (torch.rand(1, heads, total, 1, generator=g) > 0.8))  # a few large keys: peaked attention
    cache = kvpolicy.EvictingCache(policy, layers, seed=0)
    bounds = [0, prompt, *range(prompt + 1, total + 1)]
    seen = [0] * layers
    for a, b in itertools.pairwise(bounds):
        for layer in range(layers):
            cache.step(layer, k[:, :, a:b], v[:, :, a:b], 3 * q[:, :, a:b])
        cache.evict_due()
        for layer, view in enumerate(cache.layers):
            if view.stats.evictions > seen[layer]:  # it just evicted: each head holds what it kept
                seen[layer] = view.stats.evictions
                counts = (view.positions[0] >= 0).sum(-1)
                assert int(counts.max()) <= caps[layer], (layer, a, b, counts.tolist(), caps[layer])
                assert int(counts.sum()) == heads * schedules[layer].budget
    assert min(seen) > 0


def test_each_class_keeps_what_the_reference_keeps(tmp_path):
    """Layer 0 (head 0 retrieval, head 1 streaming) holding 60 slots: the streaming head keeps its
    2 sinks and 4 recent slots, the retrieval head its protected slots and the best-scored
    candidates (SnapKV-style attention, float64 reference) up to its 26."""
    policy = _policy(_profile(tmp_path, [[R, S], [S, S], [R, R]]))
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=60, d=8, w=4, seed=3)
    keep, counts = policy.select_heads(k, v, 3 * q, layer_idx=0, budget=16)
    assert counts.tolist() == [[26, 6], [26, 6]]
    streaming = [0, 1, 56, 57, 58, 59]
    scores = ref.attention(k, 3 * q, 56)
    want = ref.select(scores, budget=26, recent=4, sinks=2)
    for b in range(2):
        assert keep[b, 1].nonzero().flatten().tolist() == streaming
        assert keep[b, 0].nonzero().flatten().tolist() == want[b][0]


def test_a_retrieval_head_below_its_share_keeps_everything(tmp_path):
    """At a layer's first eviction a retrieval head may hold fewer slots than its share: it keeps
    them all, and the layer's spare slots go to the streaming head's best candidates (the layer
    still keeps Hkv x budget)."""
    policy = _policy(_profile(tmp_path, [[R, S], [S, S], [R, R]]))
    k, v, q = make_tensors(b=1, hkv=2, hq=4, n=20, d=8, w=4, seed=4)
    keep, counts = policy.select_heads(k, v, 3 * q, layer_idx=0, budget=16)
    assert counts.tolist() == [[20, 12]]
    assert bool(keep[0, 0].all())
    scores = ref.attention(k, 3 * q, 16)
    assert keep[0, 1].nonzero().flatten().tolist() == ref.select(scores, budget=12, recent=4, sinks=2)[0][1]


def test_a_profile_for_another_model_is_refused_before_any_work(tmp_path):
    policy = _policy(_profile(tmp_path, [[R, S], [S, S], [R, R]]))
    with pytest.raises(PolicyError, match=r"allocation: profile .* is for a model with 3 layers x 2 KV heads, "
                                          r"this model has 4 x 2"):
        kvpolicy.EvictingCache(policy, num_layers=4, num_kv_heads=2)
    with pytest.raises(PolicyError, match=r"3 layers x 2 KV heads, this model has 3 x 4"):
        policy.layer_schedules(3, 4)
    # its KV heads not known yet: the layers alone are compared, and no head count is made up
    with pytest.raises(PolicyError, match=r"3 layers x 2 KV heads, this model has 4 layers$"):
        kvpolicy.EvictingCache(policy, num_layers=4)
    k, v, q = make_tensors(b=1, hkv=4, hq=8, n=40, d=8, w=4, seed=0)
    with pytest.raises(ValueError, match=r"allocation 'duo': the head profile .* is for 3 layers x 2 KV heads"):
        policy.select_heads(k, v, q, layer_idx=0, budget=16)
    pytest.importorskip("transformers")
    from hf_util import tiny_qwen3

    with pytest.raises(PolicyError, match="allocation: profile"):
        kvpolicy.KVPolicyCache(kvpolicy.load_policy("duo-attention"), tiny_qwen3(layers=2, vocab=64))


def test_bad_allocations_name_the_field(tmp_path):
    path = _profile(tmp_path, weights=[[0.1, 0.2], [0.05, 0.3]])
    with pytest.raises(PolicyError, match=r"allocation: .*threshold 0.5 leaves no retrieval head"):
        _policy(path)
    assert _policy(path, threshold=0.15).allocation.retrieval.tolist() == [[False, True], [False, True]]
    assert _policy(path, streaming_fraction=0.25).allocation.retrieval.tolist() == [[True, True], [False, True]]
    # kvpress's count: round(fraction x heads), here round(1.6) = 2 heads (a floor would stream 1)
    assert _policy(path, streaming_fraction=0.4).allocation.retrieval.tolist() == [[False, True], [False, True]]
    with pytest.raises(PolicyError, match="give threshold or streaming_fraction, not both"):
        _policy(path, threshold=0.1, streaming_fraction=0.5)
    with pytest.raises(PolicyError, match=r"allocation: cannot use the head profile .*missing"):
        _policy(str(tmp_path / "missing.yaml"))
    with pytest.raises(PolicyError, match="streaming_fraction"):
        _policy(path, streaming_fraction=1.0)


def test_a_layer_left_without_a_candidate_is_refused(tmp_path):
    """Without sinks an all-streaming layer's budget is its recent buffer alone: no candidate."""
    policy = kvpolicy.load_policy({
        "name": "no-sinks", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 4},
        "scorer": "attention", "selector": "greedy",
        "allocation": {"type": "duo", "path": _profile(tmp_path, [[R, S], [S, S]]), "sinks": 0},
    })
    with pytest.raises(PolicyError, match=r"allocation: layer 1 gets a budget of 4 slots, which leaves no candidate"):
        kvpolicy.EvictingCache(policy, num_layers=2, num_kv_heads=2)
    with pytest.raises(PolicyError, match=r"budget \(6\) must be above a streaming head's recent \+ sinks \(4 \+ 2\)"):
        _policy(_profile(tmp_path, [[R, S]], name="one.yaml"), budget=6).layer_schedules(1, 2)


def test_sinks_that_do_not_match_the_reservation_are_an_error(tmp_path):
    policy = _policy(_profile(tmp_path, [[R, S], [S, S], [R, R]]), alloc_sinks=3)
    k, v, q = make_tensors(b=1, hkv=2, hq=4, n=60, d=8, w=4, seed=0)
    with pytest.raises(ValueError, match=r"streaming head keeps recent \+ sinks = 7 slots.*protects 6: set allocation.sinks"):
        policy.select_heads(k, v, q, layer_idx=0, budget=17)


def test_generate_streaming_heads_hold_sinks_and_newest_tokens(tmp_path):
    """Through transformers' generate() on a 3-layer test model: the cache evicts on schedule, the
    layers' budgets follow the classes, and after decoding each streaming head holds exactly its
    2 sinks and a run of the newest tokens, each retrieval head more."""
    pytest.importorskip("transformers")
    from hf_util import generate, left_padded_prompt, tiny_qwen3

    classes = [[R, S], [S, S], [R, R]]
    policy = _policy(_profile(tmp_path, classes), compress=True)
    model = tiny_qwen3(layers=3, vocab=256)
    ids, mask = left_padded_prompt(256, batch=2, length=40, pads=(0, 6))
    cache = kvpolicy.KVPolicyCache(policy, model)
    out = generate(model, cache, ids, mask, 33)
    assert out.shape == (2, 73)
    assert [s.budget for s in cache.evicting.schedules] == [16, 6, 26]
    for layer, row in enumerate(classes):
        view = cache.evicting.layers[layer]
        for b in range(2):
            newest = int(view.positions[b].max())  # the last token appended (the last one generated is not)
            for h, cls in enumerate(row):
                held = sorted(int(p) for p in view.positions[b, h][view.valid[b, h]].tolist())
                if cls == S:
                    run = held[2:]
                    assert held[:2] == [0, 1] and run == list(range(newest - len(run) + 1, newest + 1)), (layer, b, h)
                    assert len(held) <= 6 + 4
                else:
                    assert len(held) > 10
