"""kvpolicy.vllm's settings (policy resolution, environment, version range): no vLLM needed."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import load_policy
from kvpolicy.vllm import additional_config
from kvpolicy.vllm.refusals import check_version, refuse_unservable, shard_refusal
from kvpolicy.vllm.settings import (
    KVPolicyVLLMError,
    Resolved,
    request_policy,
    requested,
    resolve,
    resolve_request,
)


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
    with pytest.raises(KVPolicyVLLMError, match="select mode with stages that keep state"):
        resolve({"policy": "h2o@select"})
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


# -- a policy per request ---------------------------------------------------------------------
SERVER = resolve({"policy": "snapkv", "budget": 128})


def test_requests_naming_nothing_run_the_servers_policy():
    for extra in (None, {}, {"other_extension": 1}):
        assert resolve_request(extra) is None
        assert request_policy(extra, SERVER) == SERVER


@pytest.mark.parametrize(
    "extra",
    [
        {"kvpolicy": {"policy": "streamingllm", "budget": 64}},  # SamplingParams.extra_args
        {"kvpolicy": "streamingllm", "kvpolicy_budget": 64},  # vllm_xargs: flat keys
        {"kvpolicy": json.dumps({"policy": "streamingllm", "budget": 64})},  # vllm_xargs: JSON text
        {"kvpolicy": {"policy": "streamingllm", "overrides": {"budget": 64}}},
    ],
)
def test_a_request_names_its_own_policy(extra):
    out = resolve_request({**extra, "session": "x"})
    assert out is not None and out["session"] == "x"  # other extensions' keys stay
    assert not any(k.startswith("kvpolicy_") for k in out)
    mine = request_policy(out, SERVER)
    assert mine != SERVER and mine.source == "streamingllm"
    policy = mine.policy()
    assert policy is not None and policy.budget == 64 and policy.schedule.recent == 60
    assert mine == resolve({"policy": "streamingllm", "budget": 64})  # what a server of that policy runs


def test_yaml_text_and_none_per_request():
    text = load_policy("snapkv", budget=96).to_yaml()
    assert request_policy(resolve_request({"kvpolicy": text}), SERVER).policy().budget == 96
    full = request_policy(resolve_request({"kvpolicy": "none"}), SERVER)
    assert full.policy_yaml is None and full.policy() is None


def test_the_none_server_policy():
    r = resolve({"policy": "none"})
    assert r.policy() is None and Resolved.from_additional_config({"kvpolicy": r.to_dict()}) == r
    with pytest.raises(KVPolicyVLLMError, match="takes no overrides"):
        resolve({"policy": "none", "budget": 64})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvpolicy": "no-such-policy"}, "unknown policy 'no-such-policy'"),
        ({"kvpolicy": "snapkv", "kvpolicy_budget": -3}, "does not load"),
        ({"kvpolicy": "snapkv", "kvpolicy_budget": [1, 2]}, "does not load|invalid override"),
        ({"kvpolicy": "h2o@select"}, "keep state"),
        ({"kvpolicy": {"policy": "snapkv", "trace": "/tmp/x"}}, r"unknown setting\(s\) \['trace'\]"),
        ({"kvpolicy": {"resolved": {"policy_yaml": "x", "source": "x", "seed": 0}}}, r"unknown setting\(s\) \['resolved'\]"),
        ({"kvpolicy_budget": 64}, "without 'kvpolicy'"),
        ({"kvpolicy": {"policy": "snapkv", "budget": 64}, "kvpolicy_budget": 32}, "given twice"),
        ({"kvpolicy": 7}, "must be a policy name"),
    ],
)
def test_bad_per_request_settings_are_clear_errors(extra, message):
    with pytest.raises(KVPolicyVLLMError, match="this request's kvpolicy settings") as info:
        resolve_request(extra)
    assert __import__("re").search(message, str(info.value)), str(info.value)


def test_a_request_cannot_make_the_server_read_a_file(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(load_policy("snapkv", budget=64, recent=16).to_yaml())
    assert resolve({"policy": str(f)}).policy().budget == 64  # the server's own settings may
    with pytest.raises(KVPolicyVLLMError, match="not a file of the server"):
        resolve_request({"kvpolicy": str(f)})


def test_refuse_unservable_is_the_one_place_for_unservable_policies():
    refuse_unservable(load_policy("snapkv"))
    refuse_unservable(load_policy("snapkv@select"))  # select mode: kvpolicy.vllm.select
    with pytest.raises(KVPolicyVLLMError, match="keep state"):
        refuse_unservable(load_policy("h2o@select"))
    for name in ("h2o", "gkv"):  # stages that keep state: the worker carries it (tests/engine_vllm/test_stateful.py)
        refuse_unservable(load_policy(name))


def test_unresolved_request_settings_in_an_engine_process_are_an_error():
    with pytest.raises(KVPolicyVLLMError, match="front end did not resolve"):
        request_policy({"kvpolicy": "snapkv"}, SERVER)


def test_policies_whose_heads_choose_together_are_refused_under_tensor_parallelism():
    tova = load_policy("tova")
    assert shard_refusal(tova, 1) is None
    assert "tensor_parallel_size 2" in shard_refusal(tova, 2)
    for name in ("snapkv", "knorm", "streamingllm"):
        assert shard_refusal(load_policy(name), 4) is None
    assert shard_refusal(None, 4) is None  # the policy "none"
    # A request's own policy, as the front end resolves it and the check reads it back.
    args = resolve_request({"kvpolicy": "tova"})
    own = request_policy(args, Resolved(None, "none", 0)).policy()
    assert shard_refusal(own, 2) is not None


@pytest.mark.parametrize("name", ["ada-snapkv", "ada-vase-attnv"])
def test_per_head_budgets_are_refused_under_tensor_parallelism_by_name(name):
    """Ada-KV pools a layer's slots across all its KV heads; a rank holds only its own: refused
    with the reason, for a server's policy and a request's own."""
    why = shard_refusal(load_policy(name), 2)
    assert f"policy {name!r}" in why and "allocation 'adaptive'" in why and "tensor_parallel_size 1" in why
    own = request_policy(resolve_request({"kvpolicy": name}), Resolved(None, "none", 0)).policy()
    assert shard_refusal(own, 2) == why
    assert shard_refusal(load_policy(name), 1) is None


def test_a_request_cannot_make_the_server_read_a_data_file(tmp_path):
    """A stage field naming a file (TriAttention's calibration, a head profile) takes only
    kvpolicy's built-in files per request, refused before anything reads the path; the server's
    own policy may name any file."""
    import json

    calibration = tmp_path / "cal.safetensors"  # never created: the refusal must come before any read
    spec = yaml.safe_load((files("kvpolicy") / "policies" / "triattention.yaml").read_text())
    spec["scorer"]["calibration"] = str(calibration)
    with pytest.raises(KVPolicyVLLMError, match=r"scorer: calibration: .* is a file of this machine") as info:
        resolve_request({"kvpolicy": json.dumps({"policy": spec, "budget": 256})})
    assert "no such calibration file" not in str(info.value)
    server_file = tmp_path / "tri.yaml"
    server_file.write_text(yaml.safe_dump(spec))
    with pytest.raises(KVPolicyVLLMError, match="no such calibration file"):  # the server's own policy reads it
        resolve({"policy": str(server_file)})
    spec["scorer"]["calibration"] = "builtin:smollm2-135m.safetensors"
    assert resolve_request({"kvpolicy": json.dumps({"policy": spec, "budget": 256})}) is not None
    duo = yaml.safe_load((files("kvpolicy") / "policies" / "duo-attention.yaml").read_text())
    duo["allocation"]["path"] = str(tmp_path / "heads.yaml")
    with pytest.raises(KVPolicyVLLMError, match=r"allocation: .*path: .* is a file of this machine"):
        resolve_request({"kvpolicy": {"policy": duo}})


def test_per_layer_policies_are_served_on_a_group_per_layer_and_refused_elsewhere_by_name():
    """KV-cache groups are built at start-up from the server's policy: a per-layer policy
    (pyramidkv) needs a group per layer, which a uniform server does not have; a per-layer server
    serves uniform evict-mode policies and the full cache, and refuses select mode and per-head
    counts by name."""
    from types import SimpleNamespace

    from kvpolicy.vllm.budgets import decides_from_prompt, group_head_caps, group_schedules, per_layer
    from kvpolicy.vllm.refusals import layer_group_refusal, per_layer_refusals, shard_refusal

    pyramid = load_policy("pyramidkv", budget=96, recent=16, interval=32, window=32)
    assert per_layer(pyramid) and not per_layer(load_policy("snapkv")) and not per_layer(None)
    assert not per_layer(load_policy("ada-snapkv"))
    cake = load_policy("cake")  # its budgets decided from each prompt: a group per layer too
    assert per_layer(cake) and decides_from_prompt(cake) and not decides_from_prompt(pyramid)
    why = shard_refusal(cake, 2)
    assert why is not None and "policy 'cake'" in why and "tensor_parallel_size 1" in why
    assert shard_refusal(cake, 1) is None and shard_refusal(pyramid, 2) is None
    why = layer_group_refusal(pyramid, server_per_layer=False)
    assert why is not None and "policy 'pyramidkv'" in why and "KV-cache group per layer" in why
    assert layer_group_refusal(pyramid, server_per_layer=True) is None
    assert layer_group_refusal(load_policy("snapkv"), server_per_layer=True) is None
    assert layer_group_refusal(None, server_per_layer=True) is None  # the full cache
    why = layer_group_refusal(load_policy("quest"), server_per_layer=True)
    assert why is not None and "policy 'quest'" in why and "KV-cache group per layer" in why
    assert layer_group_refusal(load_policy("quest"), server_per_layer=False) is None
    # Per-head counts on per-layer groups: Ada-KV's (even layers) on either server, DuoAttention's
    # (its layers keep budgets of their own) on a per-layer one only.
    duo = load_policy("duo-attention", budget=96, recent=16, interval=16, window=16)
    assert per_layer(duo) and not per_layer(load_policy("ada-snapkv"))
    assert layer_group_refusal(load_policy("ada-snapkv"), server_per_layer=True) is None
    assert layer_group_refusal(duo, server_per_layer=True) is None
    why = layer_group_refusal(duo, server_per_layer=False)
    assert why is not None and "policy 'duo-attention'" in why and "KV-cache group per layer" in why
    # Each group's schedule is its layer's (EvictingCache's), or the policy's for every layer.
    per = group_schedules(pyramid, [0, 1, 2, 3], 3)
    assert [s.budget for s in per] == [s.budget for s in pyramid.layer_schedules(4, 3)]
    assert len({s.budget for s in per}) == 4 and sum(s.budget for s in per) == 4 * 96
    assert group_schedules(pyramid, None, 3) == [pyramid.schedule]
    assert {s.budget for s in group_schedules(load_policy("snapkv", budget=80), [0, 1, 2], 3)} == {80}
    assert group_schedules(None, [0, 1], 3) == [None, None]
    # Each group's per-head bound beside its schedule: a DuoAttention layer's largest head share
    # (a layer of streaming heads: its sinks and recent buffer), Ada-KV's the same in every group.
    caps = group_head_caps(duo, list(range(30)), 3)
    shares = [duo.config.allocation.head_budgets(layer, s.budget, 16)
              for layer, s in enumerate(duo.layer_schedules(30, 3))]
    assert caps == [max(row) for row in shares] and min(caps) == 16 + 4 and len(set(caps)) > 1
    assert group_head_caps(duo, [3, *range(3), *range(4, 30)], 3)[:2] == [caps[3], caps[0]]  # group g: layer of g
    ada = load_policy("ada-snapkv", budget=100)
    assert group_head_caps(ada, [0, 1], 8) == [8 * 100 - 7 * 20] * 2 == group_head_caps(ada, None, 8) * 2
    assert group_head_caps(pyramid, [0, 1, 2, 3], 3) == [None] * 4 and group_head_caps(None, None, 3) == [None]
    config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True),
                             parallel_config=SimpleNamespace(pipeline_parallel_size=2))
    reasons = per_layer_refusals(pyramid, config)
    assert len(reasons) == 2 and "prefix caching" in reasons[0] and "pipeline parallelism" in reasons[1]
    assert per_layer_refusals(load_policy("snapkv"), config) == []


def _server(tp: int = 1, layers: int = 30, kv_heads: int = 3, block_size: int = 32, prefix_caching: bool = False):
    """A stand-in for vLLM's config, with what ``PolicyPlan`` reads."""
    from types import SimpleNamespace

    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size, enable_prefix_caching=prefix_caching),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(get_num_kv_heads=lambda parallel: kv_heads,
                                     get_num_layers=lambda parallel: layers))


