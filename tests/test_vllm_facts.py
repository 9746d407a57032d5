"""The model's facts on a vLLM worker (``kvpolicy.vllm.facts``), built from modules shaped like
vLLM 0.32's (``tests/fake_vllm.py``), against the transformers builder on the same weights; and
what ``PagedCache`` refuses with them (no vLLM needed)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from fake_vllm import RotaryEmbedding, from_hf, layer_names, vllm_model

import kvpolicy
from kvpolicy.engine_facts import table_rope
from kvpolicy.stages.model_facts import ModelFacts, ModelFactsError
from kvpolicy.vllm.facts import KEPT_WEIGHT, keep_weight, model_facts
from kvpolicy.vllm.paged_cache import PagedCache
from kvpolicy.vllm.settings import KVPolicyVLLMError, Resolved

POSITIONS = torch.tensor([[0, 1, 2, 17], [255, 1000, 4095, 3]])


def hf_pair(tp_size: int = 1):
    pytest.importorskip("transformers")
    from hf_util import tiny_qwen3

    from kvpolicy.hf.facts import model_facts as hf_facts

    hf = tiny_qwen3(layers=3, vocab=64)
    ranks = []
    for rank in range(tp_size):
        model, config = from_hf(hf, tp_size=tp_size, rank=rank)
        ranks.append(model_facts(model, config, layer_names(3), name="tiny-qwen3", head_offset=rank * (2 // tp_size)))
    return hf_facts(hf), ranks


def test_a_vllm_models_facts_are_the_transformers_facts_on_the_same_weights():
    want, (got,) = hf_pair()
    for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.available == want.available == {"rope", "output_projection"}
    assert (got.kv_head_offset, got.kv_heads_held) == (0, 2)
    cos, sin = got.rope(POSITIONS)
    want_cos, want_sin = want.rope(POSITIONS)
    assert cos.shape == (2, 4, 16) and cos.dtype == torch.float32
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-6)
    for layer in range(3):
        assert torch.equal(got.output_projection(layer), want.output_projection(layer))
        assert torch.equal(got.output_projection_heads(layer, 1, 1), want.output_projection(layer)[2:4])


def test_rope_past_the_table_and_backwards():
    """Past vLLM's table (TriAttention asks up to 65,536 ahead) and at negative positions, the
    RoPE is the plain rotation: float64 angles within the table's float32-angle precision."""
    _, (got,) = hf_pair()
    from hf_util import tiny_qwen3

    model, _ = from_hf(tiny_qwen3(layers=1, vocab=64))
    truth = ModelFacts.standard_rope(16, model.model.layers[0].self_attn.rotary_emb.base)
    far = torch.tensor([4096, 4097, 9000, 65536 + 4100, 70000, -1, -5, -4095, -70000])
    cos, sin = got.rope(far)
    want_cos, want_sin = truth(far)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-3)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-3)
    near = torch.arange(0, 4096, 7)
    torch.testing.assert_close(got.rope(-near)[1], -got.rope(near)[1], rtol=0, atol=0)
    torch.testing.assert_close(got.rope(-near)[0], got.rope(near)[0], rtol=0, atol=0)


def test_table_rope_hand_computed():
    """A 3-row table of one frequency (0.5 rad per position), scaled by 2: position 7 is row
    7 mod 2 = 1 turned 3 times by row 2's angle, 3.5 rad in all."""
    angles = torch.arange(3, dtype=torch.float64)[:, None] * 0.5
    rope = table_rope((2 * angles.cos()).float(), (2 * angles.sin()).float())
    cos, sin = rope(torch.tensor([7, -7, 2]))
    assert cos.shape == (3, 2)
    for row, p in enumerate((7, -7, 2)):
        assert cos[row].tolist() == pytest.approx([2 * math.cos(0.5 * p)] * 2, abs=1e-6)
        assert sin[row].tolist() == pytest.approx([2 * math.sin(0.5 * p)] * 2, abs=1e-6)


