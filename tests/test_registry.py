"""The registry: built-ins registered like plugins, runtime plugins, conflicts and broken plugins."""

from __future__ import annotations

import re
import warnings
from typing import ClassVar

import pytest
import torch
from helpers import Contract2Plugin
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
    "ada-snapkv",
    "ada-vase-attnv",
    "arkvale",
    "snapkv-recall",
    "vase-attnv-recall",
    "cake",
    "cam",
    "d2o",
    "snapkv-merge",
    "chunkkv",
    "criticalkv",
    "duo-attention",
    "pyramidkv",
    "curdkv",
    "dms",
    "evict-large-range",
    "expected-attention",
    "gkv",
    "h2o",
    "knorm",
    "lagkv",
    "oracle-topk",
    "quest",
    "random",
    "random-prompt",
    "rkv",
    "snapkv",
    "snapkv-paper",
    "streamingllm",
    "tova",
    "triattention",
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


class ConstantPlugin(Contract2Plugin):
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
        "accumulated_attention",
        "arrival_score",
        "attention",
        "cake_attention",
        "landmark",
        "combination",
        "current_attention",
        "expected_attention",
        "gkv",
        "key_norm",
        "lag",
        "leverage",
        "normalized",
        "output_value_norm",
        "product",
        "quest",
        "random",
        "redundancy",
        "shared_heads",
        "smoothed_attention",
        "triattention",
        "value_magnitude",
    }
    assert set(registry.stages["reservation"]) == {"prompt", "sinks", "top_scores"}
    assert set(registry.stages["selector"]) == {"chunks", "greedy", "keep_protected", "stochastic", "threshold"}
    assert set(registry.stages["allocation"]) == {"uniform", "pyramid", "layers", "adaptive", "profile", "duo", "cake"}


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

    class Shadow(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_stages(self):
            return [ShadowingAttention]

    with pytest.warns(PluginLoadWarning, match=r"'shadow'.*'attention'.*'kvpolicy'"):
        registry.register_plugin(Shadow(), name="shadow")
    assert registry.stages["scorer"]["attention"].plugin == "kvpolicy"
    assert registry.stages["scorer"]["attention"].obj is not ShadowingAttention


def test_duplicate_policy_name_warns_and_keeps_the_first():
    registry = Registry(autoload=False)

    class Shadow(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_policies(self):
            return {"snapkv": {"name": "snapkv"}}

    with pytest.warns(PluginLoadWarning, match=r"policy 'snapkv' is already registered by 'kvpolicy'"):
        registry.register_plugin(Shadow(), name="shadow")
    assert registry.policies["snapkv"].plugin == "kvpolicy"


def test_failing_hook_warns_and_the_rest_still_loads():
    registry = Registry(autoload=False)

    class Failing(Contract2Plugin):
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


def test_what_a_plugin_gives_is_checked_entry_by_entry_naming_it():
    """Found from outside: a stage class missing its abstract method registered silently (then
    failed at load without a field path), a Stage of no kind raised a bare AttributeError, a str
    returned by kvpolicy_stages was read character by character, a policy given as 42 registered
    and then read as a file name, and registering a plugin twice raised pluggy's ValueError.
    Each bad entry is now skipped with a warning naming it; the plugin's good entries stay."""
    from kvpolicy.stages.base import Stage

    class NoScore(Scorer):
        type_name: ClassVar[str] = "test_noscore"

    class NoKind(Stage):
        type_name: ClassVar[str] = "test_nokind"

    class Mixed(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_stages(self):
            return [dict, NoScore, NoKind, ConstantScorer]

        @kvpolicy.hookimpl
        def kvpolicy_policies(self):
            return {"num-pol": 42, 7: "name: x", "fine-pol": {"name": "fine-pol"}}

    registry = Registry(autoload=False)
    with pytest.warns(PluginLoadWarning) as caught:
        assert registry.register_plugin(Mixed(), name="mixed")
    said = [str(w.message) for w in caught]
    for why in ("<class 'dict'> is not a stage class", "NoScore does not implement score",
                "NoKind subclasses Stage itself", "policy 'num-pol' is a int, not a YAML document",
                "a policy is named 7, not by a str"):
        assert any(why in message for message in said), (why, said)
    assert "constant_test" in registry.stages["scorer"] and "test_noscore" not in registry.stages["scorer"]
    assert "fine-pol" in registry.policies and "num-pol" not in registry.policies

    class Text(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_stages(self):
            return "abc"

    with pytest.warns(PluginLoadWarning, match="kvpolicy_stages must return a list of stage classes, got str"):
        registry.register_plugin(Text(), name="text")
    with pytest.warns(PluginLoadWarning, match="'mixed' is not registered: this object, or another plugin"):
        assert not registry.register_plugin(Mixed(), name="mixed")


def test_a_type_name_that_is_not_a_word_is_skipped_and_breaks_nothing_else():
    """Found from outside: a stage class whose ``type_name`` was not a str (``5``) registered,
    could never be named in a policy file (types are read as str), and then broke every other
    user: the "unknown scorer type" error and ``policy_json_schema`` sorted the registered names
    and raised ``TypeError: '<' not supported between instances of 'int' and 'str'``. Such a
    class (and an empty name) is now skipped with a warning naming it."""
    from kvpolicy.schema import policy_json_schema

    class IntName(Scorer):
        type_name: ClassVar = 5

        def score(self, inp):
            return torch.zeros(inp.keys.shape[:3])

    class EmptyName(Scorer):
        type_name: ClassVar = ""

        def score(self, inp):
            return torch.zeros(inp.keys.shape[:3])

    class Odd(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_stages(self):
            return [IntName, EmptyName, ConstantScorer]

    registry = Registry(autoload=False)
    with pytest.warns(PluginLoadWarning) as caught:
        assert registry.register_plugin(Odd(), name="odd")
    said = [str(w.message) for w in caught]
    assert any("IntName" in m and "type_name 5 is not a non-empty str" in m for m in said), said
    assert any("EmptyName" in m and "type_name '' is not a non-empty str" in m for m in said), said
    assert 5 not in registry.stages["scorer"] and "" not in registry.stages["scorer"]
    assert "constant_test" in registry.stages["scorer"]
    with pytest.raises(UnknownStageError, match="unknown scorer type 'nosuch'; registered scorers: .*constant_test"):
        registry.stage_class("scorer", "nosuch")
    reset_registry()
    kvpolicy.registry._REGISTRY = registry
    try:
        assert policy_json_schema()
    finally:
        reset_registry()


def test_a_plugin_policy_whose_file_is_missing_is_refused_as_a_missing_file():
    """Found from outside: a plugin policy given as a path str that does not exist (a path
    relative to the package, resolved against the working directory) was read as YAML text and
    refused as "a policy file holds a mapping, got str". It is now "no such policy file", naming
    the file, the policy and its plugin."""

    class Missing(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_policies(self):
            return {"gone-pol": "policies/not-there.yaml", "gone-dir": "policies/sub/x"}

    registry = get_registry()
    assert registry.register_plugin(Missing(), name="missing")
    for name, path in (("gone-pol", "policies/not-there.yaml"), ("gone-dir", "policies/sub/x")):
        with pytest.raises(kvpolicy.PolicyError, match=re.escape(f"no such policy file: {path} (policy {name!r} of plugin 'missing')")):
            kvpolicy.load_policy(name)


def test_register_plugin_with_a_malformed_hook_warns_and_returns_false():
    """Found from outside: at discovery a plugin whose hook takes arguments the hookspec lacks is
    skipped with a PluginLoadWarning, but ``register_plugin`` (documented to skip "as at
    discovery" and to return whether it registered) raised pluggy's PluginValidationError. It
    now warns, naming the plugin and the hook, records it in ``skipped`` and returns False."""

    class Malformed(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_stages(self, extra):
            return [ConstantScorer]

    registry = Registry(autoload=False)
    with pytest.warns(PluginLoadWarning, match="kvpolicy plugin 'malformed' .*kvpolicy_stages"):
        assert registry.register_plugin(Malformed(), name="malformed") is False
    assert "malformed" in registry.skipped
    assert "constant_test" not in registry.stages["scorer"]
    assert registry.pm.get_plugin("malformed") is None


def test_a_plugin_policy_given_as_a_resource_in_a_zip_loads(tmp_path):
    """Found from outside: the example plugins ship their policies as
    ``importlib.resources.files(pkg) / "policies" / "x.yaml"``, and ``load_policy`` reads any
    ``Traversable``; but the registry kept only ``os.PathLike`` sources, so the same plugin
    installed from a zip (a zipapp, a zipped wheel on sys.path), where that is a ``zipfile.Path``,
    lost its policy with "is a Path, not a YAML document". A Traversable is now registered."""
    import zipfile

    archive = tmp_path / "plugin.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pkg/policies/zipped.yaml", "name: zipped\nschedule: {budget: 16, recent: 4}\nscorer: key_norm\nselector: greedy\n")
    resource = zipfile.Path(archive) / "pkg" / "policies" / "zipped.yaml"

    class Zipped(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_policies(self):
            return {"zipped": resource}

    registry = get_registry()
    assert registry.register_plugin(Zipped(), name="zipped")
    assert "zipped" in registry.policies
    assert kvpolicy.load_policy("zipped", budget=32).schedule.budget == 32


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
    with pytest.raises(UnknownStageError, match="registered selectors: chunks, greedy, keep_protected, stochastic"):
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


# -- the plugin contract ---------------------------------------------------------------------------
def _entry_point_plugin(monkeypatch, name: str, **hooks) -> None:
    """An importable plugin module ``name`` with ``hooks``, the only ``kvpolicy`` entry point."""
    import sys
    import types
    from importlib.metadata import EntryPoint

    import kvpolicy.registry as registry_module

    module = types.ModuleType(name)
    for hook, value in hooks.items():
        setattr(module, hook, kvpolicy.hookimpl(value))
    monkeypatch.setitem(sys.modules, name, module)
    entry = EntryPoint(name=name, value=name, group="kvpolicy")
    monkeypatch.setattr(registry_module, "entry_points", lambda group: [entry])


OLD_POLICY = {"old-policy": {"name": "old-policy", "schedule": {"budget": 8, "recent": 2}, "selector": "greedy",
                             "scorer": "key_norm"}}


def test_builtins_declare_the_contract_through_the_same_hook():
    from kvpolicy import builtin

    assert kvpolicy.PLUGIN_CONTRACT == 4
    assert builtin.kvpolicy_contract() == kvpolicy.PLUGIN_CONTRACT
    registry = Registry(autoload=False)
    impls = registry.pm.hook.kvpolicy_contract.get_hookimpls()
    assert [i.plugin for i in impls] == [builtin] and registry.skipped == {}


@pytest.mark.parametrize(
    "hooks,why",
    [
        ({"kvpolicy_contract": lambda: 1}, r"was written for plugin contract 1 \(kvpolicy 0\.1\.x: .*generator"),
        ({"kvpolicy_contract": lambda: 5}, r"was written for plugin contract 5 \(a contract this kvpolicy does not know"),
        ({}, r"declares no plugin contract \(no kvpolicy_contract hook\), so it was written for contract 1 .*"
             r"declare it with `@kvpolicy.hookimpl def kvpolicy_contract\(\): return 4`"),
        ({"kvpolicy_contract": lambda: "2"}, r"its kvpolicy_contract hook returned '2'; it must return .* an int"),
        ({"kvpolicy_contract": lambda: 1 / 0}, r"its kvpolicy_contract hook failed: ZeroDivisionError"),
    ],
    ids=["contract-1", "newer-contract", "undeclared", "not-an-int", "hook-fails"],
)
def test_a_plugin_of_another_contract_is_skipped_with_a_warning_that_says_why(monkeypatch, hooks, why):
    _entry_point_plugin(monkeypatch, "kvpolicy_old_plugin_xyz",
                        kvpolicy_policies=lambda: OLD_POLICY, kvpolicy_stages=lambda: [ConstantScorer], **hooks)
    with pytest.warns(PluginLoadWarning, match=r"plugin 'kvpolicy_old_plugin_xyz' \(kvpolicy_old_plugin_xyz\) is "
                                                r"skipped: .*" + why):
        registry = Registry(autoload=True)
    assert "old-policy" not in registry.policies and "constant_test" not in registry.stages["scorer"]
    assert registry.pm.get_plugin("kvpolicy_old_plugin_xyz") is None
    assert "kvpolicy_old_plugin_xyz" in registry.skipped
    assert set(registry.policies) == BUILTIN_POLICIES  # the others still load


@pytest.mark.parametrize("contract", [2, 3, 4])
def test_a_plugin_of_this_contract_loads_from_its_entry_point(monkeypatch, contract):
    """Contract 4 only adds to contract 3 (position initials, query positions always given, stable
    state names), which only adds to contract 2 (stage state, query positions): plugins of all load."""
    _entry_point_plugin(monkeypatch, "kvpolicy_new_plugin_xyz", kvpolicy_contract=lambda: contract,
                        kvpolicy_policies=lambda: OLD_POLICY)
    registry = Registry(autoload=True)
    assert registry.policies["old-policy"].plugin == "kvpolicy_new_plugin_xyz" and registry.skipped == {}


class Contract3Arrival(Scorer):
    """A stateful stage written for contract 3, as LazyEviction was: a ``-1`` sentinel for "since
    the token arrived" (no ``initial="position"`` yet) and a guard for a ``query_new`` that contract
    3 allowed to be None. It keeps each token's arrival (its position) and counts the queries
    that saw it."""

    type_name: ClassVar[str] = "contract3_arrival_test"
    reads_queries: ClassVar[bool] = True

    @property
    def state_fields(self):
        from kvpolicy.stages import StateField

        return {"arrived": StateField(torch.float32, -1.0), "seen": StateField(torch.float32, 0.0)}

    def update_state(self, inp):
        state = inp.state_of(self)
        new = inp.query_valid if inp.query_new is None else inp.query_new & inp.query_valid
        qpos = inp.query_positions
        if qpos is None:
            raise ValueError("needs query_positions")
        arrived = torch.where(state["arrived"] < 0, inp.positions.float(), state["arrived"])
        sees = (inp.positions[..., None] <= qpos[:, None, None, :]) & new[:, None, None, :]  # [B, Hkv, N, W]
        seen = state["seen"] + (sees & inp.slot_valid[..., None]).sum(-1).float()
        return {"arrived": torch.where(inp.slot_valid, arrived, state["arrived"]), "seen": seen}

    def score(self, inp):
        return inp.state_of(self)["seen"]


def test_a_contract_3_plugin_with_state_still_loads_and_runs(monkeypatch):
    """Contract 4 changed what a cache stores its state under (``"<type_name>.<field>"``), not
    what a stage reads (``inp.state_of``, its own field names): a contract 3 stateful stage loads
    from its entry point and keeps its state through a cache's evictions."""
    import warnings

    _entry_point_plugin(monkeypatch, "kvpolicy_contract3_plugin_xyz", kvpolicy_contract=lambda: 3,
                        kvpolicy_stages=lambda: [Contract3Arrival])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        registry = get_registry()
    assert registry.stages["scorer"]["contract3_arrival_test"].plugin == "kvpolicy_contract3_plugin_xyz"
    assert registry.skipped == {}
    policy = kvpolicy.load_policy({"name": "c3", "schedule": {"budget": 8, "recent": 2, "interval": 2, "window": 2},
                                   "scorer": "contract3_arrival_test", "selector": "greedy"})
    assert set(policy.state_fields) == {"contract3_arrival_test.arrived", "contract3_arrival_test.seen"}
    cache = kvpolicy.EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(0)
    for t in [6] + [1] * 12:
        cache.attend(0, torch.randn(1, 4, t, 4, generator=g), torch.randn(1, 2, t, 4, generator=g),
                     torch.randn(1, 2, t, 4, generator=g))
    view = cache.layers[0]
    assert int(view.evictions[0]) >= 3
    # each held token's arrival is its position once the state has seen it (-1 before: the sentinel)
    arrived, positions, held = view.state["contract3_arrival_test.arrived"], view.positions.float(), view.valid
    assert bool(((arrived == positions) | (arrived == -1))[held].all()) and int((arrived == positions)[held].sum()) >= 8
    with pytest.raises(ValueError, match="state field 'contract3_arrival_test.seen' must be a"):
        policy.select(torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4), torch.randn(1, 4, 2, 4),
                      state={"contract3_arrival_test.arrived": torch.zeros(1, 2, 12),
                             "contract3_arrival_test.seen": torch.zeros(1, 2, 11)})


def test_a_runtime_plugin_is_checked_too():
    registry = Registry(autoload=False)

    class Undeclared:
        @kvpolicy.hookimpl
        def kvpolicy_stages(self):
            return [ConstantScorer]

    with pytest.warns(PluginLoadWarning, match=r"'undeclared' is skipped: it declares no plugin contract"):
        assert registry.register_plugin(Undeclared(), name="undeclared") is False
    assert "constant_test" not in registry.stages["scorer"]
    assert registry.register_plugin(ConstantPlugin(), name="constant-plugin") is True


class GeneratorScorer(Scorer):
    """A stochastic scorer written for kvpolicy 0.1: it drew from ``inp.generator``."""

    type_name: ClassVar[str] = "generator_test"
    stochastic: ClassVar[bool] = True

    def score(self, inp):
        return torch.rand(inp.keys.shape[:3], generator=inp.generator)


def test_the_removed_generator_names_its_replacements():
    policy = kvpolicy.load_policy({"name": "old", "schedule": {"budget": 8, "recent": 2, "interval": 4, "window": 0},
                                   "scorer": GeneratorScorer(), "selector": "greedy"})
    keys = torch.randn(1, 2, 12, 4)
    replacements = r".*".join(re.escape(f"inp.{n}(") for n in ("uniform", "normal", "head_uniform", "head_normal"))
    message = r"EvictionInput\.generator was removed in kvpolicy 0\.2 \(plugin contract 2\): .*" + replacements
    with pytest.raises(AttributeError, match=message):
        policy.select(keys, keys, torch.zeros(1, 2, 0, 4))
    # the same from a cache's eviction (what generate() runs)
    cache = kvpolicy.EvictingCache(policy, num_layers=1)
    with pytest.raises(AttributeError, match=message):
        for _ in range(16):  # fires at 12 slots; the next step evicts
            cache.step(0, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    with pytest.raises(AttributeError, match=r"rows_per_layer was removed .*inp\.layer_seed and inp\.row_seed"):
        _ = kvpolicy.EvictionInput.__getattr__(object.__new__(kvpolicy.EvictionInput), "rows_per_layer")


def test_the_version_is_bumped_and_the_changelog_describes_it():
    """Removing EvictionInput.generator broke plugins: 0.2.0, with a changelog entry for it. The
    unreleased changes implement plugin contract 4, 0.3's (docs/plugins.md): the version says
    0.3.0.dev0 until 0.3.0 is released, so that a pin on 0.2 never gets them."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    declared = re.search(r'^version = "(.+)"$', (root / "pyproject.toml").read_text(), flags=re.M)
    assert declared is not None and kvpolicy.__version__ == declared.group(1)
    changelog = (root / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog, flags=re.M)
    assert releases[0] == "0.2.0" and releases[-1] == "0.1.0"
    assert kvpolicy.__version__ == "0.3.0.dev0" and kvpolicy.PLUGIN_CONTRACT == 4
    assert changelog.index("## [Unreleased]") < changelog.index("## [0.2.0]")
    latest = changelog.split("## [0.2.0]")[1].split("## [0.1.0]")[0]
    assert "generator" in latest and "kvpolicy_contract" in latest and "Removed" in latest


def test_a_misspelt_hook_is_warned_of_and_the_rest_of_the_plugin_loads():
    """Found from outside: a hook implementation no hookspec names (``kvpolicy_stage`` for
    ``kvpolicy_stages``) registered silently and was never called. It is now warned of, naming
    it and the real hooks; the plugin's other hooks load."""

    class Misspelt(Contract2Plugin):
        @kvpolicy.hookimpl
        def kvpolicy_stage(self):
            return [ConstantScorer]

    registry = Registry(autoload=False)
    with pytest.warns(PluginLoadWarning, match=r"'misspelt' implements kvpolicy_stage, .*never called.*kvpolicy_stages"):
        assert registry.register_plugin(Misspelt(), name="misspelt") is True
    assert "constant_test" not in registry.stages["scorer"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)  # a plugin whose hooks are all known: no warning
        assert Registry(autoload=False).register_plugin(Contract2Plugin(), name="plain") is True