def test_a_plan_lists_every_reason_and_a_server_plan_has_the_groups_its_policy_asks_for():
    from kvpolicy.vllm.plans import PolicyPlan

    cake = resolve({"policy": "cake"})
    # On one group for every layer and two ranks, CAKE is refused twice: its budgets are decided
    # over every head of a layer, and it needs a KV-cache group per layer.
    plan = PolicyPlan.build(cake, _server(tp=2), None)
    assert len(plan.refusals) == 2 and plan.refusal == plan.refusals[0]
    assert "tensor_parallel_size 2" in plan.refusals[0] and "KV-cache group per layer" in plan.refusals[1]
    assert plan.group_schedules == []
    # As the server's own policy it gets its group per layer: only the ranks are left.
    server = PolicyPlan.of_server(cake, _server(tp=2))
    assert server.refusals == plan.refusals[:1] and len(server.group_schedules) == 30
    assert PolicyPlan.of_server(cake, _server()).refusal is None
    with pytest.raises(KVPolicyVLLMError, match="tensor_parallel_size 2"):  # no pool is sized for a refused plan
        server.pool_tokens(4096, 32, False)


def test_a_server_plan_sizes_the_pool_for_its_fullest_layer():
    from kvpolicy.vllm.plans import PolicyPlan

    def blocks(n: int, size: int) -> int:
        return -(-n // size)

    pyramid = resolve({"policy": "pyramidkv", "budget": 96, "recent": 16, "interval": 16, "window": 16})
    policy = pyramid.policy()
    mean = policy.schedule
    # Each layer's peak after a prompt within the budget: an interval past the larger of its budget
    # and that prompt (counting tokens, ``Schedule.capacity_for``), in blocks of 32.
    assert mean.count == "tokens"
    peaks = [max(s.budget, mean.budget) + s.interval for s in policy.layer_schedules(30, 3)]
    assert len(set(peaks)) > 1
    plan = PolicyPlan.of_server(pyramid, _server())
    assert plan.pool_tokens(4096, 32, False) == max(blocks(p, 32) for p in peaks) * 32
    snapkv = PolicyPlan.of_server(resolve({"policy": "snapkv", "budget": 128, "interval": 16}), _server())
    assert snapkv.pool_tokens(4096, 32, False) == blocks(144, 32) * 32
    # Under prefix caching a first eviction writes into fresh blocks beside the old ones.
    assert snapkv.pool_tokens(4096, 32, True) == (blocks(144, 32) + blocks(128, 32)) * 32
    assert PolicyPlan.of_server(resolve({"policy": "none"}), _server()).pool_tokens(4096, 32, False) is None


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["snapkv", "h2o", "tova", "vase-attnv", "ada-snapkv", "pyramidkv", "duo-attention"]),
       budget=st.sampled_from([96, 128, 160]), block_size=st.sampled_from([16, 32]), prefix_caching=st.booleans(),
       max_model_len=st.integers(200, 3000), data=st.data())
