"""G-KV: the smoothed attention score kept across compressions, against a float64 loop reference
of G-KV's rules (EvictingCache and generate()), padded rows, and its stages' edges."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_state_rows_alone, random_steps
from reference import TokenLoopCache, softmax

import kvpolicy
from kvpolicy import EvictingCache, load_policy
from kvpolicy.stages import GKVScorer, NormalizedScorer, SmoothedAttentionScorer

SMALL = {"budget": 16, "recent": 4, "interval": 4, "window": 4}


def _gkv(**over) -> kvpolicy.Policy:
    return load_policy("gkv", **{**SMALL, **over})


# -- a float64 loop reference of G-KV -------------------------------------------------------------
class GKVReference(TokenLoopCache):
    """G-KV on one layer, token by token, in float64 Python loops (``reference.TokenLoopCache``),
    microsoft/G-KV's ``ScoreBasedKV.update_kv`` with ``enable_score_cache``,
    ``suppressing_redundancy``, max smoothing. No per-query state: a compression reads the
    row's last ``window`` queries.

    At a compression of a row, per KV head, over the ``C`` oldest held tokens (the rest is the
    window of recent tokens):

    - local ``l_j``: for each of the last ``window`` queries, the softmax of its logits over every
      held token at or before it; the max over the query heads of the group; the mean over the
      queries; divided by the max over the ``C`` tokens;
    - ``s_j = max(alpha * s_old_j, l_j)`` for a token scored at an earlier compression, else ``l_j``;
    - redundancy: unit keys, cosine matrix over all held tokens with a zero diagonal, each row's
      most recent column above 0.5 (column 0 when none) zeroed, column means, softmax over all
      tokens, the first ``C`` divided by their max;
    - keep the ``budget - recent`` tokens of largest ``lam * s - (1 - lam) * red`` and the window;
      the kept tokens store ``s``.
    """

    def __init__(self, schedule, batch: int, hkv: int, hq: int, alpha=0.8, lam=0.5):
        super().__init__(schedule, batch, hkv, hq)
        self.alpha, self.lam = alpha, lam

    def fresh(self, pos: int) -> dict:
        return {"s": None}  # not scored yet

    def rank(self, b: int, h: int) -> tuple[list[float], list[dict]]:
        """The final score of each of the ``C`` candidate tokens of row ``b``, head ``h``, and the
        smoothed ``s`` a kept one stores."""
        entries = self.held[b][h]
        n = len(entries)
        c = n - self.s.recent
        d = entries[0]["k"].numel()
        local = [0.0] * c
        window = list(self.queries[b])
        for qpos, q in window:
            seen = [e for e in entries if e["pos"] <= qpos]
            per_head = [softmax([float(q[qh] @ e["k"]) / math.sqrt(d) for e in seen])
                        for qh in range(h * self.g, (h + 1) * self.g)]
            for j in range(min(c, len(seen))):
                local[j] += max(p[j] for p in per_head) / len(window)
        top = max(local)
        local = [x / top for x in local]
        s = [x if e["s"] is None else max(self.alpha * e["s"], x) for x, e in zip(local, entries, strict=False)]
        unit = [e["k"] / (e["k"].norm() + 1e-8) for e in entries]
        sim = [[0.0 if i == j else float(unit[i] @ unit[j]) for j in range(n)] for i in range(n)]
        for i in range(n):
            above = [j for j in range(n) if sim[i][j] > 0.5]
            sim[i][above[-1] if above else 0] = 0.0
        red = softmax([sum(sim[i][j] for i in range(n)) / n for j in range(n)])[:c]
        red = [x / max(red) for x in red]
        final = [self.lam * x - (1 - self.lam) * r for x, r in zip(s, red, strict=True)]
        return final, [{"s": x} for x in s]

    def stored(self, b: int, h: int) -> list[float]:
        return [-1.0 if e["s"] is None else e["s"] for e in self.held[b][h]]


_steps = random_steps

def _held(view, b: int) -> list[list[int]]:
    return [view.positions[b, h][view.valid[b, h]].tolist() for h in range(view.positions.shape[1])]


@pytest.mark.parametrize("hkv,hq", [(2, 2), (2, 6)], ids=["mha", "gqa"])
@pytest.mark.parametrize("compress_prompt,count", [(True, "tokens"), (False, "slots")])
def test_gkv_cache_equals_float64_reference(hkv, hq, compress_prompt, count):
    """Held tokens, attention outputs and every token's stored score equal the loop reference
    through many compressions (a prompt longer than the budget, compressed once it is in or not),
    MHA and GQA. The smoothing is exercised: kept scores decay by alpha until refreshed."""
    policy = _gkv(compress_prompt=compress_prompt, count=count)
    cache = EvictingCache(policy, num_layers=2)
    refs = [GKVReference(policy.schedule, 2, hkv, hq) for _ in range(2)]
    evicted = decayed = 0
    for step, (k, v, q, valid) in enumerate(_steps(2, hkv, hq, 8, prompt=22, n=40, seed=21 + hkv)):
        for layer in range(2):
            out = cache.attend(layer, q, k, v)
            want = refs[layer].feed(k, v, q, valid)
            for b in range(2):
                torch.testing.assert_close(out[b], want[b], rtol=1e-9, atol=1e-9)
        cache.evict_due()  # the reference compresses at the end of the step; the cache before the next
        for layer, ref in enumerate(refs):
            view = cache.layers[layer]
            state = view.state["smoothed_attention.score"]
            for b in range(2):
                if ref.due(b):
                    before = {id(e): e["s"] for head in ref.held[b] for e in head}
                    ref.evict(b, [set(p) for p in _held(view, b)], tol=1e-6)
                    decayed += sum(  # kept on its decayed old score, not its new local one
                        1 for head in ref.held[b] for e in head
                        if before.get(id(e)) is not None and e["s"] == 0.8 * before[id(e)]
                    )
                    evicted += 1
                assert _held(view, b) == [ref.positions(b, h) for h in range(hkv)], (step, layer, b)
                for h in range(hkv):
                    torch.testing.assert_close(
                        state[b, h][view.valid[b, h]].double(), torch.tensor(ref.stored(b, h), dtype=torch.float64),
                        rtol=1e-6, atol=1e-6, msg=lambda m, s=step, h=h: f"step {s} head {h}: {m}",
                    )
    assert evicted >= 30 and decayed >= 10, (evicted, decayed)


def test_gkv_padded_rows_equal_rows_alone():
    """A left-padded batch: each row's held tokens and stored scores equal the row run alone."""
    for pads in ((0, 5), (3, 0)):
        steps = _steps(2, 2, 4, 8, prompt=20, n=25, seed=3, pads=pads)
        batch = assert_state_rows_alone(_gkv(), steps, ["smoothed_attention.score"])
        assert batch.stats()[0].evictions >= 5


