"""kvpolicy against kvpress 0.5.5, the field's reference implementations, on real tensors.

``tests/fixtures/kvpress_parity.pt`` holds the bundled model's (SmolLM2-135M) keys, values and
window queries at four layers for 1,024 tokens of prose, and the slots each kvpress press kept
there per KV head at 256 of 1,024 (``make parity-fixtures`` regenerates it in a venv of its own;
``benchmarks/parity/capture_kvpress.py`` says how). Neither kvpress nor a network is needed here.

Each test runs a kvpolicy policy on the captured tensors and compares the kept slots per head as
sets. Where kvpress departs from the paper or the authors' code, kvpolicy follows the paper and
the test shows the departure explicitly (docs/parity.md lists every result).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

import kvpolicy
from kvpolicy.profile_format import HeadProfile
from kvpolicy.stages.duo import resolve_profile_path
from kvpolicy.stages.leverage import LeverageScorer

FIXTURE = Path(__file__).parent / "fixtures" / "kvpress_parity.pt"


@pytest.fixture(scope="module")
def fx():
    if not FIXTURE.is_file():
        pytest.fail(f"{FIXTURE} is missing: run `make parity-fixtures` (docs/parity.md)")
    data = torch.load(FIXTURE, weights_only=True)
    # kvpress scored float32 upcasts of the stored float16 tensors: so does every test.
    data["keys"] = data["keys"].float()
    data["values"] = data["values"].float()
    return data


def layers(fx) -> range:
    return range(len(fx["meta"]["layers"]))


def layer_inputs(fx, i: int, queries: str = "queries"):
    """Keys, values and queries of captured layer ``i``, with a batch axis."""
    return fx["keys"][i : i + 1], fx["values"][i : i + 1], fx[queries][i : i + 1]


def kvpress_kept(fx, press: str, i: int) -> list[set[int]]:
    """The slots kvpress's ``press`` kept at captured layer ``i``, one set per KV head."""
    kept = fx["kept"][press][i]
    if kept.dtype == torch.bool:  # Ada-KV: a keep mask per head
        return [set(row.nonzero().flatten().tolist()) for row in kept]
    return [set(row.tolist()) for row in kept]


def kept_sets(kept: torch.Tensor) -> list[set[int]]:
    """``[1, Hkv, K]`` slot indices, or a ``[1, Hkv, N]`` keep mask, as one set per head."""
    if kept.dtype == torch.bool:
        return [set(row.nonzero().flatten().tolist()) for row in kept[0]]
    return [set(row.tolist()) for row in kept[0]]


def assert_same_slots(got: list[set[int]], want: list[set[int]], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} heads, kvpress {len(want)}"
    for h, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == b, (
            f"{what}, head {h}: {len(a & b)} of kvpress's {len(b)} slots kept; kvpolicy only "
            f"{sorted(a - b)[:10]}, kvpress only {sorted(b - a)[:10]}"
        )


def overlap(fx, press: str, select) -> float:
    """Fraction of kvpress's kept slots that ``select(i)`` also keeps, over every layer and head."""
    same = total = 0
    for i in layers(fx):
        for a, b in zip(select(i), kvpress_kept(fx, press, i), strict=True):
            same += len(a & b)
            total += len(b)
    return same / total


def variant(name: str, schedule: dict | None = None, **fields) -> kvpolicy.Policy:
    """A built-in policy with schedule fields or whole top-level fields (stages) replaced."""
    doc = yaml.safe_load(kvpolicy.load_policy(name).to_yaml())
    doc["schedule"].update(schedule or {})
    doc.update(fields)
    return kvpolicy.load_policy(doc)


def test_fixture_is_what_the_tests_assume(fx):
    meta = fx["meta"]
    n, kept, w = meta["tokens"], meta["kept"], meta["window"]
    nl, hkv, hq, d = len(meta["layers"]), meta["num_key_value_heads"], meta["num_attention_heads"], meta["head_dim"]
    assert meta["kvpress"] == "0.5.5"
    assert fx["keys"].shape == fx["values"].shape == (nl, hkv, n, d)
    assert fx["queries"].shape == (nl, hq, w, d) and fx["last_query"].shape == (nl, hq, 1, d)
    assert fx["queries"].dtype == torch.float32  # exactly the queries kvpress used, not rounded
    for press, per_layer in fx["kept"].items():
        assert len(per_layer) == nl, press
        for t in per_layer:
            if t.dtype == torch.bool:
                assert t.shape == (hkv, n) and int(t.sum()) == hkv * kept, press
            else:
                assert t.shape[0] == hkv and t.shape[1] <= n, press
                assert all(len(set(row.tolist())) == t.shape[1] for row in t), f"{press}: duplicate slots"
    duo = fx["duo"]
    assert duo["weights"].shape == duo["streaming"].shape == (meta["num_layers"], hkv)
    assert len(duo["keep"]) == nl and all(t.shape == (hkv, n) and t.dtype == torch.bool for t in duo["keep"])


