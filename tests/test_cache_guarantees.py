"""The cache layer's promises at their edges: the cache keeps what ``Policy.select`` chooses, a
reset cache is a fresh one, padded rows decode as alone (stochastic policies too), and misuse
(an interrupted forward, a cache built for another model, a refusal inside attention) is a clear
error that never poisons the next run."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
from helpers import facts_for, load_fitting  # noqa: E402
from hf_util import CACHE_ARG, assert_rows_decode_as_alone, fresh, left_padded_prompt, tiny_qwen3  # noqa: E402
from hf_util import generate as _generate  # noqa: E402

import kvpolicy  # noqa: E402
from kvpolicy import EvictingCache, KVPolicyCache, load_policy  # noqa: E402
from kvpolicy.state import CacheStateError  # noqa: E402

VOCAB = 512
SMALL = {"budget": 32, "recent": 8, "interval": 8, "window": 8}
pytestmark = pytest.mark.usefixtures("one_thread")

# H2O-style: the only attention reader is a reservation; the selector keeps the protected slots.
H2O_LIKE = {
    "name": "h2o-like",
    "schedule": dict(SMALL),
    "reservations": [{"type": "top_scores", "scorer": {"type": "attention"}, "n": 0.75, "include_prior": False}],
    "selector": {"type": "keep_protected"},
}
# The same choice written with a scorer and a greedy selector.
H2O_AS_GREEDY = {
    "name": "h2o-as-greedy",
    "schedule": dict(SMALL),
    "scorer": {"type": "attention"},
    "selector": {"type": "greedy"},
}


def _small(name: str, **extra):
    over = {"budget": 32, "recent": 28, "interval": 8} if name == "streamingllm" else dict(SMALL)
    over.update(extra)
    return load_policy(name, **over)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_qwen3(layers=3, vocab=VOCAB)


_fresh = fresh


def _prompt(batch=2, length=20, pads=(0, 5), seed=0):
    return left_padded_prompt(VOCAB, batch, length, pads, seed)


def _steps(seed=0, n=40, b=2, hkv=2, hq=4, d=8, prompt=10):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = prompt if i == 0 else 1
        out.append((torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g),
                    torch.randn(b, hq, t, d, generator=g)))
    return out


# -- 1. Policy.select on the cache's own state keeps what the cache keeps ---------------------------
def _fits(policy, layers: int, hkv: int) -> bool:
    """Whether the policy serves a model of this shape (``duo-attention`` is bound to its head
    profile's model: tests/test_duo_attention.py runs it in a cache)."""
    try:
        policy.layer_schedules(layers, hkv)
        facts_for(policy, layers, hkv, 2 * hkv)
    except kvpolicy.PolicyError:
        return False
    return True


EVICTING = [name for name in kvpolicy.available_policies()
            if load_policy(name).mode == "evict" and _fits(load_policy(name), 2, 2)]


@pytest.mark.parametrize("source", [*EVICTING, H2O_LIKE])
def test_cache_keeps_what_select_chooses_on_its_state(source):
    """For every registered evicting policy (stochastic ones and a seed other than 0 included, and a policy
    whose only attention reader is a reservation), each eviction of each layer keeps exactly
    ``Policy.select`` on the cache's state, given the layer, row streams and eviction counts
    (``Policy.select_heads`` with the layer's budget, for per-layer and per-head allocations), and
    for a policy whose stages keep state, the layer's state and which window queries it has not seen."""
    name = source if isinstance(source, str) else source["name"]
    over = {"budget": 16, "recent": 12, "interval": 4} if name == "streamingllm" else {
        "budget": 16, "recent": 4, "interval": 4, "window": 4}
    policy = load_fitting(source, seed=3, **over)
    facts = facts_for(policy, 2, 2, 4)
    cache = EvictingCache(policy, num_layers=2, independent_rows=name == "random", model_facts=facts)
    checked = 0
    for step, (k, v, q) in enumerate(_steps(seed=1, n=30)):
        expected = {}
        for layer, view in enumerate(cache.layers):  # layers of other budgets evict at other steps
            if view.eviction_due:
                window, wvalid = view.window()
                keep, _ = policy.select_heads(
                    view.keys, view.values, window, slot_valid=view.valid, query_valid=wvalid,
                    positions=view.positions, layer_idx=layer, evictions=view.evictions, streams=view.streams,
                    budget=cache.schedules[layer].budget, state=view.state, query_new=view.window_new, model=facts,
                    prompt_lengths=view.prompt_lengths,
                )
                expected[layer] = _held(view.positions, keep)
        for layer in range(2):
            cache.step(layer, k, v, q)
            if layer in expected:
                view = cache.layers[layer]
                got = _held(view.positions[..., :-1], view.valid[..., :-1])
                assert got == expected[layer], (name, step, layer)
                checked += 1
    assert checked >= 4, name


def _held(positions: torch.Tensor, mask: torch.Tensor) -> list[list[list[int]]]:
    """Per row and head, the positions where ``mask`` holds, ascending."""
    return [[sorted(p[m].tolist()) for p, m in zip(ph, mh, strict=True)] for ph, mh in zip(positions, mask, strict=True)]


def test_a_reservation_only_attention_reader_sees_the_query_window(qwen3):
    """H2O-style: no scorer, an attention ``top_scores`` reservation. The cache must hand it the
    same window as a scorer gets, so it keeps what the greedy policy keeps, step by step and
    token by token through generate()."""
    reserve, greedy = load_policy(H2O_LIKE), load_policy(H2O_AS_GREEDY)
    a, b = EvictingCache(reserve, 2), EvictingCache(greedy, 2)
    for k, v, q in _steps(seed=2, n=40):
        for layer in range(2):
            ka, _, _ = a.step(layer, k, v, q)
            kb, _, _ = b.step(layer, k, v, q)
            assert torch.equal(ka, kb)
    assert a.stats()[0].evictions > 0
    ids, mask = _prompt(seed=4)
    m1, m2 = _fresh(qwen3), _fresh(qwen3)
    out_reserve = _generate(m1, KVPolicyCache(reserve, m1), ids, mask, 60)
    out_greedy = _generate(m2, KVPolicyCache(greedy, m2), ids, mask, 60)
    assert torch.equal(out_reserve, out_greedy)


# -- 2. reset is fresh; seeded runs reproduce; padded rows equal rows alone ----------------------------
@pytest.mark.parametrize("name", ["vase-attnv", "vase-dkv", "random", "random-prompt", "curdkv"])
def test_a_reset_cache_decodes_exactly_as_a_fresh_one(qwen3, name):
    model = _fresh(qwen3)
    ids, mask = _prompt(seed=5)
    cache = KVPolicyCache(_small(name), model)
    first = _generate(model, cache, ids, mask, 70)
    assert min(s.evictions for s in cache.stats()) > 0
    cache.reset()
    again = _generate(model, cache, ids, mask, 70)
    fresh = _generate(model, KVPolicyCache(_small(name), model), ids, mask, 70)
    assert torch.equal(first, again) and torch.equal(again, fresh)


@pytest.mark.parametrize("name", ["vase-attnv", "vase-dkv", "random", "random-prompt"])
@pytest.mark.parametrize("pad", [3, 8])
def test_stochastic_padded_rows_decode_as_alone(qwen3, name, pad):
    """Each row draws from its own stream (keyed by its layer and its own evictions), so a
    stochastic policy gives a padded row the tokens it gets alone."""
    ids, mask = _prompt(pads=(0, pad), seed=6)
    assert_rows_decode_as_alone(_fresh(qwen3), _small(name), ids, mask, 72)


def test_independent_rows_draw_apart_and_reproduce():
    """With ``independent_rows`` two identical rows evict differently (several samples of one
    prompt); by default they evict alike."""
    policy = _small("vase-attnv", budget=16, recent=4, interval=4, window=4)
    steps = [(k[:1].expand(2, -1, -1, -1), v[:1].expand(2, -1, -1, -1), q[:1].expand(2, -1, -1, -1))
             for k, v, q in _steps(seed=7, n=30)]

    def run(**kw):
        cache = EvictingCache(policy, 1, **kw)
        for k, v, q in steps:
            cache.step(0, k, v, q)
        return cache.layers[0].positions

    shared, independent = run(), run(independent_rows=True)
    assert torch.equal(shared[0], shared[1])
    assert not torch.equal(independent[0], independent[1])
    assert torch.equal(independent, run(independent_rows=True))


# -- 3. misuse: clear errors, never a poisoned next run --------------------------------------------------
def test_a_refusal_inside_attention_does_not_poison_the_next_run(qwen3):
    model = _fresh(qwen3)
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    ids, mask = _prompt(seed=8)
    cache = KVPolicyCache(_small("snapkv"), model)
    model.train()  # training with attention dropout: refused inside the attention function
    with pytest.raises(NotImplementedError, match="dropout"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **{CACHE_ARG: cache})
    model.eval()
    ref = _generate(model, KVPolicyCache(_small("snapkv"), model), ids, mask, 20)  # a new cache works
    assert torch.equal(_generate(model, cache, ids, mask, 20), ref)  # and so does the refused one


def test_an_interrupted_forward_is_refused_until_reset(qwen3):
    model = _fresh(qwen3)
    ids, mask = _prompt(seed=9)
    cache = KVPolicyCache(_small("snapkv"), model)
    _generate(model, cache, ids, mask, 10)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    hook = model.model.layers[2].register_forward_pre_hook(boom)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(input_ids=torch.tensor([[5], [6]]), **{CACHE_ARG: cache})  # layers 0 and 1 appended
    hook.remove()
    with pytest.raises(CacheStateError, match="reset"), torch.no_grad():
        model(input_ids=torch.tensor([[5], [6]]), **{CACHE_ARG: cache})
    cache.reset()
    fresh = _generate(model, KVPolicyCache(_small("snapkv"), model), ids, mask, 12)
    assert torch.equal(_generate(model, cache, ids, mask, 12), fresh)


def test_a_cache_built_for_another_model_is_refused(qwen3):
    model = _fresh(qwen3)  # 3 layers
    two = copy.deepcopy(model.config)
    two.num_hidden_layers = 2
    kvpolicy.hf.register()
    model.set_attn_implementation("kvpolicy")
    ids, mask = _prompt(seed=10)
    with pytest.raises(IndexError, match="built for 2 layers"):
        _generate(model, KVPolicyCache(_small("snapkv"), two), ids, mask, 3)
    four = copy.deepcopy(model.config)
    four.num_hidden_layers = 4
    with pytest.raises(CacheStateError, match="another number of layers"):
        _generate(model, KVPolicyCache(_small("snapkv"), four), ids, mask, 3)


def test_evicting_cache_out_of_step_and_mid_step_errors():
    cache = EvictingCache(_small("snapkv"), 2)
    (k, v, q), (k1, v1, q1) = _steps(seed=11, n=2)
    cache.step(0, k, v, q)
    with pytest.raises(CacheStateError, match="layers \\[1\\]"):
        cache.step(0, k1, v1, q1)  # layer 1 never wrote the prompt
    with pytest.raises(CacheStateError):
        cache.select_rows([1, 0])  # mid-step
    cache.reset()
    cache.step(0, k, v, q)
    cache.step(1, k, v, q)
    cache.step(0, k1, v1, q1)
    with pytest.raises(CacheStateError, match="begun with"):
        cache.step(1, k, v, q)  # the prompt's 10 tokens where the step has 1


@pytest.mark.parametrize("name", ["pyramidkv", "cake", "layers"])
def test_layers_of_their_own_budgets_are_held_to_one_step(name):
    """Per-layer budgets give layers buffers of their own (one group each), whose own checks see
    only their own layers. Found from outside: under ``pyramidkv`` and ``cake`` a layer could run
    ahead of the others (an interrupted forward, then the next one: layer 0 counted 12 tokens,
    the others 10), a cache built for more layers than the model served it, rows were reordered
    in the middle of a step and layers took steps of other lengths or batch sizes, all
    silently. Each is now the ``CacheStateError`` a cache of one budget raises."""
    if name == "layers":
        policy = load_policy({"name": "l", "schedule": dict(SMALL), "scorer": {"type": "attention"},
                              "selector": {"type": "greedy"}, "allocation": {"type": "layers", "budgets": [3, 2, 1]}})
    else:
        policy = _small(name)
    (k, v, q), (k1, v1, q1), (k2, v2, q2) = _steps(seed=12, n=3)
    cache = EvictingCache(policy, 3)
    for layer in range(3):
        cache.step(layer, k, v, q)
    assert len({id(g) for g in cache._groups}) == 3  # a group per layer: what the checks must span
    cache.step(0, k1, v1, q1)  # the forward stops after layer 0
    with pytest.raises(CacheStateError, match=r"cannot reorder rows: layers \[1, 2\]"):
        cache.select_rows([1, 0])
    with pytest.raises(CacheStateError, match=r"layers \[1, 2\] did not write the last step"):
        cache.step(0, k2, v2, q2)
    with pytest.raises(CacheStateError, match="begun with 2 rows of 1 tokens"):
        cache.step(1, k, v, q)  # the prompt's 10 tokens where the step has 1
    with pytest.raises(CacheStateError, match="begun with 2 rows of 1 tokens"):
        cache.step(1, k1[:1], v1[:1], q1[:1])  # one row where the step has 2
    assert [cache.tokens_seen(layer) for layer in range(3)] == [11, 10, 10]
    cache.step(1, k1, v1, q1)
    cache.step(2, k1, v1, q1)
    cache.select_rows([1, 0])  # every layer wrote the step: served
    cache.step(0, k2, v2, q2)
    assert [cache.tokens_seen(layer) for layer in range(3)] == [12, 11, 11]

    first = EvictingCache(policy, 3)
    first.step(0, k, v, q)
    with pytest.raises(CacheStateError, match="begun with 2 rows of 10 tokens"):
        first.step(1, k[:1], v[:1], q[:1])  # the prompt of one row where layer 0's has 2

    four = EvictingCache(policy if name != "layers" else _small("pyramidkv"), 4)  # the model has 3
    for layer in range(3):
        four.step(layer, k, v, q)
    with pytest.raises(CacheStateError, match=r"layers \[3\] did not write the last step"):
        four.step(0, k1, v1, q1)
    four.reset()
    for layer in range(4):
        four.step(layer, k, v, q)
    four.step(0, k1, v1, q1)  # a reset cache serves its 4 layers


@pytest.mark.parametrize("name", ["snapkv", "vase-attnv", "h2o"])
@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_padding_after_real_tokens_leaves_a_rows_query_window_as_alone(name, data):
    """Found from outside: a padding token mid-decode (``token_valid`` False after the row's
    real tokens) took a shared query-window entry, so the row's window lost a real query and
    ``snapkv`` / ``vase-attnv`` kept other slots than the row alone (outputs 0.3-0.8 apart).
    Padding anywhere, and chunks of several tokens, leave each row's window as it is alone."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    policy = load_policy(name, budget=12, recent=4, interval=4, window=data.draw(st.integers(1, 4), label="window"))
    b, h, grp, d, prompt = 2, 2, 2, 8, data.draw(st.integers(1, 8), label="prompt")
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=8, max_size=24), label="chunks")
    total = prompt + sum(chunks)
    k, v = torch.randn(b, h, total, d, generator=g), torch.randn(b, h, total, d, generator=g)
    q = torch.randn(b, h * grp, total, d, generator=g)
    real = torch.ones(b, total, dtype=torch.bool)
    real[1, prompt:] = torch.tensor(data.draw(st.lists(st.booleans(), min_size=total - prompt,
                                                       max_size=total - prompt), label="row 1 real"))
    batch, alone = EvictingCache(policy, 1), EvictingCache(policy, 1)
    start = 0
    for t in [prompt, *chunks]:
        s = slice(start, start + t)
        out = batch.attend(0, q[:, :, s], k[:, :, s], v[:, :, s], token_valid=real[:, s])
        mine = real[1, s]
        if bool(mine.any()):
            idx = mine.nonzero().flatten() + start
            solo = alone.attend(0, *(x[1:, :, idx] for x in (q, k, v)))
            torch.testing.assert_close(out[1, :, mine.nonzero().flatten()], solo[0], rtol=1e-5, atol=1e-5)
        start += t