def test_a_pool_sized_for_the_server_policy_admits_every_request_its_length_allows(
        name, budget, block_size, prefix_caching, max_model_len, data):
    """The pool vLLM is asked for (``PolicyPlan.pool_tokens``: every KV-cache group holds that
    many slots, as vLLM checks at start-up) admits every request ``request_refusal`` is asked of
    whose prompt is within the budget and whose tokens fit ``max_model_len``: the two agree.
    (Under prefix caching the engine core asked vLLM for ``max_model_len`` slots when the policy
    needed more, and a server that started refused such requests: max_model_len 200, snapkv at
    budget 96, blocks of 16, a request of 113 tokens needing 14 blocks of a pool of 13.)"""
    from kvpolicy.vllm.plans import PolicyPlan

    resolved = resolve({"policy": name, "budget": budget})
    config = _server(block_size=block_size, prefix_caching=prefix_caching)
    plan = PolicyPlan.of_server(resolved, config)
    tokens = plan.pool_tokens(max_model_len, block_size, prefix_caching)
    assert tokens is not None and tokens % block_size == 0
    groups = len(plan.group_schedules)
    blocks = tokens // block_size * groups + 1  # vLLM's count: each group's, and its null block
    prompt = data.draw(st.integers(1, budget), label="prompt")
    new = data.draw(st.integers(1, max_model_len - prompt), label="max_tokens")
    assert plan.request_refusal(prompt, new, blocks, block_size, prefix_caching) is None


