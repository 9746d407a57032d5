"""Tests of the LazyEviction plugin: the stage against a float64 loop reference of the paper's
rules (through ``EvictingCache`` and through ``generate()``), padded rows, and discovery through
its installed entry point."""

from __future__ import annotations

import math
import sys
import warnings
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from kvpolicy_lazyeviction import LazyEvictionScorer, plugin

import kvpolicy
from kvpolicy import EvictingCache, load_policy
from kvpolicy.registry import PluginLoadWarning, Registry, reset_registry

# The core suite's helpers for decoding with a tiny transformers model (tests/hf_util.py) and its
# float64 token-loop cache (tests/reference.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from reference import TokenLoopCache, softmax  # noqa: E402

THRESHOLD = 0.08  # of the order of 1/N for the few dozen slots held here: some hits, some misses


@pytest.fixture(autouse=True)
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _policy(budget=16, recent=4, interval=4, window=4, threshold=THRESHOLD, group_reduce="max", **schedule):
    return load_policy({
        "name": "lazy-test",
        "schedule": {"budget": budget, "recent": recent, "interval": interval, "window": window, **schedule},
        "scorer": {"type": "lazyeviction", "threshold": threshold, "group_reduce": group_reduce},
        "selector": "greedy",
    })


# -- a float64 loop reference of LazyEviction ---------------------------------------------------
class LazyReference(TokenLoopCache):
    """LazyEviction on one layer, token by token, in float64 Python loops (the core suite's
    ``reference.TokenLoopCache``).

    Every held token of every (row, KV head) carries ``last`` (the index of the query that last
    attended it above the threshold; its own index when it arrives) and ``mri`` (the longest gap
    between two such queries). Each query takes its softmax over the tokens held at its own step
    (its own included), per query head; the heads of a KV head's group are reduced (max or mean);
    every token above the threshold gets ``mri = max(mri, t - last)``, ``last = t``. An eviction
    keeps the ``recent`` newest tokens and the ``budget - recent`` others of highest
    ``1 - (now - last) / (mri + 1)``, ``now`` the newest query's index."""

    def __init__(self, schedule, batch: int, hkv: int, hq: int, threshold: float, group_reduce: str):
        super().__init__(schedule, batch, hkv, hq)
        self.threshold, self.group_reduce = threshold, group_reduce

    def fresh(self, pos: int) -> dict:
        return {"last": pos, "mri": 0}

    def update(self, b, h, pos, entries, probs) -> None:
        for j, e in enumerate(entries):
            column = [p[j] for p in probs]
            a = max(column) if self.group_reduce == "max" else sum(column) / len(column)
            if a > self.threshold:
                e["mri"] = max(e["mri"], pos - e["last"])
                e["last"] = pos

    def rank(self, b: int, h: int) -> tuple[list[float], None]:
        return [1.0 - (self.now[b] - e["last"]) / (e["mri"] + 1) for e in self.candidates(b, h)], None


