"""Two tiers: what eviction drops is kept apart, in pages, and the stages recall the best of it.

- ``RecallConfig``: a policy's ``recall`` block (``PolicyConfig.recall``), checked at load.
- ``SlowTier``: the evicted pages (host memory, pinned under a GPU) and their summaries (fast tier).
- ``RecallBuffer``: the pages recalled into the fast tier, and the bytes moved.
- ``recall_due``: the one rule of when a row recalls.

The layout that drives them is ``kvpolicy.layouts.TwoTierRows``; the recall scorer's contract is
``kvpolicy.stages.recall`` (``Scorer.recall_summaries``, ``Scorer.score_summaries``).
"""

from .config import RecallConfig
from .recall import RecallBuffer, TierStats, recall_due
from .slow import SlowTier

__all__ = ["RecallBuffer", "RecallConfig", "SlowTier", "TierStats", "recall_due"]
