"""``random-prompt`` (Random Attention, arXiv 2609.03430): the whole prompt kept, decoded tokens
evicted uniformly at random, each KV head drawing its own subset.

Checked against a reference written here from the rule alone, its random numbers included: a
pure-Python splitmix64 of the draws ``kvpolicy.seeds`` documents (layer seed, row seed, the
``random`` stream, each head's window of it), so a policy that drew from another stream, shared
one draw across heads or ignored ``head_offset`` would disagree. Then the properties (exactly the
budget, the prompt always kept, no duplicates, heads independent, seeded runs reproduce, padded
rows exact), the uniformity of the draw, and the refusal of a prompt the budget cannot hold.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvpolicy import EvictingCache, load_policy
from kvpolicy.stages.guards import SelectionError

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "random-prompt"
MASK = (1 << 64) - 1
GAMMA, MUL1, MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


# -- the reference: splitmix64 on Python ints, and the rule over positions ------------------------
def _mix(x: int) -> int:
    z = (x + GAMMA) & MASK
    z = ((z ^ (z >> 30)) * MUL1) & MASK
    z = ((z ^ (z >> 27)) * MUL2) & MASK
    return z ^ (z >> 31)


def _combine(a: int, b: int) -> int:
    return _mix(_mix(a & MASK) ^ (b & MASK))


def reference_draws(seed: int, layer: int, stream: int, evictions: int, heads: range, n: int) -> list[list[float]]:
    """``[heads][n]`` uniforms of the ``random`` stream for one row's eviction: element ``(h, i)``
    is counter ``h * n + i`` of the row's stream (heads numbered as the model numbers them)."""
    row_seed = _combine(_combine(_combine(seed, layer), stream), evictions)
    base = _combine(row_seed, zlib.crc32(b"random"))
    out = []
    for h in heads:
        bits = [_mix((base + (h * n + i) * GAMMA) & MASK) for i in range(n)]
        out.append([((b >> 40) + 0.5) / (1 << 24) for b in bits])
    return out


def reference_keep(positions: list[int], prompt_len: int, budget: int, recent: int, u: list[float]) -> list[int]:
    """The slots one head keeps: the prompt (valid positions below ``prompt_len``) and the recent
    buffer (the last ``recent`` slots), then the other valid slots of the largest draws until the
    budget is full. ``positions[i] < 0``: padding, never kept while a valid slot is not."""
    n = len(positions)
    if n <= budget:  # nothing to evict
        return list(range(n))
    valid = [i for i in range(n) if positions[i] >= 0]
    assert len(valid) >= budget, "the reference leaves which padding fills a budget to the policy"
    keep = {i for i in valid if positions[i] < prompt_len} | set(range(max(0, n - recent), n))
    assert len(keep) <= budget, "the reference is only asked for prompts that fit"
    others = sorted((i for i in valid if i not in keep), key=lambda i: -u[i])
    keep |= set(others[: max(0, min(budget, n) - len(keep))])
    return sorted(keep)


@st.composite
def cases(draw):
    b, hkv, n = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(2, 40))
    budget = draw(st.integers(1, n))
    recent = draw(st.integers(0, budget - 1))
    pads = [draw(st.integers(0, n - 1)) for _ in range(b)]
    prompts = [draw(st.integers(0, min(n - p, budget - recent))) for p in pads]
    return dict(b=b, hkv=hkv, n=n, budget=budget, recent=recent, pads=pads, prompts=prompts,
                seed=draw(st.integers(0, 2**63 - 1)), layer=draw(st.integers(0, 40)),
                evictions=[draw(st.integers(0, 1000)) for _ in range(b)], head_offset=draw(st.integers(0, 8)),
                data=draw(st.integers(0, 2**31 - 1)))


def _tensors(c):
    g = torch.Generator().manual_seed(c["data"])
    b, hkv, n = c["b"], c["hkv"], c["n"]
    keys = torch.randn(b, hkv, n, 4, generator=g)
    queries = torch.randn(b, hkv, 1, 4, generator=g)
    valid = torch.stack([torch.arange(n) >= p for p in c["pads"]])  # left padding
    positions = torch.where(valid, valid.long().cumsum(-1) - 1, -1)
    return keys, queries, valid, positions