def test_a_per_layer_split_the_model_cannot_take_is_refused_by_name():
    from kvpolicy.vllm.budgets import layer_schedules
    from kvpolicy.vllm.settings import KVPolicyVLLMError

    tight = load_policy("pyramidkv", budget=24, recent=16, interval=16, window=16)  # the last layers get <= recent
    with pytest.raises(KVPolicyVLLMError, match="policy 'pyramidkv' cannot share its budget among the model's 30 layers"):
        layer_schedules(tight, 30, 3)
    roomy = load_policy("pyramidkv", budget=32, recent=16, interval=16, window=16)
    assert min(s.budget for s in layer_schedules(roomy, 30, 3)) > 16


def test_a_resolved_policy_is_loaded_once_per_process_and_distinct_policy():
    """Every KV-cache group of a per-layer server asks for its request's policy: one load serves them."""
    from kvpolicy.vllm import settings

    r = resolve({"policy": "pyramidkv", "budget": 96})
    before = settings.loaded.cache_info()
    first = r.policy()
    same = [Resolved.from_additional_config({"kvpolicy": r.to_dict()}).policy() for _ in range(30)]
    assert all(p is first for p in same)
    after = settings.loaded.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 30
    other = resolve({"policy": "pyramidkv", "budget": 128}).policy()  # another YAML: its own load
    assert other is not first and other.budget == 128 and first.budget == 96
    assert Resolved(r.policy_yaml, r.source, r.seed + 1).policy().resolve_seed() == r.seed + 1


def test_what_is_derived_per_policy_is_kept_for_the_policies_used_last():
    """Clients may send any number of distinct policies: a long-running server keeps what it derived
    for the ``size`` used last (``PerPolicy``), making each once while it is kept."""
    from kvpolicy.vllm.settings import PerPolicy

    made: list[str] = []

    def make(key: str):
        return lambda: made.append(key) or f"plan of {key}"

    kept: PerPolicy[str, str] = PerPolicy(size=2)
    assert kept.get_or_make("a", make("a")) == "plan of a"
    assert kept.get_or_make("a", make("a")) == "plan of a" and made == ["a"]
    kept.get_or_make("b", make("b"))
    kept.get_or_make("a", make("a"))  # used last: "b" is now the oldest
    kept.get_or_make("c", make("c"))
    assert list(kept) == ["a", "c"] and made == ["a", "b", "c"]
    kept.get_or_make("b", make("b"))  # dropped, so made again
    assert made == ["a", "b", "c", "b"] and len(kept) == 2