def test_gkv_generate_equals_float64_reference():
    """``generate()`` with the policy's cache: after every layer call, the held tokens, the
    attention outputs and, at every compression, the stored scores equal the loop reference fed
    the same keys, values and queries (a prompt longer than the budget, compressed at prefill)."""
    pytest.importorskip("transformers")
    from hf_util import generate, tiny_qwen3

    model = tiny_qwen3(layers=2, vocab=128)
    policy = _gkv()
    cache = kvpolicy.KVPolicyCache(policy, model)
    evicting = cache.evicting
    calls = []
    attend = evicting.attend

    def recording(layer_idx, queries, keys, values, token_valid=None, *, scaling=None):
        out = attend(layer_idx, queries, keys, values, token_valid, scaling=scaling)
        view = evicting.layers[layer_idx]
        calls.append((layer_idx, queries.clone(), keys.clone(), values.clone(), out.clone(), _held(view, 0), view.state))
        return out

    evicting.attend = recording
    ids = torch.randint(3, 128, (1, 22), generator=torch.Generator().manual_seed(2))
    generate(model, cache, ids, torch.ones_like(ids), 30)
    del evicting.attend

    refs: dict[int, GKVReference] = {}
    evicted = 0
    for layer, q, k, v, out, held, state in calls:
        ref = refs.setdefault(layer, GKVReference(policy.schedule, 1, k.shape[1], q.shape[1]))
        if ref.steps and ref.due(0):  # the cache compressed as this call began: the newest tokens are new
            before = ref.tokens[0]
            ref.evict(0, [{p for p in head if p < before} for head in held], tol=1e-4)
            for h in range(ref.hkv):
                n = len(ref.held[0][h])
                torch.testing.assert_close(state["smoothed_attention.score"][0, h, :n].double(),
                                           torch.tensor(ref.stored(0, h), dtype=torch.float64), rtol=1e-4, atol=1e-5)
            evicted += 1
        want = ref.feed(k, v, q, torch.ones(1, k.shape[2], dtype=torch.bool))
        torch.testing.assert_close(out[0].double(), want[0], rtol=1e-4, atol=1e-5)
        assert held == [ref.positions(0, h) for h in range(ref.hkv)], (layer, ref.steps)
    assert evicted >= 10, evicted