# -- identical kept slots ------------------------------------------------------------------------


def test_streamingllm_keeps_kvpress_slots(fx):
    policy = kvpolicy.load_policy("streamingllm", budget=fx["meta"]["kept"])
    for i in layers(fx):
        got = kept_sets(policy.select(*layer_inputs(fx, i)))
        assert_same_slots(got, kvpress_kept(fx, "streaming_llm", i), f"streamingllm, layer {fx['meta']['layers'][i]}")


def test_knorm_keeps_kvpress_slots(fx):
    policy = kvpolicy.load_policy("knorm", budget=fx["meta"]["kept"])
    for i in layers(fx):
        got = kept_sets(policy.select(*layer_inputs(fx, i)))
        assert_same_slots(got, kvpress_kept(fx, "knorm", i), f"knorm, layer {fx['meta']['layers'][i]}")


def test_tova_keeps_kvpress_slots(fx):
    # TOVA reads the current query only: kvpress's one-row projection of the last position.
    policy = kvpolicy.load_policy("tova", budget=fx["meta"]["kept"])
    for i in layers(fx):
        got = kept_sets(policy.select(*layer_inputs(fx, i, "last_query")))
        assert_same_slots(got, kvpress_kept(fx, "tova", i), f"tova, layer {fx['meta']['layers'][i]}")


