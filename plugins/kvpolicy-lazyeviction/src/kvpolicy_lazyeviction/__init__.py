"""LazyEviction for kvpolicy: lagged eviction by tokens' recurrence intervals (a stateful plugin)."""

from .scorer import STATE, LazyEvictionScorer

__all__ = ["STATE", "LazyEvictionScorer"]