@pytest.mark.usefixtures("one_thread")
def test_gkv_generate_padded_rows_decode_as_alone():
    pytest.importorskip("transformers")
    from hf_util import assert_rows_decode_as_alone, left_padded_prompt, tiny_qwen3

    model = tiny_qwen3(layers=2, vocab=128)
    ids, mask = left_padded_prompt(128, batch=2, length=20, pads=(0, 5))
    assert_rows_decode_as_alone(model, _gkv(), ids, mask, 24)


# -- the stages at their edges --------------------------------------------------------------------
def test_gkv_defaults_follow_the_official_script():
    policy = load_policy("gkv")
    s = policy.schedule
    assert (s.budget, s.recent, s.interval, s.window, s.count, s.compress_prompt) == (1024, 16, 128, 16, "tokens", True)
    scorer = policy.config.scorer
    assert isinstance(scorer, GKVScorer) and scorer.mix_lambda == 0.5
    att = scorer.attention
    assert isinstance(att, SmoothedAttentionScorer)
    assert (att.alpha, att.smooth, att.normalize, att.group_reduce) == (0.8, "max", True, "max")
    assert isinstance(scorer.redundancy, NormalizedScorer)
    assert scorer.redundancy.scorer.describe() == {"type": "redundancy", "threshold": 0.5, "over": "all",
                                                   "chunk_elements": 1 << 21}
    assert policy.keeps_state and not policy.observes_queries  # updated once per compression
    assert list(policy.state_fields) == ["smoothed_attention.score"] and not policy.stochastic


@pytest.mark.parametrize("smooth", ["max", "mean", "sum"])
def test_smoothing_rules(smooth):
    """One candidate scored before (0.5) and one new, against the local score computed alone."""
    att = SmoothedAttentionScorer(alpha=0.6, smooth=smooth)
    policy = load_policy({"name": "s", "schedule": {"budget": 4, "recent": 1, "interval": 2, "window": 2},
                          "scorer": att, "selector": "greedy"})
    g = torch.Generator().manual_seed(4)
    k, v, q = torch.randn(1, 1, 6, 4, generator=g), torch.randn(1, 1, 6, 4, generator=g), torch.randn(1, 2, 2, 4, generator=g)
    inp = kvpolicy.policy.eviction_input(k, v, q, budget=4, recent=1, slot_valid=None, query_valid=None,
                                         positions=None, seed=0)
    local = att.local_scores(inp)[0, 0]
    old = torch.tensor([0.5, -1.0, 0.5, -1.0, -1.0, -1.0]).view(1, 1, 6)
    state = {"smoothed_attention.score": old}
    new = policy.observe(kvpolicy.policy.eviction_input(
        k, v, q, budget=4, recent=1, slot_valid=None, query_valid=None, positions=None, seed=0,
        state=policy.nest_state(state)))[1]["smoothed_attention.score"][0, 0]
    mixed = {"max": max(0.3, float(local[0])), "mean": 0.3 + 0.4 * float(local[0]), "sum": 0.3 + float(local[0])}[smooth]
    torch.testing.assert_close(new[0], torch.tensor(mixed))
    torch.testing.assert_close(new[1], local[1])
    assert float(new[5]) == -1.0  # the recent slot is not scored: new at the next compression
    assert float(local.max()) == pytest.approx(1.0)


