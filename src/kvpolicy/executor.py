"""The executor: the only code that moves cache memory.

It runs a policy's stages for every layer that is due, with layers that share ``SlotBuffers``
stacked on the batch axis as a free view (one scorer call, one top-k, one gather for all of
them), on whatever device those buffers live on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .policy import Policy, generator_for
from .stages.base import EvictionInput
from .state import LayerState, block, compact_rows


class Executor:
    """Evicts due layers of one policy; owns the generator of its stochastic stages.

    ``generator`` (optional) is used on its device; otherwise one generator per device is
    seeded from ``policy.config.seed``, so a run is reproducible from the policy file alone.
    """

    def __init__(self, policy: Policy, generator: torch.Generator | None = None) -> None:
        self.policy = policy
        self._generators: dict[torch.device, torch.Generator] = {}
        if generator is not None:
            self._generators[torch.device(generator.device)] = generator

    def generator(self, device: torch.device) -> torch.Generator | None:
        """This executor's generator on ``device`` (its own stream, not the policy's: two caches
        sharing a policy stay independent and reproducible); None for deterministic policies."""
        if not self.policy.stochastic:
            return None
        return generator_for(self._generators, device, self.policy.config.seed)

    def evict(self, states: Sequence[LayerState]) -> int:
        """Evict every due row of every due layer in ``states``; return how many layers evicted."""
        groups: dict[tuple, list[LayerState]] = {}
        for state in states:
            if state.eviction_due:
                # Layers sharing buffers saw the same tokens, so they agree on rows and counts.
                key = (id(state.buffers), tuple(state.due_rows), tuple(state.counts))
                groups.setdefault(key, []).append(state)
        for group in groups.values():
            group.sort(key=lambda s: s.index)
            rows_by_count: dict[int, list[int]] = {}
            for row, (due, count) in enumerate(zip(group[0].due_rows, group[0].counts, strict=True)):
                if due:
                    rows_by_count.setdefault(count, []).append(row)
            for count, rows in rows_by_count.items():
                kept = self._evict_rows(group, rows, count)
                for state in group:
                    state.evicted(rows, kept)
        return sum(len(g) for g in groups.values())

    def _evict_rows(self, group: list[LayerState], rows: list[int], count: int) -> int:
        """Run the policy on ``rows`` (all holding ``count`` slots) of the layers in ``group`` at
        once and compact them; return the slots kept per row."""
        buffers = group[0].buffers
        first, n_layers = group[0].index, len(group)
        batch = buffers.keys.shape[1]
        if [s.index for s in group] == list(range(first, first + n_layers)):
            layers: slice | torch.Tensor = slice(first, first + n_layers)
        else:
            layers = torch.tensor([s.index for s in group])
        # The usual case (every row due, equal counts) reads views; rows out of phase with the
        # rest of the batch are gathered.
        row_sel: slice | torch.Tensor = slice(None) if rows == list(range(batch)) else torch.tensor(rows)
        device = buffers.keys.device

        def stacked(t: torch.Tensor) -> torch.Tensor:
            return block(t, layers, row_sel, count).flatten(0, 1)

        n_rows = len(rows)
        if self.policy.config.scorer is not None and self.policy.schedule.window > 0:
            windows = [s.window() for s in group]
            idx = torch.tensor(rows, device=windows[0][0].device)
            queries = torch.cat([w[0].index_select(0, idx) for w in windows])
            query_valid = torch.cat([w[1].index_select(0, idx) for w in windows])
        else:  # policies that read no query still get a well-formed, empty window
            d = buffers.keys.shape[-1]
            queries = buffers.keys.new_zeros(n_rows * n_layers, buffers.keys.shape[2], 1, d)
            query_valid = torch.zeros(n_rows * n_layers, 1, dtype=torch.bool, device=device)
        keys = stacked(buffers.keys)
        schedule = self.policy.schedule
        inp = EvictionInput(
            keys=keys,
            values=stacked(buffers.values),
            queries=queries,
            budget=min(count, schedule.budget),
            num_candidates=max(0, count - schedule.recent),
            slot_valid=stacked(buffers.valid),
            query_valid=query_valid,
            positions=stacked(buffers.positions),
            generator=self.generator(device),
            layer_seed=torch.tensor([s.seed for s in group], dtype=torch.long),
            rows_per_layer=n_rows,
        )
        kept = self.policy.select_from(inp).unflatten(0, (n_layers, n_rows))
        compact_rows(buffers, layers, row_sel, kept, count)
        return kept.shape[-1]
