"""kvpolicy's own plugin: registers the built-in stages and policy files like any third party."""

from __future__ import annotations

from importlib.resources import files

from .hookspecs import hookimpl
from .stages import BUILTIN_STAGES


@hookimpl
def kvpolicy_contract():
    return 4  # a literal, as every plugin writes it (kvpolicy.PLUGIN_CONTRACT would always match)


@hookimpl
def kvpolicy_stages():
    return list(BUILTIN_STAGES)


@hookimpl
def kvpolicy_policies():
    folder = files("kvpolicy") / "policies"
    return {
        entry.name.removesuffix(".yaml"): entry
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".yaml")
    }