def test_local_score_without_queries_is_zero():
    att = SmoothedAttentionScorer()
    k = torch.randn(1, 2, 6, 4)
    inp = kvpolicy.policy.eviction_input(k, k, torch.randn(1, 2, 3, 4), budget=4, recent=1, slot_valid=None,
                                         query_valid=torch.zeros(1, 3, dtype=torch.bool), positions=None, seed=0)
    assert torch.equal(att.local_scores(inp), torch.zeros(1, 2, 6))


def test_normalized_keeps_order_and_sign():
    from kvpolicy.stages import RandomScorer

    inner = RandomScorer()
    norm = NormalizedScorer(scorer=inner)
    k = torch.randn(2, 2, 10, 4)
    inp = kvpolicy.policy.eviction_input(k, k, torch.randn(2, 2, 1, 4), budget=6, recent=2, slot_valid=None,
                                         query_valid=None, positions=None, seed=5)
    raw, scaled = inner.score(inp), norm.score(inp)
    cand = inp.candidate_mask
    top = raw.masked_fill(~cand, 0).abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scaled, torch.where(cand, raw / top, 0.0))
    assert not norm.may_be_negative
    # What the nested scorer declares counts for the policy: it draws, so the policy is stochastic.
    assert [type(s) for s in norm.walk()] == [NormalizedScorer, RandomScorer]
    policy = load_policy({"name": "p", "schedule": {"budget": 8, "recent": 2}, "selector": {"type": "greedy"},
                          "scorer": {"type": "normalized", "scorer": {"type": "random"}}})
    assert policy.stochastic


@pytest.mark.parametrize("bad", [
    {"alpha": 1.5}, {"alpha": -0.1}, {"alpha": float("nan")}, {"smooth": "ema"}, {"group_reduce": "sum"},
    {"tile_elements": 0},
])
def test_bad_hyperparameters_are_refused(bad):
    with pytest.raises(ValueError):
        SmoothedAttentionScorer(**bad)


@pytest.mark.parametrize("mix_lambda", [-0.1, 1.1, float("inf")])
def test_bad_mix_is_refused(mix_lambda):
    with pytest.raises(kvpolicy.PolicyError, match="mix_lambda"):
        load_policy({"name": "g", "schedule": SMALL, "selector": "greedy", "scorer": {
            "type": "gkv", "mix_lambda": mix_lambda, "attention": "smoothed_attention", "redundancy": "redundancy"}})


def test_gkv_is_a_combination_with_its_state():
    """The ``gkv`` scorer equals a ``combination`` of the same two scorers weighted ``lam`` and
    ``-(1 - lam)``: the combination's nested ``smoothed_attention`` keeps its state too (the policy
    walks stages nested in a combination's terms), and both caches hold the same tokens and the
    same stored scores after every step."""
    gkv = _gkv()
    scorer = gkv.config.scorer
    data = gkv.config.model_dump(mode="json", exclude_defaults=True)
    data["name"] = "gkv-as-combination"
    data["scorer"] = {"type": "combination", "terms": [
        {"weight": scorer.mix_lambda, "scorer": scorer.attention.describe()},
        {"weight": -(1.0 - scorer.mix_lambda), "scorer": scorer.redundancy.describe()},
    ]}
    combo = load_policy(data)
    assert list(combo.state_fields) == list(gkv.state_fields) == ["smoothed_attention.score"]
    caches = [EvictingCache(p, num_layers=1) for p in (gkv, combo)]
    for k, v, q, _ in _steps(2, 2, 6, 8, prompt=22, n=40, seed=5):
        outs = [c.attend(0, q, k, v) for c in caches]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        for c in caches:
            c.evict_due()
        a, b = (c.layers[0] for c in caches)
        assert torch.equal(a.positions[a.valid], b.positions[b.valid])
        assert torch.equal(a.state["smoothed_attention.score"][a.valid], b.state["smoothed_attention.score"][b.valid])
    assert caches[0].stats()[0].evictions >= 5