def _select(c, keys, queries, valid, positions, **over):
    policy = load_policy(NAME, budget=c["budget"], recent=c["recent"], interval=1)
    args = dict(slot_valid=valid, positions=positions, layer_idx=c["layer"], evictions=torch.tensor(c["evictions"]),
                seed=c["seed"], head_offset=c["head_offset"], prompt_lengths=torch.tensor(c["prompts"]))
    args.update(over)
    return policy.select(keys, keys, queries, **args)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_select_keeps_what_the_reference_rule_keeps(c):
    keys, queries, valid, positions = _tensors(c)
    assume(c["n"] <= c["budget"] or all(c["n"] - p >= c["budget"] for p in c["pads"]))
    kept = _select(c, keys, queries, valid, positions)
    for r in range(c["b"]):
        draws = reference_draws(c["seed"], c["layer"], 0, c["evictions"][r],
                                range(c["head_offset"], c["head_offset"] + c["hkv"]), c["n"])
        for h in range(c["hkv"]):
            pos = positions[r].tolist()
            cands = [draws[h][i] for i in range(c["n"]) if pos[i] >= c["prompts"][r]]
            assume(len(set(cands)) == len(cands))  # 24-bit draws: a tie would leave the order to the sort
            want = reference_keep(pos, c["prompts"][r], c["budget"], c["recent"], draws[h])
            assert kept[r, h].tolist() == want, (r, h)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_exact_budget_prompt_kept_no_duplicates_and_heads_choose_alone(c):
    keys, queries, valid, positions = _tensors(c)
    kept = _select(c, keys, queries, valid, positions)
    assert kept.shape == (c["b"], c["hkv"], c["budget"])
    for r in range(c["b"]):
        prompt_slots = {i for i in range(c["n"]) if 0 <= positions[r, i] < c["prompts"][r]}
        for h in range(c["hkv"]):
            slots = kept[r, h].tolist()
            assert len(set(slots)) == len(slots) == c["budget"]
            assert prompt_slots <= set(slots)
            # a valid slot is never passed over for padding
            assert sum(not bool(valid[r, i]) for i in slots) == max(0, c["budget"] - int(valid[r].sum()))
    # each head draws its own: a head run alone, as the model's head it is, keeps what it kept
    for h in range(c["hkv"]):
        alone = _select(c, keys[:, h : h + 1], queries[:, h : h + 1], valid, positions,
                        head_offset=c["head_offset"] + h)
        assert torch.equal(alone[:, 0], kept[:, h])


def _decoding(n=96, prompt=16, hkv=4):
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 1, n, 4, generator=g).expand(1, hkv, n, 4).contiguous()  # identical heads
    return keys, torch.randn(1, hkv, 1, 4, generator=g), prompt


def test_heads_with_identical_inputs_keep_different_subsets_and_seeds_reproduce():
    keys, queries, prompt = _decoding()
    policy = load_policy(NAME, budget=48, interval=1)
    kept = policy.select(keys, keys, queries, prompt_lengths=prompt)
    subsets = {tuple(kept[0, h].tolist()) for h in range(4)}
    assert len(subsets) == 4  # one shared draw would give one subset
    again = policy.select(keys, keys, queries, prompt_lengths=prompt)
    assert torch.equal(kept, again)
    other_seed = policy.select(keys, keys, queries, prompt_lengths=prompt, seed=1)
    later = policy.select(keys, keys, queries, prompt_lengths=prompt, evictions=1)
    assert not torch.equal(kept, other_seed) and not torch.equal(kept, later)


def test_every_decoded_token_is_kept_equally_often():
    """Uniform over the decoded tokens: over 800 evictions each of the 80 candidates is kept with
    probability 32 / 80 = 0.4 (within 5 standard deviations), whatever its key or its place."""
    keys, queries, prompt = _decoding()
    policy = load_policy(NAME, budget=48, interval=1)
    counts = torch.zeros(96)
    rounds = 800
    for e in range(rounds):
        kept = policy.select(keys, keys, queries, prompt_lengths=prompt, evictions=e)
        counts += torch.zeros(4, 96).scatter_(-1, kept[0], 1.0).sum(0)
    assert torch.all(counts[:prompt] == 4 * rounds)
    freq = counts[prompt:] / (4 * rounds)
    sd = (0.4 * 0.6 / (4 * rounds)) ** 0.5
    assert float((freq - 0.4).abs().max()) < 5 * sd, freq


# -- in a cache: the prompt is the first step; padded rows draw what they draw alone ---------------
def _run_cache(tokens_valid, steps=60, seed=0, layers=2, hkv=2):
    """Positions each row and head holds after a prompt (``tokens_valid [B, T]``, left padded)
    and ``steps`` decoded tokens; rows get the same tensors whatever the batch."""
    policy = load_policy(NAME, budget=24, interval=4)
    cache = EvictingCache(policy, num_layers=layers, seed=seed)
    b, t = tokens_valid.shape
    for step in range(steps + 1):
        n = t if step == 0 else 1
        for layer in range(layers):
            g = torch.Generator().manual_seed(1000 * step + layer)
            k = torch.randn(1, hkv, n, 4, generator=g).expand(b, hkv, n, 4)
            cache.step(layer, k, k, None, tokens_valid if step == 0 else None)
    return cache


def _held(cache, layer):
    view = cache.layers[layer]
    return [[sorted(p[m].tolist()) for p, m in zip(ph, mh, strict=True)]
            for ph, mh in zip(view.positions, view.valid, strict=True)]