def _steps(batch, hkv, hq, d, prompt, n, seed, pads=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    for i, t in enumerate([prompt] + [1] * n):
        k = torch.randn(batch, hkv, t, d, generator=g, dtype=dtype)
        v = torch.randn(batch, hkv, t, d, generator=g, dtype=dtype)
        q = torch.randn(batch, hq, t, d, generator=g, dtype=dtype) * 2
        valid = torch.ones(batch, t, dtype=torch.bool)
        if i == 0 and pads:
            for r, p in enumerate(pads):
                valid[r, :p] = False
        yield k, v, q, valid


def _held(view, b: int) -> list[list[int]]:
    return [view.positions[b, h][view.valid[b, h]].tolist() for h in range(view.positions.shape[1])]


def _compare_state(view, ref: LazyReference, b: int, label: str) -> bool:
    """The cache's state of row ``b`` equals the reference's, where the state has seen every
    query of the row (it is brought up to date lazily). Returns whether it was compared."""
    if bool(view.window_new[b].any()):
        return False
    state = view.state
    for h in range(ref.hkv):
        held = view.valid[b, h]
        got_last = state["lazyeviction.last"][b, h][held].tolist()
        got_mri = state["lazyeviction.mri"][b, h][held].tolist()
        assert got_last == [e["last"] for e in ref.held[b][h]], (label, b, h)
        assert got_mri == [e["mri"] for e in ref.held[b][h]], (label, b, h)
    assert state["lazyeviction.now"][b].tolist() == [ref.now[b]] * ref.hkv, label
    return True


@pytest.mark.parametrize("hkv,hq", [(2, 2), (2, 6)], ids=["mha", "gqa"])
@pytest.mark.parametrize("compress_prompt", [False, True])
@pytest.mark.parametrize("window,interval,group_reduce", [(4, 4, "max"), (2, 4, "mean"), (4, 2, "max")])
def test_cache_equals_float64_reference(hkv, hq, compress_prompt, window, interval, group_reduce):
    """Held tokens, attention outputs and every token's recurrence state equal the loop reference
    after every step: a prompt five times the window (its queries tracked in chunks as it is
    written), many evictions, windows shorter than the interval (updates between evictions)."""
    policy = _policy(window=window, interval=interval, group_reduce=group_reduce, compress_prompt=compress_prompt)
    cache = EvictingCache(policy, num_layers=2)
    refs = [LazyReference(policy.schedule, 2, hkv, hq, THRESHOLD, group_reduce) for _ in range(2)]
    compared = evicted = 0
    for step, (k, v, q, valid) in enumerate(_steps(2, hkv, hq, 8, prompt=20, n=40, seed=11 + hkv)):
        for layer in range(2):
            out = cache.attend(layer, q, k, v)
            want = refs[layer].feed(k, v, q, valid)
            for b in range(2):
                torch.testing.assert_close(out[b], want[b], rtol=1e-9, atol=1e-9)
        cache.evict_due()  # the reference evicts at the end of the step; the cache before the next
        for layer, ref in enumerate(refs):
            view = cache.layers[layer]
            for b in range(2):
                if ref.due(b):
                    ref.evict(b, [set(p) for p in _held(view, b)])
                    evicted += 1
                assert _held(view, b) == [ref.positions(b, h) for h in range(hkv)], (step, layer, b)
                compared += _compare_state(view, ref, b, f"step {step} layer {layer}")
    assert evicted >= 20 and compared >= 20, (evicted, compared)


def test_the_state_sees_misses_and_long_intervals():
    """The reference run above is not trivial: tokens miss the threshold for many steps and
    come back (intervals of several tokens), and some outlive their MRI."""
    policy = _policy()
    cache = EvictingCache(policy, num_layers=1)
    for k, v, q, _ in _steps(1, 2, 4, 8, prompt=20, n=40, seed=13):
        cache.attend(0, q, k, v)
    cache.evict_due()
    state = cache.layers[0].state
    valid = cache.layers[0].valid
    mri = state["lazyeviction.mri"][valid]
    assert int(mri.max()) >= 5 and bool((mri == 0).any())
    scores = LazyEvictionScorer(threshold=THRESHOLD)
    assert scores.may_be_negative


@pytest.mark.parametrize("pads", [(0, 5), (3, 0)])
def test_padded_rows_equal_rows_alone(pads):
    """A left-padded batch: each row's held tokens and state equal the row run alone."""
    from helpers import assert_state_rows_alone

    steps = _steps(2, 2, 4, 8, prompt=14, n=25, seed=3, pads=pads)
    batch = assert_state_rows_alone(_policy(), steps, ["lazyeviction.last", "lazyeviction.mri"], ["lazyeviction.now"])
    assert batch.stats()[0].evictions >= 3


def test_chunked_prompt_equals_one_step():
    """A prompt fed in chunks of any length leaves the state one long step leaves."""
    policy = _policy(budget=40)
    whole, chunked = EvictingCache(policy, num_layers=1), EvictingCache(policy, num_layers=1)
    (k, v, q, _), *_ = _steps(1, 2, 4, 8, prompt=30, n=0, seed=5)
    whole.attend(0, q, k, v)
    for c0, c1 in ((0, 3), (3, 11), (11, 12), (12, 30)):
        chunked.attend(0, q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1])
    whole.evict_due(), chunked.evict_due()
    for name, t in whole.layers[0].state.items():
        assert torch.equal(chunked.layers[0].state[name], t), name