def test_tova_departure_kvpress_always_keeps_the_newest_token(fx):
    """kvpress pads the newest token's TOVA score to max + 1; TOVA's code keeps it only if its
    attention earns it. On the captured layers it always does (hence identical slots above); here
    the newest key is turned away from every query so that it does not."""
    budget = fx["meta"]["kept"]
    keys, values, q = layer_inputs(fx, 0, "last_query")
    keys = keys.clone()
    n = keys.shape[2]
    g = q.shape[1] // keys.shape[1]
    # Each head's newest key becomes minus its group's mean query, scaled: the lowest attention.
    keys[0, :, -1] = -q[0, :, 0].view(keys.shape[1], g, -1).mean(1) * 10
    paper = kept_sets(kvpolicy.load_policy("tova", budget=budget).select(keys, values, q))
    as_kvpress = kept_sets(kvpolicy.load_policy("tova", budget=budget, recent=1).select(keys, values, q))
    assert all(n - 1 not in s for s in paper)  # the paper's rule drops it...
    assert all(n - 1 in s for s in as_kvpress)  # ...kvpress's keeps it
    # The rest of kvpress's rule is the paper's: the top budget - 1 of the older slots.
    logits = torch.einsum("hd,hnd->hn", q[0, :, 0], keys[0].repeat_interleave(g, 0)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(logits, -1)  # over every key, the newest included
    score = probs.mean(0)  # [N]: every query head of the layer, one decision for all KV heads
    want = set(score[:-1].topk(budget - 1).indices.tolist()) | {n - 1}
    assert all(s == want for s in as_kvpress)


def test_keydiff_scorer_keeps_kvpress_slots(fx):
    # kvpress's KeyDiffPress scores every key against the mean unit key, with no sinks and no
    # recent buffer: the plugin's scorer composed the same way keeps the same slots.
    policy = variant("keydiff", {"budget": fx["meta"]["kept"], "recent": 0}, reservations=[])
    for i in layers(fx):
        got = kept_sets(policy.select(*layer_inputs(fx, i)))
        assert_same_slots(got, kvpress_kept(fx, "keydiff", i), f"keydiff scorer, layer {fx['meta']['layers'][i]}")
    # The shipped `keydiff` policy adds sinks and a recent buffer of 64 (the anchor then spans
    # the candidates only), so it keeps other slots: a composition choice, not a definition.
    shipped = kvpolicy.load_policy("keydiff", budget=fx["meta"]["kept"])
    assert overlap(fx, "keydiff", lambda i: kept_sets(shipped.select(*layer_inputs(fx, i)))) < 1.0


@pytest.mark.parametrize(("press", "local_window", "index"), [("cur_projected", 16, 0), ("cur_projected_global", None, 1)])
def test_leverage_keeps_kvpress_cur_slots_given_its_projection(fx, monkeypatch, press, local_window, index):
    """CURPress with its random projection is CurDKV's leverage, as kvpolicy's `leverage` scorer:
    handed kvpress's own draw of the projection, kvpolicy keeps its slots, with kvpress's local
    windows of 16 and without them (CurDKV / VaSE). kvpress keeps sinks 4 and no recent buffer."""
    policy = variant(
        "curdkv", {"budget": fx["meta"]["kept"], "recent": 0},
        scorer={"type": "leverage", "rank": 20, "mode": "kv_product", "projection": "fixed", "local_window": local_window},
    )
    for i in layers(fx):
        p = fx["cur_projection"][i, index]  # [D, r], already scaled by 1/sqrt(r)
        monkeypatch.setattr(LeverageScorer, "projections", lambda self, inp, p=p: p.expand(inp.batch, -1, -1))
        got = kept_sets(policy.select(*layer_inputs(fx, i)))
        assert_same_slots(got, kvpress_kept(fx, press, i), f"{press}, layer {fx['meta']['layers'][i]}")


# -- SnapKV and the allocations built on it --------------------------------------------------------


def all_keys(name: str, **schedule) -> kvpolicy.Policy:
    """``name`` with SnapKV's own normalisation (softmax over every key, the window's included)."""
    doc = yaml.safe_load(kvpolicy.load_policy(name).to_yaml())
    doc["schedule"].update(schedule)
    doc["scorer"]["softmax_over"] = "all"
    return kvpolicy.load_policy(doc)


def test_snapkv_paper_keeps_kvpress_slots(fx):
    policy = kvpolicy.load_policy("snapkv-paper", budget=fx["meta"]["kept"])
    assert policy.schedule.window == fx["meta"]["window"] == policy.schedule.recent
    for i in layers(fx):
        got = kept_sets(policy.select(*layer_inputs(fx, i)))
        assert_same_slots(got, kvpress_kept(fx, "snapkv", i), f"snapkv-paper, layer {fx['meta']['layers'][i]}")


def test_snapkv_departure_softmax_over_the_candidates(fx):
    """The shipped `snapkv` (VaSE's decode-time "Attn", as the spec and the reference tables
    define it) normalises each window query's softmax over the candidates only, so it keeps
    most but not all of the slots kvpress's SnapKV keeps; `snapkv-paper` keeps them all (above)."""
    policy = kvpolicy.load_policy("snapkv", budget=fx["meta"]["kept"])
    share = overlap(fx, "snapkv", lambda i: kept_sets(policy.select(*layer_inputs(fx, i))))
    assert 0.9 < share < 1.0, f"snapkv keeps {share:.4f} of kvpress's SnapKV slots"
    # The whole difference is the normalisation: the same policy over every key matches.
    same = all_keys("snapkv", budget=fx["meta"]["kept"])
    assert overlap(fx, "snapkv", lambda i: kept_sets(same.select(*layer_inputs(fx, i)))) == 1.0


def test_ada_snapkv_with_snapkv_normalisation_keeps_kvpress_slots(fx):
    """kvpress's AdaKVPress over SnapKVPress: the layer's slots pooled across heads by score after
    a floor of int(0.2 * 256) per head. The window (64 per head) ranks first in both and already
    covers the floor, so the rules coincide: per head, the same keep mask."""
    policy = all_keys("ada-snapkv", budget=fx["meta"]["kept"])
    for i in layers(fx):
        keep, counts = policy.select_heads(*layer_inputs(fx, i))
        assert int(counts.sum()) == counts.shape[1] * fx["meta"]["kept"]
        assert_same_slots(kept_sets(keep), kvpress_kept(fx, "ada_snapkv", i), f"ada-snapkv, layer {fx['meta']['layers'][i]}")
    shipped = kvpolicy.load_policy("ada-snapkv", budget=fx["meta"]["kept"])
    share = overlap(fx, "ada_snapkv", lambda i: kept_sets(shipped.select_heads(*layer_inputs(fx, i))[0]))
    assert share < 1.0  # the shipped one normalises over the candidates, as `snapkv`


@pytest.mark.parametrize("press", ["pyramidkv", "pyramidkv_beta4"])
def test_pyramidkv_keeps_kvpress_slots_at_its_layer_budgets(fx, press):
    """Within a layer PyramidKV is SnapKV at that layer's budget: at each layer's kvpress count,
    kvpolicy's pyramidkv (with SnapKV's normalisation) keeps kvpress's slots."""
    policy = all_keys("pyramidkv", budget=fx["meta"]["kept"])
    for i in layers(fx):
        count = fx["kept"][press][i].shape[1]
        keep, counts = policy.select_heads(*layer_inputs(fx, i), budget=count)
        assert bool((counts == count).all())
        assert_same_slots(kept_sets(keep), kvpress_kept(fx, press, i), f"{press}, layer {fx['meta']['layers'][i]}")


@pytest.mark.parametrize("beta", [20, 4])
def test_pyramidkv_departure_layer_budgets(fx, beta):
    """kvpolicy's layer budgets follow PyramidKV's code (KVCache-Factory): every layer keeps the
    window, and the line from 2(k - w) - (k - w)/beta (first layer) to (k - w)/beta (last) runs
    over the rest. kvpress runs the line over the whole budget, from 2k - k/beta to k/beta,
    window included, and falls back to uniform SnapKV when k/beta is below the window (beta 20
    here). Its first layer thus keeps w(1 - 1/beta) more, its last w(1 - 1/beta) fewer."""
    meta = fx["meta"]
    k, w, m = meta["kept"], meta["window"], meta["num_layers"]
    doc = yaml.safe_load(kvpolicy.load_policy("pyramidkv").to_yaml())
    doc["schedule"]["budget"] = k
    doc["allocation"]["beta"] = beta
    budgets = [s.budget for s in kvpolicy.load_policy(doc).layer_schedules(m)]
    assert doc["schedule"]["recent"] == doc["schedule"]["window"] == w
    first, last = w + 2 * (k - w) - (k - w) / beta, w + (k - w) / beta
    authors = [first + (last - first) * layer / (m - 1) for layer in range(m)]
    assert sum(budgets) == m * k
    assert all(abs(b - a) < 1 for b, a in zip(budgets, authors, strict=True))

    press = "pyramidkv" if beta == 20 else "pyramidkv_beta4"
    counts = [t.shape[1] for t in fx["kept"][press]]
    if k / beta < w:  # kvpress's fallback
        assert counts == [k] * len(meta["layers"])
    else:
        line = [2 * k - k / beta - layer * (2 * k - 2 * k / beta) / (m - 1) for layer in meta["layers"]]
        assert counts == [round(x) for x in line]
    mine = [budgets[layer] for layer in meta["layers"]]
    assert counts != mine
    assert budgets[0] > budgets[-1]  # kvpolicy's pyramid slopes whatever beta


def _top_with_sinks(score: torch.Tensor, budget: int, sinks: int = 4) -> list[set[int]]:
    """Per head, the first ``sinks`` slots and the top of ``score [Hkv, N]`` up to ``budget``."""
    score = score.clone()
    score[:, :sinks] = float("inf")
    return [set(row.tolist()) for row in score.topk(budget, dim=-1).indices]


def _windowed(x: torch.Tensor, window: int = 16) -> torch.Tensor:
    """``x [..., N]`` divided by its sum over consecutive windows of ``window`` slots."""
    n = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, (-n) % window)).unflatten(-1, (-1, window))
    return (blocks / blocks.sum(-1, keepdim=True)).flatten(-2)[..., :n]


