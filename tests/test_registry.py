"""The registry: built-ins registered like plugins, runtime plugins, conflicts and broken plugins."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from pydantic import Field

import kvpolicy
from kvpolicy.registry import (
    AUTOLOAD_ENV,
    PluginLoadWarning,
    Registry,
    UnknownStageError,
    get_registry,
    reset_registry,
)
from kvpolicy.stages import BUILTIN_STAGES, Scorer

BUILTIN_POLICIES = {
    "curdkv",
    "evict-large-range",
    "oracle-topk",
    "quest",
    "random",
    "rkv",
    "snapkv",
    "streamingllm",
    "vase-attnv",
    "vase-dkv",
}


class ConstantScorer(Scorer):
    """Every slot scores ``value`` (a test plugin's stage)."""

    type_name: ClassVar[str] = "constant_test"

    value: float = Field(1.0, ge=0.0)

    def score(self, inp):
        return torch.full(inp.keys.shape[:3], self.value)


class ShadowingAttention(Scorer):
    """Tries to take the built-in ``attention`` type name."""

    type_name: ClassVar[str] = "attention"

    def score(self, inp):
        return torch.zeros(inp.keys.shape[:3])


class ConstantPlugin:
    """A plugin object, as a third party would write it (module-level functions work the same)."""

    @kvpolicy.hookimpl
    def kvpolicy_stages(self):
        return [ConstantScorer]

    @kvpolicy.hookimpl
    def kvpolicy_policies(self):
        return {
            "constant-test": {
                "name": "constant-test",
                "schedule": {"budget": 8, "recent": 2, "interval": 4, "window": 0},
                "scorer": {"type": "constant_test", "value": 0.5},
                "selector": {"type": "greedy"},
            }
        }


@pytest.fixture(autouse=True)
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


def test_builtins_register_through_the_plugin_hooks():
    registry = Registry(autoload=False)
    assert set(registry.policies) == BUILTIN_POLICIES
    assert {r.plugin for r in registry.policies.values()} == {"kvpolicy"}
    registered = [r.obj for kind in registry.stages.values() for r in kind.values()]
    assert set(registered) == set(BUILTIN_STAGES)
    assert {r.plugin for kind in registry.stages.values() for r in kind.values()} == {"kvpolicy"}
    assert registry.pm.get_plugin("kvpolicy") is not None


def test_builtins_by_kind():
    registry = Registry(autoload=False)
    assert set(registry.stages["scorer"]) == {
        "attention",
        "combination",
        "current_attention",
        "key_norm",
        "leverage",
        "quest",
        "random",
        "redundancy",
        "value_magnitude",
    }
    assert set(registry.stages["reservation"]) == {"sinks", "top_scores"}
    assert set(registry.stages["selector"]) == {"greedy", "keep_protected", "stochastic"}


def test_every_builtin_policy_loads():
    for name in BUILTIN_POLICIES:
        assert kvpolicy.load_policy(name).name == name


def test_autoload_env_disables_entry_points(monkeypatch):
    import kvpolicy.registry as registry_module

    called = []
    monkeypatch.setattr(registry_module, "entry_points", lambda group: called.append(group) or [])
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    Registry()
    assert called == []
    monkeypatch.setenv(AUTOLOAD_ENV, "0")
    Registry()
    assert called == ["kvpolicy"]


def test_runtime_plugin_stage_and_policy_are_usable():
    registry = get_registry()
    registry.register_plugin(ConstantPlugin(), name="constant-plugin")
    assert registry.stages["scorer"]["constant_test"].plugin == "constant-plugin"
    assert registry.policies["constant-test"].plugin == "constant-plugin"

    policy = kvpolicy.load_policy("constant-test")
    assert policy.config.scorer == ConstantScorer(value=0.5)

    # Nested wherever a built-in scorer may go: combination terms and top_scores reservations.
    policy = kvpolicy.load_policy(
        {
            "name": "nested",
            "schedule": {"budget": 8, "recent": 2, "interval": 4, "window": 0},
            "scorer": {
                "type": "combination",
                "terms": [{"weight": 2.0, "scorer": {"type": "constant_test", "value": 3.0}}],
            },
            "reservations": [{"type": "top_scores", "scorer": "constant_test", "n": 2}],
            "selector": "greedy",
        }
    )
    assert policy.config.scorer.terms[0].scorer == ConstantScorer(value=3.0)
    assert policy.config.reservations[0].scorer == ConstantScorer()
    keys = torch.randn(1, 2, 12, 4)
    kept = policy.select(keys, keys, torch.zeros(1, 2, 0, 4))
    assert kept.shape == (1, 2, 8)


def test_runtime_plugin_fields_are_validated():
    get_registry().register_plugin(ConstantPlugin(), name="constant-plugin")
    with pytest.raises(kvpolicy.PolicyError, match=r"scorer\.value"):
        kvpolicy.load_policy(
            {
                "name": "bad",
                "schedule": {"budget": 8, "recent": 2, "interval": 4, "window": 0},
                "scorer": {"type": "constant_test", "value": -1},
                "selector": {"type": "greedy"},
            }
        )


def test_duplicate_type_name_warns_and_keeps_the_first():
    registry = Registry(autoload=False)

    class Shadow:
        @kvpolicy.hookimpl
        def kvpolicy_stages(self):
            return [ShadowingAttention]

    with pytest.warns(PluginLoadWarning, match=r"'shadow'.*'attention'.*'kvpolicy'"):
        registry.register_plugin(Shadow(), name="shadow")
    assert registry.stages["scorer"]["attention"].plugin == "kvpolicy"
    assert registry.stages["scorer"]["attention"].obj is not ShadowingAttention


def test_duplicate_policy_name_warns_and_keeps_the_first():
    registry = Registry(autoload=False)

    class Shadow:
        @kvpolicy.hookimpl
        def kvpolicy_policies(self):
            return {"snapkv": {"name": "snapkv"}}

    with pytest.warns(PluginLoadWarning, match=r"policy 'snapkv' is already registered by 'kvpolicy'"):
        registry.register_plugin(Shadow(), name="shadow")
    assert registry.policies["snapkv"].plugin == "kvpolicy"


def test_failing_hook_warns_and_the_rest_still_loads():
    registry = Registry(autoload=False)

    class Failing:
        @kvpolicy.hookimpl
        def kvpolicy_stages(self):
            raise RuntimeError("boom")

        @kvpolicy.hookimpl
        def kvpolicy_policies(self):
            return {"still-here": {"name": "still-here"}}

    with pytest.warns(PluginLoadWarning, match=r"'failing' failed in kvpolicy_stages.*boom"):
        registry.register_plugin(Failing(), name="failing")
    assert "still-here" in registry.policies
    assert "attention" in registry.stages["scorer"]


def test_non_stage_class_is_refused_with_a_warning():
    registry = Registry(autoload=False)

    class NotAStage:
        @kvpolicy.hookimpl
        def kvpolicy_stages(self):
            return [dict]

    with pytest.warns(PluginLoadWarning, match="not a Scorer, Reservation or Selector"):
        registry.register_plugin(NotAStage(), name="not-a-stage")


def test_broken_entry_point_warns_with_its_name(monkeypatch):
    from importlib.metadata import EntryPoint

    import kvpolicy.registry as registry_module

    broken = EntryPoint(name="broken", value="kvpolicy_missing_module_xyz", group="kvpolicy")
    monkeypatch.setattr(registry_module, "entry_points", lambda group: [broken])
    with pytest.warns(PluginLoadWarning, match=r"'broken' \(kvpolicy_missing_module_xyz\) failed to load"):
        registry = Registry(autoload=True)
    assert set(registry.policies) == BUILTIN_POLICIES


def test_unknown_stage_lists_the_registered_ones():
    registry = Registry(autoload=False)
    with pytest.raises(UnknownStageError, match="registered selectors: greedy, keep_protected, stochastic"):
        registry.stage_class("selector", "nope")
    with pytest.raises(kvpolicy.PolicyError, match="unknown scorer type 'nope'"):
        kvpolicy.load_policy(
            {"name": "x", "schedule": {"budget": 8, "recent": 2}, "scorer": "nope", "selector": "greedy"}
        )


def test_build_stage_accepts_a_bare_name_and_a_mapping():
    registry = Registry(autoload=False)
    assert registry.build_stage("selector", "greedy") == registry.build_stage("selector", {"type": "greedy"})
    with pytest.raises(ValueError, match="needs a 'type' key"):
        registry.build_stage("scorer", {"kernel": 5})


def test_available_policies_lists_the_registry():
    assert BUILTIN_POLICIES <= set(kvpolicy.available_policies())