# -- through generate() on a tiny transformers model ---------------------------------------------
@pytest.mark.usefixtures("one_thread")
def test_generate_equals_float64_reference():
    """``generate()`` with the policy's cache: after every layer call, the tokens each KV head
    holds, its attention outputs and (where up to date) the recurrence state equal the loop
    reference fed the same keys, values and queries, through several evictions of a prompt longer
    than the window."""
    pytest.importorskip("transformers")
    from hf_util import generate, tiny_qwen3

    model = tiny_qwen3(layers=2, vocab=128)
    policy = _policy(budget=16, recent=4, interval=4, window=4, threshold=0.05)
    cache = kvpolicy.KVPolicyCache(policy, model)
    evicting = cache.evicting
    calls = []
    attend = evicting.attend

    def recording(layer_idx, queries, keys, values, token_valid=None, *, scaling=None):
        out = attend(layer_idx, queries, keys, values, token_valid, scaling=scaling)
        view = evicting.layers[layer_idx]
        calls.append((layer_idx, queries.clone(), keys.clone(), values.clone(), out.clone(), _held(view, 0),
                      view.state, bool(view.window_new[0].any())))
        return out

    evicting.attend = recording
    ids = torch.randint(3, 128, (1, 22), generator=torch.Generator().manual_seed(1))
    generate(model, cache, ids, torch.ones_like(ids), 30)
    del evicting.attend

    refs = {}
    evicted = compared = 0
    for layer, q, k, v, out, held, state, stale in calls:
        ref = refs.setdefault(layer, LazyReference(policy.schedule, 1, k.shape[1], q.shape[1], 0.05, "max"))
        if ref.steps and ref.due(0):  # the cache evicted as this call began: the newest tokens are new
            before = ref.tokens[0]
            ref.evict(0, [{p for p in head if p < before} for head in held])  # what it kept
            evicted += 1
            # The eviction brought the state up to date with every earlier query.
            _assert_state(state, ref, [len(ref.held[0][h]) for h in range(ref.hkv)], (layer, ref.steps))
            compared += 1
        want = ref.feed(k, v, q, torch.ones(1, k.shape[2], dtype=torch.bool))
        torch.testing.assert_close(out[0].double(), want[0], rtol=1e-4, atol=1e-5)
        assert held == [ref.positions(0, h) for h in range(ref.hkv)], (layer, ref.steps)
        if not stale:
            _assert_state(state, ref, [len(h) for h in held], (layer, ref.steps))
            compared += 1
    assert evicted >= 8 and compared >= 8, (evicted, compared)


def _assert_state(state, ref: LazyReference, lengths: list[int], label) -> None:
    """The first ``lengths[h]`` slots of row 0's state equal the reference's tokens, in order."""
    for h, n in enumerate(lengths):
        assert state["lazyeviction.last"][0, h, :n].tolist() == [e["last"] for e in ref.held[0][h][:n]], label
        assert state["lazyeviction.mri"][0, h, :n].tolist() == [e["mri"] for e in ref.held[0][h][:n]], label