def test_curdkv_follows_the_paper_where_kvpress_default_does_not(fx):
    """kvpress's default CURPress scores exact squared norms (no random projection) normalised in
    windows of 16: not CurDKV's Gaussian-projection leverage (spec: P ~ N(0, 1)/sqrt(r), r = 20),
    which kvpolicy's `curdkv` computes. Shown here: kvpress's default keeps the top of the exact
    norms, and `curdkv` the top of the paper's projected score, with its own projection."""
    from kvpolicy.policy import eviction_input

    meta = fx["meta"]
    budget = meta["kept"]
    policy = kvpolicy.load_policy("curdkv", budget=budget, recent=0)
    scorer = policy.config.scorer
    assert isinstance(scorer, LeverageScorer) and scorer.local_window is None
    differs = False
    for i in layers(fx):
        keys, values, q = layer_inputs(fx, i)
        layer = meta["layers"][i]
        exact = _windowed(keys[0].square().sum(-1)) * _windowed(values[0].square().sum(-1))
        assert _top_with_sinks(exact, budget) == kvpress_kept(fx, "cur", i)
        # The paper's score, with the projection kvpolicy draws for this layer.
        inp = eviction_input(keys, values, q, budget=budget, recent=0, seed=policy.resolve_seed(), layer_idx=layer)
        p = scorer.projections(inp)[0]
        paper = (keys[0] @ p).square().sum(-1) * (values[0] @ p).square().sum(-1)
        got = kept_sets(policy.select(keys, values, q, layer_idx=layer))
        assert got == _top_with_sinks(paper, budget)
        differs |= got != kvpress_kept(fx, "cur", i)
    assert differs