def test_cache_keeps_the_whole_prompt_and_padded_rows_evict_as_alone():
    valid = torch.ones(3, 12, dtype=torch.bool)
    valid[1, :3] = False
    valid[2, :7] = False  # prompts of 12, 9 and 5 real tokens
    batch = _run_cache(valid)
    assert batch.layers[0].prompt_lengths.tolist() == [12, 9, 5]
    assert min(s.evictions for s in batch.stats()) > 5
    for layer in range(2):
        held = _held(batch, layer)
        for r in range(3):
            prompt = int(valid[r].sum())
            alone = _held(_run_cache(valid[r : r + 1, valid.shape[1] - prompt :]), layer)[0]
            assert held[r] == alone, (layer, r)
            for h in range(2):
                assert set(range(prompt)) <= set(held[r][h])
                assert 24 <= len(held[r][h]) <= 24 + 4  # the budget, and what came since the last eviction
            assert held[r][0] != held[r][1]  # heads keep different decoded tokens
    assert _held(_run_cache(valid), 1) == _held(batch, 1)  # a seeded run reproduces
    assert _held(_run_cache(valid, seed=5), 1) != _held(batch, 1)


# -- a prompt the budget cannot hold: refused, naming it ----------------------------------------------
def test_a_prompt_longer_than_the_budget_is_refused_at_the_eviction():
    keys, queries, _ = _decoding()
    policy = load_policy(NAME, budget=20, interval=1)
    with pytest.raises(SelectionError, match=r"prompt of 21 tokens.*more than the budget of 20"):
        policy.select(keys, keys, queries, prompt_lengths=21)
    assert policy.select(keys, keys, queries, prompt_lengths=20)[0, 0].tolist() == list(range(20))
    # with a recent buffer, the prompt must fit beside it
    buffered = load_policy(NAME, budget=20, recent=8, interval=1)
    with pytest.raises(SelectionError, match=r"prompt of 13 tokens.*8 slots protected before it"):
        buffered.select(keys, keys, queries, prompt_lengths=13)
    # in a cache: at the first eviction, before anything is dropped
    cache = EvictingCache(load_policy(NAME, budget=8, interval=4), num_layers=1)
    k = torch.randn(1, 1, 9, 4)
    cache.step(0, k, k)
    with pytest.raises(SelectionError, match="prompt of 9 tokens"):
        for _ in range(4):
            cache.step(0, k[:, :, :1], k[:, :, :1])


def test_prompt_lengths_are_required_and_checked():
    keys, queries, _ = _decoding()
    policy = load_policy(NAME, budget=20, interval=1)
    with pytest.raises(ValueError, match="reservation 'prompt'.*pass prompt_lengths="):
        policy.select(keys, keys, queries)
    with pytest.raises(ValueError, match="prompt_lengths must be >= 0"):
        policy.select(keys, keys, queries, prompt_lengths=-1)
    with pytest.raises(ValueError, match=r"prompt_lengths must be an int or a \[B=1\] tensor"):
        policy.select(keys, keys, queries, prompt_lengths=torch.tensor([3, 4]))
    assert policy.needs_prompt and not load_policy("random").needs_prompt
    load_policy("random").select(keys, keys, queries)  # policies that do not read it need not pass it


def test_prompt_refusal_before_admission():
    """What vLLM's front end asks: a prompt the budget cannot hold is refused up front, unless
    the request never grows past the budget (it never evicts)."""
    policy = load_policy(NAME, budget=256)
    assert policy.prompt_refusal(256) is None
    assert "prompt of 257 tokens does not fit the 256 slots" in (policy.prompt_refusal(257) or "")
    assert policy.prompt_refusal(200, new_tokens=56) is None
    assert policy.prompt_refusal(257, new_tokens=0) is not None  # 257 > 256: it holds more than the budget
    buffered = load_policy(NAME, budget=256, recent=64)
    assert "does not fit the 192 slots" in (buffered.prompt_refusal(193) or "")
    assert load_policy("random", budget=128).prompt_refusal(10_000) is None


def test_vllm_refuses_such_a_request_before_it_runs():
    """vLLM's front end and the engine core's admission ask ``PolicyPlan.request_refusal`` with
    the request's prompt and ``max_tokens`` (hence ``Policy.prompt_refusal``): the request fails
    alone instead of at an eviction."""
    from types import SimpleNamespace

    from kvpolicy.vllm.plans import PolicyPlan
    from kvpolicy.vllm.settings import Resolved

    policy = load_policy(NAME, budget=64)
    config = SimpleNamespace(model_config=SimpleNamespace(get_num_kv_heads=lambda parallel: 2),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1),
                             cache_config=SimpleNamespace(block_size=16))
    plan = PolicyPlan.build(Resolved(policy.to_yaml(), NAME, 0), config, None)

    def refusal(prompt: int, max_tokens: int | None, pool: int | None = None) -> str | None:
        """``pool``: usable blocks (vLLM's count less its null block)."""
        return plan.request_refusal(prompt, max_tokens, None if pool is None else pool + 1, 16, False)

    assert "prompt of 65 tokens does not fit the 64 slots" in (refusal(65, 100) or "")
    assert refusal(64, 100) is None
    assert refusal(40, 24) is None  # never past the budget: never evicts
    assert refusal(65, None) is not None
    interval = policy.schedule.interval  # its peak: the budget and an interval's tokens, in blocks of 16
    assert refusal(64, 100, pool=(64 + interval) // 16) is None
    assert f"more than the {(64 + interval) // 16 - 1} the KV pool" in (refusal(64, 100, pool=(64 + interval) // 16 - 1) or "")
