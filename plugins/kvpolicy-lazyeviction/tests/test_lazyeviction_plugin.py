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
from kvpolicy.schedule import Schedule

# The core suite's helpers for decoding with a tiny transformers model (tests/hf_util.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

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
class LazyReference:
    """LazyEviction on one layer, token by token, in float64 Python loops.

    Every held token of every (row, KV head) carries ``last`` (the index of the query that last
    attended it above the threshold; its own index when it arrives) and ``mri`` (the longest gap
    between two such queries). Each query takes its softmax over the tokens held at its own step
    (its own included), per query head; the heads of a KV head's group are reduced (max or mean);
    every token above the threshold gets ``mri = max(mri, t - last)``, ``last = t``. An eviction
    keeps the ``recent`` newest tokens and the ``budget - recent`` others of highest
    ``1 - (now - last) / (mri + 1)``, ``now`` the newest query's index."""

    def __init__(self, schedule: Schedule, batch: int, hkv: int, hq: int, threshold: float, group_reduce: str):
        self.s, self.hkv, self.g = schedule, hkv, hq // hkv
        self.threshold, self.group_reduce = threshold, group_reduce
        self.held: list[list[list[dict]]] = [[[] for _ in range(hkv)] for _ in range(batch)]
        self.tokens = [0] * batch
        self.now = [-1] * batch
        self.steps = 0

    def feed(self, k, v, q, valid) -> list[torch.Tensor | None]:
        """One step's tokens (``[B, H, T, D]``, ``valid [B, T]``); returns each row's attention
        outputs ``[Hq, T_real, D]``."""
        outs = []
        d = k.shape[-1]
        for b in range(k.shape[0]):
            row_out = []
            for t in range(k.shape[2]):
                if not valid[b, t]:
                    continue
                pos = self.tokens[b]
                self.tokens[b] += 1
                self.now[b] = pos
                for h in range(self.hkv):
                    self.held[b][h].append(
                        {"pos": pos, "k": k[b, h, t].double(), "v": v[b, h, t].double(), "last": pos, "mri": 0})
                heads = []
                for h in range(self.hkv):
                    entries = self.held[b][h]
                    per_head = []
                    for qh in range(h * self.g, (h + 1) * self.g):
                        logits = [float(q[b, qh, t].double() @ e["k"]) / math.sqrt(d) for e in entries]
                        top = max(logits)
                        ex = [math.exp(x - top) for x in logits]
                        probs = [x / sum(ex) for x in ex]
                        per_head.append(probs)
                        heads.append(sum(p * e["v"] for e, p in zip(entries, probs, strict=True)))
                    for j, e in enumerate(entries):
                        column = [p[j] for p in per_head]
                        a = max(column) if self.group_reduce == "max" else sum(column) / len(column)
                        if a > self.threshold:
                            e["mri"] = max(e["mri"], pos - e["last"])
                            e["last"] = pos
                row_out.append(torch.stack(heads))
            outs.append(torch.stack(row_out, 1) if row_out else None)
        self.steps += 1
        return outs

    def due(self, b: int) -> bool:
        return bool(self.s.due(len(self.held[b][0]), self.tokens[b], prompt=self.steps == 1))

    def score(self, b: int, e: dict) -> float:
        return 1.0 - (self.now[b] - e["last"]) / (e["mri"] + 1)

    def evict(self, b: int, kept: list[set[int]]) -> None:
        """Check that ``kept`` (per head, the positions the cache kept) is the recent buffer and a top
        ``budget - recent`` of the reference's scores (equal scores may go either way), and
        continue from it."""
        for h in range(self.hkv):
            entries = self.held[b][h]
            cut = len(entries) - self.s.recent
            old, recent = entries[:cut], entries[cut:]
            chosen = [e for e in old if e["pos"] in kept[h]]
            dropped = [e for e in old if e["pos"] not in kept[h]]
            assert {e["pos"] for e in recent} <= kept[h], (b, h)  # the recent buffer is always kept
            assert len(chosen) == self.s.budget - self.s.recent == len(kept[h]) - len(recent), (b, h, sorted(kept[h]))
            if dropped:
                worst_kept = min(self.score(b, e) for e in chosen)
                best_dropped = max(self.score(b, e) for e in dropped)
                assert worst_kept >= best_dropped, (b, h, worst_kept, best_dropped)
            self.held[b][h] = chosen + recent

    def positions(self, b: int, h: int) -> list[int]:
        return [e["pos"] for e in self.held[b][h]]


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
        got_last = state["state0.last"][b, h][held].tolist()
        got_mri = state["state0.mri"][b, h][held].tolist()
        assert got_last == [e["last"] for e in ref.held[b][h]], (label, b, h)
        assert got_mri == [e["mri"] for e in ref.held[b][h]], (label, b, h)
    assert state["state0.now"][b].tolist() == [ref.now[b]] * ref.hkv, label
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
    mri = state["state0.mri"][valid]
    assert int(mri.max()) >= 5 and bool((mri == 0).any())
    scores = LazyEvictionScorer(threshold=THRESHOLD)
    assert scores.may_be_negative