# -- presses that read the model (model facts: RoPE, the output projection) ----------------------
def fixture_facts(fx) -> kvpolicy.ModelFacts:
    """The bundled model's facts as the fixture stores them: its RoPE table (positions up to
    N + 512) and the output projection of the layers where the model-reading presses ran."""
    meta, mf = fx["meta"], fx["model_facts"]
    cos, sin = mf["rope_cos"], mf["rope_sin"]
    projections = {meta["layers"][i]: mf["output_projection"][j].float() for j, i in enumerate(mf["layers"])}

    def rope(positions):
        return cos[positions], sin[positions]

    def projection(layer):
        if layer not in projections:
            raise KeyError(f"the fixture holds no output projection of layer {layer}")
        return projections[layer]

    return kvpolicy.ModelFacts(
        name=meta["model"], num_layers=meta["num_layers"], num_attention_heads=meta["num_attention_heads"],
        num_kv_heads=meta["num_key_value_heads"], head_dim=meta["head_dim"],
        hidden_size=mf["output_projection"].shape[-1], rope_fn=rope, output_projection_fn=projection,
    )


def facts_layers(fx):
    """``(j, i, layer)``: the model-facts index, the captured-layer index and the model layer."""
    return [(j, i, fx["meta"]["layers"][i]) for j, i in enumerate(fx["model_facts"]["layers"])]


def kvpress_kept_facts(fx, press: str, j: int) -> list[set[int]]:
    return [set(row.tolist()) for row in fx["model_facts"]["kept"][press][j]]


@pytest.mark.parametrize("covariance, press", [(True, "expected_attention"), (False, "expected_attention_nocov")])
def test_expected_attention_keeps_kvpress_slots(fx, covariance, press):
    """kvpress scores at prefill, from every prompt query past the 4 sinks, with the future
    positions right after the prompt: the same policy given the whole prompt's queries (rotated
    to their positions, as a cache holds them) and no recent buffer keeps the same slots."""
    facts = fixture_facts(fx)
    policy = variant("expected-attention", {"budget": fx["meta"]["kept"], "recent": 0},
                     scorer={**kvpolicy.load_policy("expected-attention").config.scorer.describe(),
                             "use_covariance": covariance, "n_future_positions": fx["model_facts"]["future"]})
    n = fx["meta"]["tokens"]
    for j, i, layer in facts_layers(fx):
        pre = fx["model_facts"]["prerope_queries"][j].float()[None]  # [1, Hq, N, D]
        cos, sin = facts.rope(torch.arange(n))
        queries = pre * cos + torch.cat([-pre[..., 32:], pre[..., :32]], -1) * sin  # RoPE, as the model applies it
        keys, values, _ = layer_inputs(fx, i)
        got = kept_sets(policy.select(keys, values, queries, layer_idx=layer, model=facts))
        assert_same_slots(got, kvpress_kept_facts(fx, press, j), f"expected-attention, layer {layer}")


def test_criticalkv_keeps_kvpress_slots(fx):
    facts = fixture_facts(fx)
    policy = kvpolicy.load_policy("criticalkv", budget=fx["meta"]["kept"])
    assert policy.schedule.window == fx["meta"]["window"] == policy.schedule.recent
    for j, i, layer in facts_layers(fx):
        got = kept_sets(policy.select(*layer_inputs(fx, i), layer_idx=layer, model=facts))
        assert_same_slots(got, kvpress_kept_facts(fx, "criticalkv", j), f"criticalkv, layer {layer}")