@pytest.mark.usefixtures("one_thread")
def test_generate_padded_rows_decode_as_alone():
    pytest.importorskip("transformers")
    from hf_util import assert_rows_decode_as_alone, left_padded_prompt, tiny_qwen3

    model = tiny_qwen3(layers=2, vocab=128)
    ids, mask = left_padded_prompt(128, batch=2, length=20, pads=(0, 5))
    assert_rows_decode_as_alone(model, _policy(threshold=0.05), ids, mask, 24)


# -- hyperparameters, the named policy, Policy.select --------------------------------------------
@pytest.mark.parametrize("bad", [{"threshold": 0.0}, {"threshold": 1.0}, {"threshold": float("nan")},
                                 {"group_reduce": "sum"}, {"tile_elements": 0}, {"unknown": 1}])
def test_bad_hyperparameters_are_refused(bad):
    with pytest.raises(ValueError):
        LazyEvictionScorer(**bad)
    with pytest.raises(kvpolicy.PolicyError, match="scorer"):
        load_policy({"name": "x", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 4},
                     "scorer": {"type": "lazyeviction", **bad}, "selector": "greedy"})


def test_needs_a_query_window():
    with pytest.raises(kvpolicy.PolicyError, match="window"):
        load_policy({"name": "x", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 0},
                     "scorer": "lazyeviction", "selector": "greedy"})


def test_named_policy_loads_with_overrides():
    policy = load_policy("lazyeviction", budget=512)
    assert policy.budget == 512
    s = policy.schedule
    assert (s.recent, s.interval, s.window) == (128, 128, 128)
    scorer = policy.config.scorer
    assert isinstance(scorer, LazyEvictionScorer) and scorer.threshold == 1e-4
    assert policy.keeps_state and policy.observes_queries
    assert set(policy.state_fields) == {"lazyeviction.last", "lazyeviction.mri", "lazyeviction.now"}


def test_select_on_a_fresh_state():
    """``Policy.select`` without ``state=`` starts from fresh tokens: the window's queries are
    their only history, and a token the window never attended above the threshold has been
    quiet since it arrived."""
    policy = _policy(budget=8, recent=2)
    g = torch.Generator().manual_seed(0)
    k, v, q = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g), 3 * torch.randn(1, 4, 4, 8, generator=g)
    kept = policy.select(k, v, q)
    ref = LazyReference(policy.schedule, 1, 2, 4, THRESHOLD, "max")
    ref.held = [[[{"pos": j, "last": j, "mri": 0, "k": k[0, h, j].double()} for j in range(20)] for h in range(2)]]
    for w, t in enumerate(range(16, 20)):  # the window's queries are tokens 16..19
        for h in range(2):
            seen = ref.held[0][h][: t + 1]
            probs = [softmax([float(q[0, qh, w].double() @ e["k"]) / math.sqrt(8) for e in seen])
                     for qh in (2 * h, 2 * h + 1)]
            ref.update(0, h, t, seen, probs)
    ref.now = [19]
    ref.evict(0, [set(kept[0, h].tolist()) for h in range(2)])


# -- discovery through the installed entry point -----------------------------------------------
def test_entry_point_is_installed():
    matches = [ep for ep in entry_points(group="kvpolicy") if ep.name == "lazyeviction"]
    assert matches, "kvpolicy-lazyeviction is not installed: pip install -e plugins/kvpolicy-lazyeviction"
    assert matches[0].value == "kvpolicy_lazyeviction.plugin"


def test_the_plugin_declares_contract_4():
    """``initial="position"`` (its ``last`` field) is contract 4's."""
    from kvpolicy.hookspecs import ACCEPTED_CONTRACTS

    assert plugin.kvpolicy_contract() == 4 and 4 in ACCEPTED_CONTRACTS


def test_registry_discovers_the_plugin():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        registry = Registry()
    scorer = registry.stages["scorer"]["lazyeviction"]
    assert scorer.plugin == "lazyeviction" and scorer.obj is LazyEvictionScorer
    assert registry.policies["lazyeviction"].plugin == "lazyeviction"
    assert "lazyeviction" in kvpolicy.available_policies()
