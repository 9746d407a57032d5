"""kvpolicy: composable KV-cache eviction policies for LLM decoding."""

from typing import TYPE_CHECKING, Any

from .config import PolicyConfig, PolicyError
from .documents import PolicyWarning
from .evicting import EvictingCache
from .hookspecs import PLUGIN_CONTRACT, hookimpl
from .loading import load_policy
from .policy import Policy
from .registry import UnknownStageError, get_registry
from .schedule import Schedule
from .stages import Allocation, EvictionInput, Reservation, Scorer, Selector
from .stages.guards import SelectionError
from .stages.model_facts import ModelFacts
from .state import CacheStateError

# Also in pyproject.toml; CHANGELOG.md says what changed. A development version of the next
# release while its changes are unreleased (plugin contract 4 is 0.3's: docs/plugins.md).
__version__ = "0.3.0.dev0"

if TYPE_CHECKING:
    from .hf import KVPolicyCache

__all__ = [
    "Allocation",
    "CacheStateError",
    "EvictingCache",
    "EvictionInput",
    "KVPolicyCache",
    "ModelFacts",
    "PLUGIN_CONTRACT",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "PolicyWarning",
    "Reservation",
    "Schedule",
    "Scorer",
    "SelectionError",
    "Selector",
    "UnknownStageError",
    "__version__",
    "get_registry",
    "hookimpl",
    "load_policy",
]


def available_policies() -> list[str]:
    """Names of every registered policy (built-in and from plugins)."""
    return sorted(get_registry().policies)


def __getattr__(name: str) -> Any:
    # KVPolicyCache lives in kvpolicy.hf, which imports transformers: load it on first use only.
    if name == "KVPolicyCache":
        from .hf import KVPolicyCache

        return KVPolicyCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
