"""The plugin manager and the registry of stages and named policies.

Built-ins are registered first (through ``kvpolicy.builtin``, with the same hooks as plugins),
then every ``kvpolicy`` entry point unless ``KVPOLICY_DISABLE_PLUGIN_AUTOLOAD`` is set. A plugin
that fails to import, that was written for another plugin contract (``kvpolicy_contract``, see
``kvpolicy.hookspecs``) or that fails to answer a hook is skipped with a warning that names it
and says why.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

if sys.version_info >= (3, 11):
    from importlib.resources.abc import Traversable
else:  # Python 3.10 has it in importlib.abc only
    from importlib.abc import Traversable

from . import builtin, hookspecs
from .hookspecs import ACCEPTED_CONTRACTS, CONTRACTS, PLUGIN_CONTRACT
from .stages.base import STAGE_KINDS, Stage, StageKind
from .stages.spec import set_stage_builder

ENTRY_POINT_GROUP = "kvpolicy"
AUTOLOAD_ENV = "KVPOLICY_DISABLE_PLUGIN_AUTOLOAD"


class PluginLoadWarning(UserWarning):
    """A plugin could not be loaded or registered; the others still are."""


class UnknownStageError(ValueError):
    """A policy names a stage type that no plugin registered."""


@dataclass(frozen=True)
class Registered:
    """A registered stage class or policy source and the plugin it came from."""

    name: str
    plugin: str
    obj: Any


class Registry:
    """Stages by kind and ``type_name``, and named policies, with their plugins."""

    def __init__(self, autoload: bool | None = None) -> None:
        self.pm = pluggy.PluginManager("kvpolicy")
        self.pm.add_hookspecs(hookspecs)
        self.stages: dict[StageKind, dict[str, Registered]] = {k: {} for k in STAGE_KINDS}
        self.policies: dict[str, Registered] = {}
        #: Plugins not registered, by name: why (failed to import, another plugin contract).
        self.skipped: dict[str, str] = {}
        self.pm.register(builtin, name="kvpolicy")
        self._admit(builtin, "kvpolicy")
        if autoload is None:
            autoload = os.environ.get(AUTOLOAD_ENV, "").strip().lower() in ("", "0", "false", "no")
        if autoload:
            self._load_entry_points()
        for plugin in self.pm.get_plugins():
            self._collect(plugin)

    def register_plugin(self, plugin: Any, name: str | None = None) -> bool:
        """Register a plugin object at run time (tests, notebooks) and collect its hooks.

        Returns whether it was registered: a plugin of another plugin contract is skipped with
        a ``PluginLoadWarning``, as at discovery (and so is nothing under a blocked name).
        """
        try:
            name = self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:  # a hook pluggy refuses: skipped, as at discovery
            label = name if name is not None else self.pm.get_canonical_name(plugin)
            self._skip(str(label), repr(label), f"failed to register and is skipped: {exc}".replace("\n", "; "))
            return False
        except ValueError:  # pluggy: this plugin object, or another under its name, is registered
            warnings.warn(f"kvpolicy plugin {name!r} is not registered: this object, or another plugin under its name, "
                          "is registered already", PluginLoadWarning, stacklevel=2)
            return False
        if name is None:  # the name is blocked and pluggy registered nothing
            return False
        if not self._admit(plugin, repr(name)):
            return False
        self._collect(self.pm.get_plugin(name))
        return True

    def _load_entry_points(self) -> None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if self.pm.get_plugin(ep.name) is not None or self.pm.is_blocked(ep.name):
                continue
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
            except Exception as exc:  # a broken plugin must not take the others down
                self._skip(ep.name, f"{ep.name!r} ({ep.value})", f"failed to load and is skipped: "
                           f"{type(exc).__name__}: {exc}")
                continue
            self._admit(plugin, f"{ep.name!r} ({ep.value})")

    def _admit(self, plugin: Any, label: str) -> bool:
        """Keep the registered ``plugin`` if it declares this kvpolicy's plugin contract; else
        unregister it with a warning saying why (``label`` names it in the warning)."""
        problem = self._contract_problem(plugin)
        if problem is None:
            self._warn_unknown_hooks(plugin, label)
            return True
        name = self.pm.get_name(plugin)
        self.pm.unregister(plugin)
        self._skip(str(name), label, f"is skipped: {problem}")
        return False

    def _warn_unknown_hooks(self, plugin: Any, label: str) -> None:
        """Warn of ``plugin``'s hook implementations that no hookspec names (a misspelt
        ``kvpolicy_stage``, say): pluggy keeps them, and kvpolicy never calls them."""
        unknown = sorted(hc.name for hc in self.pm.get_hookcallers(plugin) or [] if hc.spec is None)
        if unknown:
            known = sorted(name for name in dir(hookspecs) if name.startswith("kvpolicy_"))
            warnings.warn(f"kvpolicy plugin {label} implements {', '.join(unknown)}, which no kvpolicy hook is named: "
                          f"they are never called (the hooks: {', '.join(known)})", PluginLoadWarning, stacklevel=4)

    def _contract_problem(self, plugin: Any) -> str | None:
        """Why ``plugin`` keeps no contract of ``ACCEPTED_CONTRACTS``, or None when it keeps one."""
        impls = [i for i in self.pm.hook.kvpolicy_contract.get_hookimpls() if i.plugin is plugin]
        fix = f"declare it with `@kvpolicy.hookimpl def kvpolicy_contract(): return {PLUGIN_CONTRACT}`"
        if not impls:
            return (f"it declares no plugin contract (no kvpolicy_contract hook), so it was written for "
                    f"contract 1 ({CONTRACTS[1]}); this kvpolicy implements contract {PLUGIN_CONTRACT} "
                    f"({CONTRACTS[PLUGIN_CONTRACT]}). Once the plugin keeps contract {PLUGIN_CONTRACT}, {fix}")
        try:
            declared = impls[0].function()
        except Exception as exc:
            return f"its kvpolicy_contract hook failed: {type(exc).__name__}: {exc}"
        if isinstance(declared, bool) or not isinstance(declared, int):
            return (f"its kvpolicy_contract hook returned {declared!r}; it must return the contract "
                    f"it was written for as an int ({PLUGIN_CONTRACT} for this kvpolicy)")
        if declared not in ACCEPTED_CONTRACTS:
            was = CONTRACTS.get(declared, "a contract this kvpolicy does not know: a newer kvpolicy's?")
            return (f"it was written for plugin contract {declared} ({was}); this kvpolicy implements "
                    f"contract {PLUGIN_CONTRACT} ({CONTRACTS[PLUGIN_CONTRACT]}). Install a kvpolicy "
                    "release that implements its contract, or a version of the plugin written for this one")
        return None

    def _skip(self, name: str, label: str, why: str) -> None:
        self.skipped[name] = why
        warnings.warn(f"kvpolicy plugin {label} {why}", PluginLoadWarning, stacklevel=4)

    def _collect(self, plugin: Any) -> None:
        name = self.pm.get_name(plugin)
        if name is None:  # never: only registered plugins are collected
            raise ValueError(f"plugin {plugin!r} is not registered")
        for hook, sink in (("kvpolicy_stages", self._add_stages), ("kvpolicy_policies", self._add_policies)):
            impls = [i for i in getattr(self.pm.hook, hook).get_hookimpls() if i.plugin is plugin]
            try:
                for impl in impls:
                    sink(name, impl.function())
            except Exception as exc:
                warnings.warn(
                    f"kvpolicy plugin {name!r} failed in {hook} and is partly skipped: "
                    f"{type(exc).__name__}: {exc}",
                    PluginLoadWarning,
                    stacklevel=3,
                )

    def _add_stages(self, plugin: str, classes: Any) -> None:
        if classes is None:
            return
        if isinstance(classes, (str, bytes, Mapping)) or not isinstance(classes, (list, tuple)):
            raise TypeError(f"kvpolicy_stages must return a list of stage classes, got {type(classes).__name__}")
        for cls in classes:
            problem = _stage_class_problem(cls)
            if problem is not None:  # this class alone is skipped, the plugin's others are kept
                warnings.warn(f"kvpolicy plugin {plugin!r}: {problem}; it is skipped", PluginLoadWarning, stacklevel=4)
                continue
            table = self.stages[cls.kind]
            if cls.type_name in table:
                warnings.warn(
                    f"kvpolicy plugin {plugin!r}: {cls.kind} type {cls.type_name!r} is already "
                    f"registered by {table[cls.type_name].plugin!r}; the later one is ignored",
                    PluginLoadWarning,
                    stacklevel=4,
                )
                continue
            table[cls.type_name] = Registered(cls.type_name, plugin, cls)

    def _add_policies(self, plugin: str, policies: Mapping[str, Any]) -> None:
        if policies is None:
            return
        if not isinstance(policies, Mapping):
            raise TypeError(f"kvpolicy_policies must return a mapping of name to policy, got {type(policies).__name__}")
        for pname, source in policies.items():
            problem = (f"a policy is named {pname!r}, not by a str" if not isinstance(pname, str) else
                       None if isinstance(source, (str, os.PathLike, Mapping, Traversable)) else
                       f"policy {pname!r} is a {type(source).__name__}, not a YAML document, a file path "
                       "(or an importlib.resources Traversable) or a mapping")
            if problem is not None:  # this policy alone is skipped
                warnings.warn(f"kvpolicy plugin {plugin!r}: {problem}; it is skipped", PluginLoadWarning, stacklevel=4)
                continue
            if pname in self.policies:
                warnings.warn(
                    f"kvpolicy plugin {plugin!r}: policy {pname!r} is already registered by "
                    f"{self.policies[pname].plugin!r}; the later one is ignored",
                    PluginLoadWarning,
                    stacklevel=4,
                )
                continue
            self.policies[pname] = Registered(pname, plugin, source)

    def stage_class(self, kind: StageKind, type_name: str) -> type[Stage]:
        table = self.stages[kind]
        if type_name not in table:
            known = ", ".join(sorted(table)) or "none"
            raise UnknownStageError(f"unknown {kind} type {type_name!r}; registered {kind}s: {known}")
        return table[type_name].obj

    def build_stage(self, kind: StageKind, spec: Any) -> Stage:
        """Build a stage from ``{type: NAME, ...params}`` (or a bare ``NAME`` string)."""
        if isinstance(spec, str):
            spec = {"type": spec}
        if not isinstance(spec, Mapping):
            raise ValueError(f"a {kind} is written as a mapping with a 'type' key, got {spec!r}")
        if "type" not in spec:
            known = ", ".join(sorted(self.stages[kind]))
            raise ValueError(f"a {kind} needs a 'type' key; registered {kind}s: {known}")
        params = {k: v for k, v in spec.items() if k != "type"}
        return self.stage_class(kind, str(spec["type"])).model_validate(params)


def _stage_class_problem(cls: Any) -> str | None:
    """Why ``cls`` cannot be registered as a stage (None: it can)."""
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        return f"{cls!r} is not a stage class (a subclass of Scorer, Reservation, Selector, Allocation or Merge)"
    if getattr(cls, "kind", None) not in STAGE_KINDS:
        return f"{cls.__name__} subclasses Stage itself, not one of its kinds (Scorer, Reservation, ...)"
    if cls.__dict__.get("type_name") is None:
        return f"{cls.__name__} declares no type_name of its own"
    if not isinstance(cls.type_name, str) or not cls.type_name:
        # Policy files name types by str; any other key could never be used and would break the
        # sorted listings of registered names (error messages, the schema) for every user.
        return f"{cls.__name__}'s type_name {cls.type_name!r} is not a non-empty str"
    if inspect.isabstract(cls):
        return f"{cls.__name__} does not implement {', '.join(sorted(cls.__abstractmethods__))}"
    return None


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the registry so that the next use rediscovers plugins (tests, after installs)."""
    global _REGISTRY
    _REGISTRY = None


def _build_stage(kind: StageKind, spec: Any) -> Stage:
    return get_registry().build_stage(kind, spec)


# Nested stages (``ScorerSpec`` fields: a policy's scorer, combination's terms) are built by the
# process-wide registry; the stages below it cannot import it (see ``kvpolicy.stages.spec``).
set_stage_builder(_build_stage)
