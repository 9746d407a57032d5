"""The executor: the only code that moves cache memory.

It evicts the due rows of a ``LayerGroup``: every layer of the group at once, stacked on the
batch axis as a free view (one scorer call, one top-k, one gather for all of them), on whatever
device the group's buffers live on. The policy chooses; the executor compacts.
"""

from __future__ import annotations

import torch

from .policy import Policy, eviction_input
from .state import LayerGroup, block, compact_rows


class Executor:
    """Evicts due rows of a policy's layer groups, with the cache's seed."""

    def __init__(self, policy: Policy, seed: int) -> None:
        self.policy = policy
        self.seed = seed

    def evict(self, group: LayerGroup) -> int:
        """Evict every due row of ``group`` (all its layers); return how many rows evicted."""
        if not group.any_due:
            return 0
        group.require_complete("evict")
        group.materialise_positions()
        due = group.due.clone()
        # Rows holding different counts (different prompt lengths) are evicted apart, each as it
        # would be alone; in the usual case every row is due with one count and this runs once.
        for count in group.counts[due].unique().tolist():
            rows = (due & (group.counts == count)).nonzero().squeeze(1)
            self._evict_rows(group, rows, int(count))
        group.eviction_steps += 1
        return int(due.sum())

    def _evict_rows(self, group: LayerGroup, rows: torch.Tensor, count: int) -> None:
        """Run the policy on ``rows`` (host ``[R]``, all holding ``count`` slots) of every layer
        of ``group`` at once and compact them."""
        buffers = group.buffers
        n_layers, n_rows = buffers.keys.shape[0], rows.numel()
        row_sel: slice | torch.Tensor = slice(None) if n_rows == group.batch else rows
        queries, query_valid = group.windows(slice(None), row_sel)
        if queries.shape[2] == 0:  # no window: a well-formed empty one
            queries = buffers.keys.new_zeros(n_layers * n_rows, buffers.keys.shape[2], 0, buffers.keys.shape[-1])
        schedule = self.policy.schedule
        inp = eviction_input(
            block(buffers.keys, row_sel, count).flatten(0, 1),
            block(buffers.values, row_sel, count).flatten(0, 1),
            queries,
            budget=schedule.budget,
            recent=schedule.recent,
            seed=self.seed,
            query_valid=query_valid,
            positions=block(buffers.positions, row_sel, count).flatten(0, 1),
            layer_idx=group.layer_ids.repeat_interleave(n_rows),
            evictions=group.evictions[rows].repeat(n_layers),
            streams=group.streams[rows].repeat(n_layers),
        )
        kept = self.policy.select_from(inp).unflatten(0, (n_layers, n_rows))
        compact_rows(buffers, row_sel, kept, count)
        group.evicted(rows, kept.shape[-1])
