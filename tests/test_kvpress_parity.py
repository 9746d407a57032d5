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
