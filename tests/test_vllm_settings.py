"""kvpolicy.vllm's settings (policy resolution, environment, version range): no vLLM needed."""

from __future__ import annotations

import json

import pytest

from kvpolicy.vllm import additional_config
from kvpolicy.vllm.settings import KVPolicyVLLMError, Resolved, check_version, requested, resolve


def test_resolve_carries_validated_yaml_and_seed():
    r = resolve({"policy": "snapkv", "budget": 128})
    policy = r.policy()
    assert policy.budget == 128 and policy.schedule.window == 64 and r.seed == 0
    again = Resolved.from_additional_config({"kvpolicy": r.to_dict()})
    assert again == r
    assert additional_config("snapkv", budget=128) == {"kvpolicy": {"policy": "snapkv", "budget": 128}}


def test_a_null_seed_is_drawn_once_at_resolution():
    r = resolve({"policy": "snapkv", "seed": None})
    assert isinstance(r.seed, int)
    assert r.policy().resolve_seed() == r.seed  # every process loads the same drawn seed


def test_streamingllm_relative_recent_follows_budget():
    assert resolve({"policy": "streamingllm", "budget": 128}).policy().schedule.recent == 124


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(KVPolicyVLLMError, match="unknown policy 'no-such-policy'.*registered policies"):
        resolve({"policy": "no-such-policy"})


def test_invalid_policy_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nschedule: {budget: 64, recent: 8}\nselector: {type: greedy}\nscorer: {type: nope}\n")
    with pytest.raises(KVPolicyVLLMError, match="does not load"):
        resolve({"policy": str(bad)})


def test_unknown_setting_and_select_mode_are_refused():
    with pytest.raises(KVPolicyVLLMError, match="unknown setting"):
        resolve({"policy": "snapkv", "budgte": 3})
    with pytest.raises(KVPolicyVLLMError, match="evict mode only"):
        resolve({"policy": "snapkv@select"})
    for bad in (["budget", 64], "budget=64"):
        with pytest.raises(KVPolicyVLLMError, match='"overrides" must be a mapping'):
            resolve({"policy": "snapkv", "overrides": bad})
    with pytest.raises(KVPolicyVLLMError, match="no policy given"):
        resolve({"budget": 64})


def test_environment_variables(monkeypatch):
    monkeypatch.delenv("KVPOLICY_VLLM_TRACE", raising=False)
    monkeypatch.delenv("KVPOLICY_VLLM_POLICY", raising=False)
    assert requested({}) is None  # not switched on
    monkeypatch.setenv("KVPOLICY_VLLM_POLICY", "streamingllm")
    monkeypatch.setenv("KVPOLICY_VLLM_OVERRIDES", json.dumps({"budget": 256}))
    entry = requested({})
    assert entry == {"policy": "streamingllm", "overrides": {"budget": 256}}
    assert resolve(entry).policy().budget == 256
    assert requested({"kvpolicy": {"policy": "snapkv"}}) == {"policy": "snapkv"}  # additional_config wins
    assert requested({"kvpolicy": "snapkv"}) == {"policy": "snapkv"}
    monkeypatch.setenv("KVPOLICY_VLLM_OVERRIDES", "{budget")
    with pytest.raises(KVPolicyVLLMError, match="not valid JSON"):
        requested({})
    monkeypatch.setenv("KVPOLICY_VLLM_OVERRIDES", "[1]")
    with pytest.raises(KVPolicyVLLMError, match="must be a JSON object"):
        requested({})


def test_non_mapping_additional_config_entry_is_refused():
    with pytest.raises(KVPolicyVLLMError, match="must be a mapping"):
        requested({"kvpolicy": 3})


def test_version_range():
    check_version("0.32.0")
    check_version("0.32.1+cpu")
    for bad in ("0.31.2", "0.33.0", "1.0.0", "garbage"):
        with pytest.raises(KVPolicyVLLMError, match="not supported"):
            check_version(bad)
