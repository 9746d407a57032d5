"""KeyDiff for kvpolicy: keep the keys that differ most from the others (an example plugin)."""

from .scorer import KeyDiffScorer, keydiff_scores

__all__ = ["KeyDiffScorer", "keydiff_scores"]