@pytest.mark.parametrize("pads", [(0, 5), (3, 0)])
def test_padded_rows_equal_rows_alone(pads):
    """A left-padded batch: each row's held tokens and state equal the row run alone."""
    policy = _policy()
    batch = EvictingCache(policy, num_layers=1)
    alone = [EvictingCache(policy, num_layers=1) for _ in range(2)]
    for k, v, q, valid in _steps(2, 2, 4, 8, prompt=14, n=25, seed=3, pads=pads):
        batch.attend(0, q, k, v, token_valid=None if bool(valid.all()) else valid)
        for r in range(2):
            keep = valid[r]
            alone[r].attend(0, q[r : r + 1, :, keep], k[r : r + 1, :, keep], v[r : r + 1, :, keep])
        view = batch.layers[0]
        for r in range(2):
            mine = alone[r].layers[0]
            held = view.valid[r]
            assert view.positions[r][held].view(2, -1).tolist() == mine.positions[0].tolist()
            for name in ("state0.last", "state0.mri"):
                assert torch.equal(view.state[name][r][held].view(2, -1), mine.state[name][0]), name
            assert torch.equal(view.state["state0.now"][r], mine.state["state0.now"][0])
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
        assert state["state0.last"][0, h, :n].tolist() == [e["last"] for e in ref.held[0][h][:n]], label
        assert state["state0.mri"][0, h, :n].tolist() == [e["mri"] for e in ref.held[0][h][:n]], label


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
    assert set(policy.state_fields) == {"state0.last", "state0.mri", "state0.now"}


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
            probs = []
            for qh in (2 * h, 2 * h + 1):
                logits = [float(q[0, qh, w].double() @ e["k"]) / math.sqrt(8) for e in ref.held[0][h][: t + 1]]
                z = sum(math.exp(x - max(logits)) for x in logits)
                probs.append([math.exp(x - max(logits)) / z for x in logits])
            for j, e in enumerate(ref.held[0][h][: t + 1]):
                if max(p[j] for p in probs) > THRESHOLD:
                    e["mri"], e["last"] = max(e["mri"], t - e["last"]), t
    ref.now = [19]
    ref.evict(0, [set(kept[0, h].tolist()) for h in range(2)])


# -- discovery through the installed entry point -----------------------------------------------
def test_entry_point_is_installed():
    matches = [ep for ep in entry_points(group="kvpolicy") if ep.name == "lazyeviction"]
    assert matches, "kvpolicy-lazyeviction is not installed: pip install -e plugins/kvpolicy-lazyeviction"
    assert matches[0].value == "kvpolicy_lazyeviction.plugin"


def test_the_plugin_declares_contract_3():
    from kvpolicy.hookspecs import ACCEPTED_CONTRACTS

    assert plugin.kvpolicy_contract() == 3 and 3 in ACCEPTED_CONTRACTS


def test_registry_discovers_the_plugin():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        registry = Registry()
    scorer = registry.stages["scorer"]["lazyeviction"]
    assert scorer.plugin == "lazyeviction" and scorer.obj is LazyEvictionScorer
    assert registry.policies["lazyeviction"].plugin == "lazyeviction"
    assert "lazyeviction" in kvpolicy.available_policies()
