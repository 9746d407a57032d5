"""The module named by the ``kvpolicy`` entry point: three hook implementations, nothing else."""

from __future__ import annotations

from importlib.resources import files

import kvpolicy

from .scorer import LazyEvictionScorer


@kvpolicy.hookimpl
def kvpolicy_contract():
    """Plugin contract 4: the scorer keeps state across evictions (``state_fields``,
    ``update_state``) and reads the window queries' positions, which contract 3 added, and its
    ``last`` field starts at each token's position (``StateField(initial="position")``), which
    contract 4 added. A literal, never ``kvpolicy.PLUGIN_CONTRACT``."""
    return 4


@kvpolicy.hookimpl
def kvpolicy_stages():
    """The stages this plugin adds: usable as ``{type: lazyeviction}`` in any policy file."""
    return [LazyEvictionScorer]


@kvpolicy.hookimpl
def kvpolicy_policies():
    """The named policies this plugin adds: ``kvpolicy.load_policy("lazyeviction")``."""
    return {"lazyeviction": files("kvpolicy_lazyeviction") / "policies" / "lazyeviction.yaml"}