def test_expected_attention_departure_kvpress_rotates_a_buffer_from_its_length(fx):
    """kvpress's DecodingPress hands ExpectedAttentionPress a buffer of recent hidden states and
    takes the buffer's length as the position: the last 64 queries are then statistics of tokens
    0..63, carried to positions [64, 576), not to those after the 1,024 tokens. kvpolicy takes each
    query at its own position and rotates to the positions that follow it (the paper's rule), so it
    keeps other slots; given kvpress's positions instead, it keeps exactly kvpress's."""
    from kvpolicy.policy import eviction_input

    facts = fixture_facts(fx)
    policy = variant("expected-attention", {"budget": fx["meta"]["kept"], "recent": 0})
    n, w = fx["meta"]["tokens"], fx["meta"]["window"]
    same = total = 0
    for j, i, layer in facts_layers(fx):
        pre = fx["model_facts"]["prerope_queries"][j].float()[None, :, n - w:]  # the buffer's queries
        keys, values, _ = layer_inputs(fx, i)
        want = kvpress_kept_facts(fx, "expected_attention_buffer", j)

        def rotated(positions, pre=pre):
            cos, sin = facts.rope(positions)
            return pre * cos + torch.cat([-pre[..., 32:], pre[..., :32]], -1) * sin

        paper = kept_sets(policy.select(keys, values, rotated(torch.arange(n - w, n)), layer_idx=layer, model=facts))
        for a, b in zip(paper, want, strict=True):
            same += len(a & b)
            total += len(b)
        inp = eviction_input(keys, values, rotated(torch.arange(w)), budget=policy.budget, recent=0, seed=0,
                             layer_idx=layer, query_positions=torch.arange(w)[None], model=facts)
        as_kvpress = kept_sets(policy.select_from(inp))
        assert_same_slots(as_kvpress, want, f"expected-attention at kvpress's buffer positions, layer {layer}")
    assert same < total, "the rotation to the positions that follow the prompt changes no slot here"


# -- ChunkKV, LagKV, DuoAttention ----------------------------------------------------------------


@pytest.mark.parametrize("length", [10, 20])
def test_chunkkv_departure_kvpress_shares_chunks_across_kv_heads(fx, length):
    """kvpress's ChunkKVPress sums its base press's scores over the KV heads, so every KV head of
    a layer keeps the same chunks; kvpolicy's chunkkv ranks each head's chunks by that head's own
    attention. Set to kvpress's other settings (chunks of 10, kvpolicy's, or 20, kvpress's default;
    SnapKVPress without pooling as the base press, so the softmax over every key; kvpress's count,
    whole chunks, the window's included), kvpolicy keeps most but not all of kvpress's slots;
    with the scores summed over the KV heads (``shared_heads``), exactly kvpress's."""
    press = f"chunkkv_{length}"
    count = fx["kept"][press][0].shape[1]
    assert all(bool((t == t[0]).all()) for t in fx["kept"][press])  # the same slots at every head
    assert (count - fx["meta"]["window"]) % length == 0  # whole chunks, and the window
    scorer = {**kvpolicy.load_policy("chunkkv").config.scorer.describe(), "softmax_over": "all"}
    policy = variant("chunkkv", {"budget": count}, scorer=scorer, selector={"type": "chunks", "chunk_size": length})
    assert policy.schedule.recent == policy.schedule.window == fx["meta"]["window"]
    share = overlap(fx, press, lambda i: kept_sets(policy.select(*layer_inputs(fx, i))))
    assert 0.5 < share < 1.0, f"chunkkv per KV head keeps {share:.4f} of kvpress's ChunkKV slots"
    # The shipped chunkkv (chunks of 10, softmax over the candidates, the exact budget) also differs.
    shipped = kvpolicy.load_policy("chunkkv", budget=fx["meta"]["kept"])
    assert overlap(fx, press, lambda i: kept_sets(shipped.select(*layer_inputs(fx, i)))) < 1.0
    # The whole difference is where the chunks are chosen: scores summed over the KV heads (the
    # shared_heads scorer) keep exactly kvpress's slots.
    shared = variant("chunkkv", {"budget": count}, scorer={"type": "shared_heads", "scorer": scorer},
                     selector={"type": "chunks", "chunk_size": length})
    for i in layers(fx):
        got = kept_sets(shared.select(*layer_inputs(fx, i)))
        assert_same_slots(got, kvpress_kept(fx, press, i), f"chunkkv over shared scores, layer {fx['meta']['layers'][i]}")


def _lagkv(fx, **scorer) -> kvpolicy.Policy:
    """The shipped lagkv at the count LagKV ran with (its sinks and tail, 256, and a quarter of
    each scored partition), with ``scorer`` fields changed."""
    meta = fx["meta"]
    data = kvpolicy.load_policy("lagkv").config.to_dict()
    data["scorer"].update(scorer)
    policy = kvpolicy.load_policy(data, budget=meta["lag_kept"])
    s = policy.config.scorer
    assert (s.lag_size, s.sink, s.score_v_ratio) == (meta["lag_size"], meta["lag_sink"], 1.0)
    return policy


