"""``EvictingCache``: a policy's KV cache for any decoding loop, with no transformers import.

Per layer it takes the step's keys, values and queries and hands back the keys, values and
validity mask to attend over, evicting on the policy's schedule. The Hugging Face integration
(``kvpolicy.hf``) is a thin adapter over this class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .executor import Executor
from .policy import Policy, load_policy
from .state import EvictionStats, LayerState, SlotBuffers


class EvictingCache:
    """Static, evicting KV storage for ``num_layers`` attention layers under one policy.

    Layers of one shape, dtype and device share ``SlotBuffers`` (allocated at the first append of
    the first of them), so the executor evicts them together. ``layer_devices`` (optional) says
    where each layer lives, for models split across devices.

    Typical use in a hand-written loop, per layer and step::

        keys, values, valid = cache.step(layer_idx, k_new, v_new, q_new)
        # attend over keys/values [B, Hkv, L, D] where valid [B, Hkv, L] is True
    """

    def __init__(
        self,
        policy: Policy | str | Any,
        num_layers: int,
        *,
        generator: torch.Generator | None = None,
        layer_devices: Sequence[torch.device | str | None] | None = None,
    ) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        self.policy = policy if isinstance(policy, Policy) else load_policy(policy)
        self.executor = Executor(self.policy, generator)
        seed = self.policy.config.seed or 0
        self.layers = [
            LayerState(self.policy.schedule, layer_idx=i, seed=seed * 1_000_003 + i) for i in range(num_layers)
        ]
        if layer_devices is not None and len(layer_devices) != num_layers:
            raise ValueError(f"layer_devices has {len(layer_devices)} entries for {num_layers} layers")
        self._layer_devices = [None if d is None else torch.device(d) for d in (layer_devices or [None] * num_layers)]

    # -- the step API ------------------------------------------------------------------------
    def update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
               token_valid: torch.Tensor | None = None) -> LayerState:
        """Evict what is due, then append the chunk's keys/values ``[B, Hkv, T, D]``."""
        state = self._layer(layer_idx)
        if state.eviction_due:
            self.executor.evict([s for s in self.layers if s.buffers is state.buffers])
        if state.buffers is not None and state.length == 0 and not _fits(state.buffers, keys, values):
            state.buffers = None  # pre-claimed by a peer of another shape: use buffers of its own
        if state.buffers is None:
            self._allocate(state, keys, values)
        state.append(keys, values, token_valid)
        return state

    def step(
        self,
        layer_idx: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None = None,
        token_valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append one step (or prompt chunk) and return ``(keys, values, valid)`` to attend over.

        Rows are packed: row ``r``'s real tokens sit in slots ``[0, counts[r])`` and padding is
        never stored, so ``valid`` is ``slot < counts[r]``. Inside a multi-token chunk, causality
        is by token position: a query at position ``p`` (``layers[i].last_query_positions``)
        attends the slots whose ``layers[i].positions`` are ``<= p``.

        Args:
            layer_idx: the layer, ``0 <= layer_idx < num_layers``.
            keys: ``[B, Hkv, T, D]`` new post-RoPE keys.
            values: ``[B, Hkv, T, Dv]`` new values.
            queries: ``[B, Hq, T, D]`` the chunk's post-RoPE queries (needed when the policy's
                window is non-zero).
            token_valid: ``[B, T]`` bool, False for padding tokens.
        """
        state = self.update(layer_idx, keys, values, token_valid)
        if queries is not None:
            state.record_queries(queries, token_valid)
        elif self.policy.schedule.window > 0 and self.policy.config.scorer is not None:
            raise ValueError(f"policy {self.policy.name!r} reads a query window: pass the step's queries")
        return state.keys, state.values, state.valid

    def evict_due(self) -> int:
        """Run every pending eviction now (they otherwise run at the next append)."""
        return self.executor.evict(self.layers)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index [B']`` of every layer, in that order (beam reordering,
        ``repeat_interleave`` for several samples per prompt, dropping finished rows)."""
        index = torch.as_tensor(index, dtype=torch.long)
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
        done: set[int] = set()
        for s in self.layers:
            if s.buffers is not None and id(s.buffers) not in done:
                done.add(id(s.buffers))
                s.buffers.select_rows(index)
            s.select_rows(index)

    # -- reporting ---------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes held by all static buffers and query windows."""
        seen: set[int] = set()
        total = 0
        for s in self.layers:
            if s.buffers is not None and id(s.buffers) not in seen:
                seen.add(id(s.buffers))
                total += s.buffers.nbytes()
            if s.queries is not None:
                total += s.queries.numel() * s.queries.element_size() + s.query_valid.numel()
        return total

    def stats(self) -> list[EvictionStats]:
        """Per-layer counters (evictions, tokens seen, slots held, slots evicted)."""
        return [s.stats for s in self.layers]

    def tokens_seen(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].stats.tokens_seen

    def reset(self) -> None:
        for s in self.layers:
            s.reset()

    # -- internals ---------------------------------------------------------------------------
    def _layer(self, layer_idx: int) -> LayerState:
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer {layer_idx} out of range for a cache of {len(self.layers)} layers")
        return self.layers[layer_idx]

    def _allocate(self, state: LayerState, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Allocate shared buffers for every not-yet-allocated layer expected to match this one."""
        device = keys.device
        peers = [
            s for s in self.layers
            if s.buffers is None and self._layer_devices[s.layer_idx] in (None, device)
        ]
        b, h, t, d = keys.shape
        buffers = SlotBuffers(
            len(peers), b, h, self.policy.schedule.capacity_for(t), d, values.shape[-1], keys.dtype, device
        )
        # Peers claim their slot on the layer axis now; a layer whose first chunk then turns out
        # to differ in shape gets buffers of its own (see LayerState.append's shape check).
        for i, s in enumerate(peers):
            s.buffers, s.index = buffers, i


def _fits(buffers: SlotBuffers, keys: torch.Tensor, values: torch.Tensor) -> bool:
    k, v = buffers.keys, buffers.values
    return (
        keys.shape[:2] == k.shape[1:3]
        and keys.shape[-1] == k.shape[-1]
        and values.shape[-1] == v.shape[-1]
        and keys.dtype == k.dtype
        and keys.device == k.device
    )
