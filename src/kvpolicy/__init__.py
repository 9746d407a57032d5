"""kvpolicy: composable KV-cache eviction policies for LLM decoding."""

from .config import PolicyConfig, PolicyError
from .hookspecs import hookimpl
from .policy import Policy, load_policy
from .registry import get_registry
from .schedule import Schedule
from .stages import EvictionInput, Reservation, Scorer, Selector

__version__ = "0.1.0"

__all__ = [
    "EvictionInput",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "Reservation",
    "Schedule",
    "Scorer",
    "Selector",
    "__version__",
    "get_registry",
    "hookimpl",
    "load_policy",
]


def available_policies() -> list[str]:
    """Names of every registered policy (built-in and from plugins)."""
    return sorted(get_registry().policies)
