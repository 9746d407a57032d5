"""The executor: the only code that moves cache memory.

It runs a policy's stages for every layer that is due, with layers that share ``SlotBuffers``
stacked on the batch axis as a free view (one scorer call, one top-k, one gather for all of
them), on whatever device those buffers live on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .policy import Policy
from .stages.base import EvictionInput
from .state import LayerState, compact_rows


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
        if not self.policy.stochastic:
            return None
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._generators:
            g = torch.Generator(device=device)
            seed = self.policy.config.seed
            g.manual_seed(seed) if seed is not None else g.seed()
            self._generators[device] = g
        return self._generators[device]

    def evict(self, states: Sequence[LayerState]) -> int:
        """Evict every due layer in ``states``; return how many layers were evicted."""
        groups: dict[tuple[int, int], list[LayerState]] = {}
        for state in states:
            if state.eviction_due:
                groups.setdefault((id(state.buffers), state.length), []).append(state)
        for group in groups.values():
            self._evict_group(sorted(group, key=lambda s: s.index))
        return sum(len(g) for g in groups.values())

    def _evict_group(self, group: list[LayerState]) -> None:
        buffers, length = group[0].buffers, group[0].length
        first, n_layers = group[0].index, len(group)
        contiguous = [s.index for s in group] == list(range(first, first + n_layers))
        layers = slice(first, first + n_layers) if contiguous else torch.tensor([s.index for s in group])

        def stacked(t: torch.Tensor) -> torch.Tensor:
            part = t[layers]  # a view when the due layers are contiguous on the layer axis
            return part.flatten(0, 1)[:, :, :length]

        if self.policy.config.scorer is not None and self.policy.schedule.window > 0:
            windows = [s.window() for s in group]
            queries = torch.cat([w[0] for w in windows])
            query_valid = torch.cat([w[1] for w in windows])
        else:  # policies that read no query still get a well-formed, empty window
            b = buffers.keys.shape[1]
            d = buffers.keys.shape[-1]
            queries = buffers.keys.new_zeros(b * n_layers, buffers.keys.shape[2], 1, d)
            query_valid = torch.zeros(b * n_layers, 1, dtype=torch.bool, device=queries.device)
        keys = stacked(buffers.keys)
        schedule = self.policy.schedule
        inp = EvictionInput(
            keys=keys,
            values=stacked(buffers.values),
            queries=queries,
            budget=min(length, schedule.budget),
            num_candidates=max(0, length - schedule.recent),
            slot_valid=stacked(buffers.valid),
            query_valid=query_valid,
            positions=stacked(buffers.positions),
            generator=self.generator(keys.device),
            layer_seed=torch.tensor([s.seed for s in group], dtype=torch.long),
            rows_per_layer=buffers.keys.shape[1],
        )
        kept = self.policy.select_from(inp)
        kept = kept.unflatten(0, (n_layers, -1))
        if contiguous:
            compact_rows(buffers, layers, kept, length)
            for state in group:
                state.stats.slots_evicted += length - kept.shape[-1]
                state.length = kept.shape[-1]
                state.stats.slots_held = state.length
                state.stats.evictions += 1
                state.eviction_due = False
        else:
            for state, rows in zip(group, kept, strict=True):
                state.compact(rows)