def test_lagkv_keeps_kvpress_slots(fx):
    """kvpress's default LagKVPress replaces each token's score by its rank within its partition,
    so that every partition keeps the same share (the official code keeps ratio x lag_size tokens
    of each), as the shipped lagkv does (``rank_within_partition``); its sinks and tail score 1,
    above every token, as kvpolicy ranks them first. Identical slots, the same count of every
    partition (its recent 64 lie in the tail)."""
    meta = fx["meta"]
    n, lag, sink, count = meta["tokens"], meta["lag_size"], meta["lag_sink"], meta["lag_kept"]
    parts = (n - sink) // lag - 1  # scored partitions: the last full one is the tail's
    fixed = set(range(sink)) | set(range(sink + parts * lag, n))  # sinks and tail: always kept
    per_part = (count - len(fixed)) // parts
    assert len(fixed) + parts * per_part == count
    policy = _lagkv(fx)
    assert policy.config.scorer.rank_within_partition
    for i in layers(fx):
        want = kvpress_kept(fx, "lagkv", i)
        for kept in want:  # kvpress: the same share of each partition
            assert kept >= fixed
            assert [sum(sink + p * lag <= j < sink + (p + 1) * lag for j in kept) for p in range(parts)] == (
                [per_part] * parts)
        assert_same_slots(kept_sets(policy.select(*layer_inputs(fx, i))), want, f"lagkv, layer {meta['layers'][i]}")


def test_lagkv_across_partitions_keeps_kvpress_cross_scoring_slots(fx):
    """LagKVPress with ``cross_scoring`` ranks the partitions' tokens by their score, (s_K + s_V) / 2,
    across partitions, as the lag scorer ranks s_K + s_V with ``rank_within_partition: false``.
    Identical slots; and the two rules differ on this fixture (the shipped rule keeps some but not
    all of these), so each test decides something."""
    cross = _lagkv(fx, rank_within_partition=False)
    for i in layers(fx):
        got = kept_sets(cross.select(*layer_inputs(fx, i)))
        assert_same_slots(got, kvpress_kept(fx, "lagkv_cross", i), f"lagkv across partitions, layer {fx['meta']['layers'][i]}")
    share = overlap(fx, "lagkv_cross", lambda i: kept_sets(_lagkv(fx).select(*layer_inputs(fx, i))))
    assert 0.9 < share < 1.0, f"the shipped lagkv keeps {share:.4f} of kvpress's cross-scoring slots"


