"""The module named by the ``kvpolicy`` entry point: three hook implementations, nothing else."""

from __future__ import annotations

from importlib.resources import files

import kvpolicy

from .scorer import KeyDiffScorer


@kvpolicy.hookimpl
def kvpolicy_contract():
    """The plugin contract this plugin was written for: kvpolicy skips it, with a warning, where
    it loads none of its contracts (contract 4 loads plugins of 2, 3 and 4). A literal, never
    ``kvpolicy.PLUGIN_CONTRACT``."""
    return 4


@kvpolicy.hookimpl
def kvpolicy_stages():
    """The stages this plugin adds: usable as ``{type: keydiff}`` in any policy file."""
    return [KeyDiffScorer]


@kvpolicy.hookimpl
def kvpolicy_policies():
    """The named policies this plugin adds: ``kvpolicy.load_policy("keydiff")``."""
    return {"keydiff": files("kvpolicy_keydiff") / "policies" / "keydiff.yaml"}