def test_a_tensor_parallel_rank_holds_its_heads_output_projection():
    want, ranks = hf_pair(tp_size=2)
    for rank, got in enumerate(ranks):
        assert (got.kv_head_offset, got.kv_heads_held, got.num_kv_heads) == (rank, 1, 2)
        assert list(got.held_kv_heads) == [rank]
        for layer in range(3):
            assert got.output_projection(layer).shape == (2, 16, 64)
            assert torch.equal(got.output_projection_heads(layer, rank, 1), want.output_projection(layer)[2 * rank : 2 * rank + 2])
        with pytest.raises(ModelFactsError, match="hold the output projection of KV heads"):
            got.output_projection_heads(0, 1 - rank, 1)
        criticalkv = kvpolicy.load_policy("criticalkv")
        criticalkv.check_model_facts(got, num_kv_heads=1, head_dim=16, head_offset=rank, q_heads=2)
        with pytest.raises(kvpolicy.PolicyError, match="hold the output projection of KV heads"):
            criticalkv.check_model_facts(got, num_kv_heads=1, head_dim=16, head_offset=1 - rank, q_heads=2)
        with pytest.raises(kvpolicy.PolicyError, match="with 4 query heads"):
            criticalkv.check_model_facts(got, num_kv_heads=1, head_dim=16, head_offset=rank, q_heads=4)


def test_the_value_norm_of_a_rank_is_the_unsharded_value_norm_of_its_head():
    """``output_value_norm`` on rank 1's facts and head equals the unsharded run's head 1."""
    want, ranks = hf_pair(tp_size=2)
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g)
    queries = torch.randn(1, 4, 4, 16, generator=g)
    policy = kvpolicy.load_policy("criticalkv", budget=8, recent=2, window=4)
    full = policy.select(keys, values, queries, layer_idx=1, model=want)
    for rank, facts in enumerate(ranks):
        part = policy.select(keys[:, rank : rank + 1], values[:, rank : rank + 1], queries[:, 2 * rank : 2 * rank + 2],
                             layer_idx=1, model=facts, head_offset=rank)
        assert torch.equal(part[0, 0], full[0, rank])


def test_what_a_vllm_model_cannot_give_is_missing_with_the_reason():
    weights = torch.randn(2, 24, 64)

    def facts(**changes):
        model, config = vllm_model(weights, kv_heads=2, head_dim=16)
        for m in model.modules():
            for attr, value in changes.items():
                if hasattr(m, "rotary_emb") and attr == "rotary_emb":
                    m.rotary_emb = value
                elif hasattr(m, "rotary_emb") and attr == "rotary_of":
                    m.rotary_emb = value()
                elif hasattr(m, "o_proj") and attr == "weight":
                    m.o_proj.weight = torch.nn.Parameter(value, requires_grad=False)
        return model_facts(model, config, layer_names(2), name="m")

    gptj = RotaryEmbedding(16, 16, 64, 10000.0, is_neox_style=False)
    assert "rope" not in facts(rotary_emb=gptj).available
    assert "is_neox_style False" in facts(rotary_emb=gptj).why_missing("rope")
    partial = facts(rotary_emb=RotaryEmbedding(16, 8, 64, 10000.0))
    assert "partial or interleaved RoPE" in partial.why_missing("rope")
    per_layer = iter([RotaryEmbedding(16, 16, 64, 10000.0), RotaryEmbedding(16, 16, 64, 500.0)])
    assert "rotate differently" in facts(rotary_of=lambda: next(per_layer)).why_missing("rope")

    class PackedRotaryEmbedding(RotaryEmbedding):
        pass

    assert "PackedRotaryEmbedding" in facts(rotary_emb=PackedRotaryEmbedding(16, 16, 64, 1e4)).why_missing("rope")
    removed = facts(weight=torch.empty(0))  # what vLLM's CPU GEMM dispatch leaves
    assert removed.available == {"rope"}
    assert "(a packed or removed weight?)" in removed.why_missing("output_projection")
    quantised = facts(weight=torch.zeros(24, 64, dtype=torch.int8))
    assert "not a float matrix" in quantised.why_missing("output_projection")
    model, config = vllm_model(weights, kv_heads=2, head_dim=16)
    lacking = model_facts(model, config, {**layer_names(2), 2: "model.layers.2.self_attn.attn"}, name="m")
    assert lacking.available == frozenset() and "layer(s) [2]" in lacking.why_missing("rope")