def test_duo_attention_departure_retrieval_heads_share_a_fixed_total(fx):
    """DuoAttentionPress, handed the weights of kvpolicy's duo-attention profile with its 4 sinks
    and 64 recent tokens, streams the same heads (the lowest-weighted half of the model's); its
    streaming heads keep the sinks and recent tokens, its retrieval heads every token (the paper).
    kvpolicy fixes the model's total (layers x KV heads x budget), so at the fixture's budget a
    retrieval head keeps only its share, about 2 x 256 - 68 = 444 slots (the page's departure): kvpolicy
    keeps a subset of kvpress's slots, all of them on the streaming heads. At a layer budget whose
    share covers the prompt, it keeps every slot kvpress keeps and beyond them only the layer's
    remainder (Hkv x the layer budget - kvpress's count, fewer than Hkv), on its streaming heads."""
    meta, duo = fx["meta"], fx["duo"]
    hkv = meta["num_key_value_heads"]
    policy = kvpolicy.load_policy("duo-attention", budget=meta["kept"])
    alloc = policy.config.allocation
    assert torch.equal(duo["weights"], HeadProfile.load(resolve_profile_path(alloc.path)).head_weights())
    assert torch.equal(duo["streaming"], ~alloc.retrieval)  # the same streaming heads
    assert duo["head_compression_ratio"] == alloc.streaming_fraction
    assert (duo["sink"], duo["recent"]) == (alloc.sinks, policy.schedule.recent)
    schedules = policy.layer_schedules(meta["num_layers"])
    same = total = 0
    for i, layer in enumerate(meta["layers"]):
        want = kept_sets(duo["keep"][i][None])
        streaming = duo["streaming"][layer].tolist()
        assert all(len(b) == (duo["sink"] + duo["recent"] if s else meta["tokens"]) for b, s in zip(want, streaming, strict=True))
        keep, _ = policy.select_heads(*layer_inputs(fx, i), layer_idx=layer, budget=schedules[layer].budget)
        for h, (a, b, s) in enumerate(zip(kept_sets(keep), want, streaming, strict=True)):
            assert a <= b, f"layer {layer}, head {h}: kvpolicy keeps slots kvpress masks"
            assert a == b or not s, f"layer {layer}, streaming head {h}: other slots than kvpress's"
            same += len(a & b)
            total += len(b)
        # A layer budget whose retrieval share covers the prompt: every slot kvpress keeps.
        count = sum(len(b) for b in want)
        budget = -(-count // hkv)
        keep, _ = policy.select_heads(*layer_inputs(fx, i), layer_idx=layer, budget=budget)
        got = kept_sets(keep)
        assert all(a == b if not s else a >= b for a, b, s in zip(got, want, streaming, strict=True)), layer
        assert sum(map(len, got)) - count == hkv * budget - count < hkv
    assert 0 < same / total < 1, f"duo-attention keeps {same / total:.4f} of kvpress's DuoAttention slots"


# -- DMSPress: thresholds (benchmarks/parity/capture_kvpress_dms.py) -------------------------------
DMS_FIXTURE = Path(__file__).parent / "fixtures" / "kvpress_dms.pt"


@pytest.fixture(scope="module")
def dms_fx():
    if not DMS_FIXTURE.is_file():
        pytest.skip(f"{DMS_FIXTURE} is missing: run `make parity-fixtures` (benchmarks/parity/capture_kvpress_dms.py)")
    return torch.load(DMS_FIXTURE, weights_only=True)


def dms_policy(meta, *, budget: int, interval: int = 1) -> kvpolicy.Policy:
    """kvpolicy's ``dms`` at kvpress's threshold and window: the budget (each head's pool) large
    enough that no head is capped, so that only the threshold decides."""
    return kvpolicy.load_policy({
        "name": "dms-parity",
        "schedule": {"budget": budget, "recent": meta["window"], "interval": interval, "window": 0,
                     "compress_prompt": True, "evict_above": "recent"},
        "scorer": {"type": "arrival_score", "scorer": {"type": "key_norm", "low_norm_first": True}},
        "selector": {"type": "threshold", "threshold": meta["threshold"]},
    })


def test_dms_keeps_dmspress_unmasked_pairs_at_the_prompt(dms_fx):
    """DMSPress(KnormPress) at the prompt: kvpolicy's ``dms`` keeps exactly the (head, position)
    pairs kvpress leaves unmasked, on every captured layer; kvpolicy frees the rest."""
    meta = dms_fx["meta"]
    n = meta["tokens"]
    policy = dms_policy(meta, budget=n)
    for i in range(len(meta["layers"])):
        keys = dms_fx["keys"][i : i + 1, :, :n]
        hkv, d = keys.shape[1], keys.shape[3]
        keep, counts = policy.select_heads(keys, keys, torch.zeros(1, 3 * hkv, 0, d))
        assert bool((counts < n).all()), "a head was capped by the pool: raise the budget"
        assert torch.equal(keep[0], ~dms_fx["masked_prompt"][i]), meta["layers"][i]


def test_dms_keeps_dmspress_unmasked_pairs_while_decoding(dms_fx):
    """DMSPress(KnormPress, decoding=True) through the prompt and every decoding step: a cache
    running ``dms`` (evicting each step, as DMSPress decides each token leaving the window)
    holds exactly the pairs kvpress leaves unmasked, and holds nothing more: kvpress keeps every
    token in memory (its cache grows by one per step and per head), kvpolicy frees what it masks.
    That is the whole difference: the bytes held are kvpress's unmasked fraction of its cache."""
    meta = dms_fx["meta"]
    p, total = meta["tokens"], meta["tokens"] + meta["decode"]
    policy = dms_policy(meta, budget=total)
    for i in range(len(meta["layers"])):
        keys = dms_fx["keys"][i : i + 1]
        hkv = keys.shape[1]
        cache = kvpolicy.EvictingCache(policy, num_layers=1)
        cache.step(0, keys[:, :, :p], keys[:, :, :p])
        for t in range(p, total):
            cache.evict_due()
            cache.step(0, keys[:, :, t : t + 1], keys[:, :, t : t + 1])
        cache.evict_due()
        view = cache.layers[0]
        held = torch.zeros(hkv, total, dtype=torch.bool)
        for h in range(hkv):
            pos = view.positions[0, h][view.valid[0, h]]
            assert pos.unique().numel() == pos.numel()
            held[h, pos] = True
        unmasked = ~dms_fx["masked_decode"][i]
        assert torch.equal(held, unmasked), meta["layers"][i]
        # Memory: kvpolicy holds the unmasked pairs only; kvpress holds all hkv * total of them.
        assert cache.head_counts(0).sum() == int(unmasked.sum()) < hkv * total
        assert bool((cache.head_counts(0) < total - 1).all()), "a head was capped by the pool"