def test_the_weight_kept_before_vllm_drops_it_is_the_one_read():
    weights = torch.randn(2, 24, 64)
    model, config = vllm_model(weights, kv_heads=2, head_dim=16)
    for m in model.modules():
        if hasattr(m, "o_proj"):
            keep_weight(m.o_proj)
            m.o_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # packed, dropped
            assert KEPT_WEIGHT in m.o_proj.__dict__
    facts = model_facts(model, config, layer_names(2), name="m")
    assert torch.equal(facts.output_projection(1), weights[1].t().unflatten(0, (4, 16)))


def test_facts_of_a_pipeline_stage_hold_its_layers_only():
    weights = torch.randn(4, 24, 64)
    model, config = vllm_model(weights, kv_heads=2, head_dim=16)
    stage = {i: n for i, n in layer_names(4).items() if i >= 2}
    facts = model_facts(model, config, stage, name="m")
    assert facts.num_layers == 4
    assert torch.equal(facts.output_projection(3), weights[3].t().unflatten(0, (4, 16)))
    with pytest.raises(ModelFactsError, match="not held here"):
        facts.output_projection(0)


def test_the_facts_module_imports_without_vllm():
    code = "import sys, kvpolicy.vllm.facts, kvpolicy.engine_facts; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def paged(facts, q_heads=4, kv_heads=2, head_offset=0):
    kv = [(torch.zeros(4, 4, kv_heads, 16), torch.zeros(4, 4, kv_heads, 16))]
    return PagedCache(kv, [0], q_heads=q_heads, head_dim=16, block_size=4, policy_of=lambda r: None,
                      head_offset=head_offset, model_facts=facts)


def test_the_paged_cache_refuses_a_policy_its_facts_cannot_serve():
    weights = torch.randn(2, 24, 64)
    model, config = vllm_model(weights, kv_heads=2, head_dim=16, name="fake-llama")
    facts = model_facts(model, config, layer_names(2), name="fake-llama")
    cache = paged(facts)
    cache.check_policy(kvpolicy.load_policy("criticalkv"))
    cache.check_policy(kvpolicy.load_policy("expected-attention"))
    cache.check_policy(kvpolicy.load_policy("snapkv"))
    cache.check_policy(None)
    # TriAttention's bundled calibration is SmolLM2-135M's: refused with KVPolicyCache's words.
    with pytest.raises(KVPolicyVLLMError, match="calibration .*num_layers = 30, but the model 'fake-llama' has 2"):
        cache.check_policy(kvpolicy.load_policy("triattention"))
    with pytest.raises(KVPolicyVLLMError, match="no model facts were given"):
        paged(None).check_policy(kvpolicy.load_policy("criticalkv"))
    removed = facts.__class__(**{**facts.__dict__, "output_projection_fn": None,
                                 "missing": {"output_projection": "a packed weight"}})
    with pytest.raises(KVPolicyVLLMError, match="output_projection, which the model facts of 'fake-llama' lack: a packed"):
        paged(removed).check_policy(kvpolicy.load_policy("criticalkv"))
    assert paged(removed).check_policy(kvpolicy.load_policy("expected-attention")) is None
    rank1 = model_facts(*vllm_model(weights, kv_heads=2, head_dim=16, tp_size=2, rank=1), layer_names(2),
                        name="fake-llama", head_offset=1)
    paged(rank1, q_heads=2, kv_heads=1, head_offset=1).check_policy(kvpolicy.load_policy("criticalkv"))
    with pytest.raises(KVPolicyVLLMError, match="hold the output projection of KV heads 1 .. 1"):
        paged(rank1, q_heads=2, kv_heads=1, head_offset=0).check_policy(kvpolicy.load_policy("criticalkv"))


def test_a_request_policy_is_checked_when_first_loaded():
    weights = torch.randn(2, 24, 64)
    facts = model_facts(*vllm_model(weights, kv_heads=2, head_dim=16), layer_names(2), name="fake-llama")
    policy = kvpolicy.load_policy("triattention", budget=8, recent=2)
    cache = paged(facts)
    cache.resolve = lambda r: Resolved(policy.to_yaml(), "triattention", 0)
    with pytest.raises(KVPolicyVLLMError, match="calibration"):
        cache.request_policy("a")
