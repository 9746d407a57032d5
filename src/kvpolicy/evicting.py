"""``EvictingCache``: a policy's KV cache for any decoding loop, with no transformers import.

Per layer and step it takes the new keys, values and queries, evicts on the policy's schedule,
and attends (``attend``) or hands back the slots to attend over (``step``). The Hugging Face
integration (``kvpolicy.hf``) is a thin adapter over ``attend``.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .config import PolicyError
from .documents import PolicyWarning
from .eviction import new_queries
from .executor import Executor
from .inputs import FLOAT_DTYPES
from .layouts import layout_for
from .loading import load_policy
from .policy import Policy
from .selection import SELECT_GROWTH, check_select_growth
from .stages.model_facts import ModelFacts
from .state import CacheStateError, EvictionStats, LayerGroup
from .tiers import TierStats


class EvictingCache:
    """Static, evicting KV storage for ``num_layers`` attention layers under one policy.

    Layers of one shape, dtype and device form one ``LayerGroup`` (static buffers with a layer
    axis, allocated at the first append of the first of them), evicted together. The policy
    decides the groups' layout once (``kvpolicy.layouts.layout_for``): even rows, per-head runs
    or select mode.

    Args:
        policy: a ``Policy``, or anything ``load_policy`` takes.
        num_layers: attention layers, indexed ``0 .. num_layers - 1``.
        num_kv_heads: KV heads per layer, when known (a per-head allocation checks it here;
            otherwise at the first append).
        layer_devices: where each layer lives, for models split across devices (optional).
        seed: overrides the policy's ``seed``. Fixed for the cache's life: ``reset()`` keeps it,
            so a reset cache decodes exactly as a fresh one.
        independent_rows: give batch row ``r`` random stream ``r`` (identical rows, e.g. several
            samples of one prompt, then draw independently). The default, False, keeps every
            row's draws a function of that row alone: a row evicts as it would alone.
        select_growth: select mode only (every token kept): when a chunk does not fit, the
            buffers grow to this many times the slots it needs (at least 16 more), a number in
            ``(1, 16]``. The default, 1.1, keeps at most 10 % headroom and copies the cache once
            per 10 % of growth; 2.0 copies less often and holds up to twice the cache.
        model_facts: what the policy's stages may ask of the model (``ModelFacts``: RoPE, the
            output projection), required when they read any (``Policy.needs_model``: Expected
            Attention, CriticalKV, TriAttention); checked here, before any work, and against the
            keys' shape at the first append. Slot positions are taken for RoPE positions: number
            each row's real tokens from 0, as ``generate()`` does.

    Typical use in a hand-written loop, per layer and step::

        out = cache.attend(layer_idx, q_new, k_new, v_new)          # [B, Hq, T, D]
        # or, to run your own attention over the slots:
        keys, values, valid = cache.step(layer_idx, k_new, v_new, q_new)
    """

    def __init__(
        self,
        policy: Policy | str | Any,
        num_layers: int,
        *,
        layer_devices: Sequence[torch.device | str | None] | None = None,
        seed: int | None = None,
        independent_rows: bool = False,
        num_kv_heads: int | None = None,
        select_growth: float = SELECT_GROWTH,
        model_facts: ModelFacts | None = None,
    ) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.policy = policy if isinstance(policy, Policy) else load_policy(policy)
        # Refused here, before any work, when a stage needs a fact these do not give.
        self.policy.check_model_facts(model_facts, num_layers=num_layers, num_kv_heads=num_kv_heads)
        self.model_facts = model_facts if self.policy.needs_model else None
        # Each layer's schedule under the policy's allocation (refused here, before any work,
        # when the allocation cannot serve this model).
        self.schedules = self.policy.layer_schedules(num_layers, num_kv_heads)
        self._num_kv_heads = num_kv_heads
        self.seed = self.policy.resolve_seed(seed)
        self.executor = Executor(self.policy, self.seed, self.model_facts)
        self.independent_rows = independent_rows
        self.select_growth = check_select_growth(select_growth)
        self._layout = layout_for(self.policy, self.executor, self.select_growth)
        self._admit = self._layout.kind.admit  # refuses a step's input before anything is stored
        if layer_devices is not None and len(layer_devices) != num_layers:
            raise ValueError(f"layer_devices has {len(layer_devices)} entries for {num_layers} layers")
        self._layer_devices = [None if d is None else torch.device(d) for d in (layer_devices or [None] * num_layers)]
        self._groups: list[LayerGroup | None] = [None] * num_layers
        self._front: tuple[int, int, int] | None = None  # the latest step opened: (step, rows, tokens)
        self.layers = [LayerView(self, i) for i in range(num_layers)]
        # An allocation that decides the layer budgets from the prompt (CAKE) does so once every
        # layer holds it, before the first eviction; until then the schedules are provisional.
        self._from_prompt = self.policy.allocation.from_prompt
        if self._from_prompt and self.policy.mode != "evict":
            raise PolicyError(
                [f"allocation {self.policy.allocation.type_name!r} decides the layer budgets from the prompt, "
                 "before the first eviction: evict mode only"], self.policy.name,
            )
        self._nominal_schedules = list(self.schedules)
        self._prompt_decided = False
        self._prompt_tokens: int | None = None  # a prompt declared to come in several steps

    def __repr__(self) -> str:
        return f"EvictingCache({self.policy!r}, layers={len(self.layers)}, tokens_seen={self.tokens_seen()})"

    # -- the step API ------------------------------------------------------------------------
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
        never stored, so ``valid [B, Hkv, L]`` is ``slot < counts[r]``. Inside a multi-token
        chunk, causality is by token order (``attend`` applies it for you). Under a two-tier
        policy (a ``recall`` block), once a recall has filled the recall buffer, its ``Rb`` slots
        come first: ``[B, Hkv, Rb + L]``, ``valid`` per KV head over them, then the kept slots.

        Args:
            layer_idx: the layer, ``0 <= layer_idx < num_layers``.
            keys: ``[B, Hkv, T, D]`` new post-RoPE keys.
            values: ``[B, Hkv, T, Dv]`` new values.
            queries: ``[B, Hq, T, D]`` the chunk's post-RoPE queries (required when the policy
                keeps a query window, ``schedule.window > 0``).
            token_valid: ``[B, T]`` bool, False for padding tokens.
        """
        group = self._append(layer_idx, keys, values, queries, token_valid)
        held = group.layout.attended(layer_idx)
        return held.keys, held.values, held.valid

    def attend(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        token_valid: torch.Tensor | None = None,
        *,
        scaling: float | None = None,
    ) -> torch.Tensor:
        """``step``, then attention of the chunk's queries over the layer's slots: ``[B, Hq, T, D]``.

        Shapes as in ``step``; ``scaling`` defaults to ``D ** -0.5``. Exact for padded batches
        (a padding query's output is finite and meaningless) and for chunks of any length.
        """
        group = self._append(layer_idx, keys, values, queries, token_valid)
        return group.layout.attend(layer_idx, queries, scaling)

    def evict_due(self) -> int:
        """Run every pending eviction now (they otherwise run when the next step begins);
        return how many rows were evicted, summed over layer groups."""
        groups = self._unique_groups()
        due = [g for g in groups if g.any_due]
        for group in due:
            _check_writable(group, "evict")
        if due:
            self._decide_from_prompt()
        return sum(self.executor.evict(g) for g in groups)

    def _decide_from_prompt(self) -> None:
        """``from_prompt`` allocations: each layer's budget from what every layer holds now, once,
        before the first eviction (every layer has written the step that made it due)."""
        if not self._from_prompt or self._prompt_decided:
            return
        groups = self._groups
        if not self._step_complete():
            raise CacheStateError(
                f"allocation {self.policy.allocation.type_name!r} decides the layer budgets once every layer holds the "
                "prompt: every layer must finish the step before the first eviction"
            )
        batch = max(g.batch for g in groups if g is not None)
        if batch > 1:  # the documents' "a row decodes as it would alone" does not hold: say so, loudly
            warnings.warn(
                f"allocation {self.policy.allocation.type_name!r} decides one set of layer budgets from the "
                f"{batch} rows of the batch together (CAKE's reference sums its preference over the batch), so each "
                "row keeps other slots than it would alone; for rows exact alone, give each row a cache of its own "
                "(vLLM decides per request)", PolicyWarning, stacklevel=3,
            )
        inputs = []
        for layer, group in enumerate(groups):
            assert group is not None
            group.materialise_positions()
            rows = torch.arange(group.batch)
            inputs.append(self.executor.group_input(group, rows, slice(None), group.layout.gather_layer(layer),
                                                       layer=layer))
        for layer, (group, schedule) in enumerate(zip(groups, self.policy.prompt_schedules(inputs), strict=True)):
            assert group is not None
            group.schedule = self.schedules[layer] = schedule
        self._prompt_decided = True

    def tokens_to_next_eviction(self) -> int | None:
        """Real tokens per row, appended one step at a time from now, until the next eviction
        fires for some row (0 if one is due now); None before the first append. In select mode:
        how many tokens one chunk may hold and still attend exactly as step by step (1 once the
        longest row holds ``budget`` slots)."""
        groups = self._unique_groups()
        if not groups:
            return None
        return min(g.layout.tokens_to_next_eviction() for g in groups)

    def select_rows(self, index: torch.Tensor | Sequence[int]) -> None:
        """Keep batch rows ``index [B']`` of every layer, in that order (beam reordering,
        ``repeat_interleave`` for several samples per prompt, dropping finished rows). Integer
        row numbers only: a bool mask or a float index is refused, not read as numbers."""
        if isinstance(index, torch.Tensor):
            if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
                raise ValueError(f"index must hold row numbers (an integer tensor), got a {index.dtype} tensor"
                                 + (": for a mask, pass mask.nonzero().flatten()" if index.dtype == torch.bool else ""))
        elif any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in index):
            raise ValueError(f"index must hold row numbers (ints), got {list(index)!r:.80}")
        index = torch.as_tensor(index, dtype=torch.long)
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
        self._require_aligned("reorder rows")
        groups = self._unique_groups()
        for group in groups:
            if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < group.batch:
                raise IndexError(f"row index out of range for a batch of {group.batch}: {index.tolist()}")
            _check_writable(group, "select rows")
        for group in groups:
            group.select_rows(index)

    # -- reporting ---------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes held by all static buffers and query windows."""
        return sum(g.memory_bytes() for g in self._unique_groups())

    def held_bytes(self) -> int:
        """Bytes of what the cache holds now: ``memory_bytes`` with the slot buffers counted only
        where a slot holds a token of a head (keys, values, positions, per-slot state), the query
        windows and per-head state whole. Under a threshold (``dms``) or a per-head allocation
        heads hold different counts, and this is what they hold; ``memory_bytes`` is the room."""
        return sum(g.held_bytes() for g in self._unique_groups())

    def tier_stats(self) -> TierStats | None:
        """A two-tier policy's tiers (``PolicyConfig.recall``), summed over the layer groups:
        bytes held in each tier (the fast tier's counting the recall buffer and the slow tier's
        summaries; ``memory_bytes`` is the fast tier and the query windows), bytes moved each way
        and recall hits since the start (a step's: the difference of two readings). None for a
        policy without a ``recall`` block; all zero before the first append."""
        if self.policy.config.recall is None:
            return None
        total = TierStats(0, 0, 0, 0, 0, 0, 0, 0, 0)
        for group in self._unique_groups():
            total = total + group.layout.tier_stats()  # type: ignore[attr-defined]  # TwoTierRows's
        return total

    def head_counts(self, layer_idx: int = 0) -> torch.Tensor:
        """``[B, Hkv]`` long (host): slots each KV head of each row holds on ``layer_idx`` now
        (empty before the first append)."""
        group = self._groups[self._check_index(layer_idx)]
        if group is None:
            return torch.zeros(0, 0, dtype=torch.long)
        return group.head_counts(layer_idx)

    def stats(self) -> list[EvictionStats]:
        """Per-layer counters (evictions, tokens seen, slots held, slots evicted, and the slots
        each head holds: ``head_slots_held``, ``head_slots_fewest``, ``head_slots_most``)."""
        return [view.stats for view in self.layers]

    def tokens_seen(self, layer_idx: int = 0) -> int:
        """Padded positions appended to ``layer_idx`` (RoPE positions grow with it)."""
        return self.layers[self._check_index(layer_idx)].stats.tokens_seen

    def expect_prompt(self, tokens: int) -> None:
        """Declare that the next ``tokens`` token positions (padding included), fed in any number
        of steps, are the prompt: the steps before its last never evict, and the step that
        completes it is the prompt step, so a prompt fed in chunks keeps exactly what it keeps fed
        as one step (``kvpolicy.schedule.step_phase``). Without it the first step is the prompt.

        Raises:
            ValueError: ``tokens`` is not a positive int.
            CacheStateError: the cache holds tokens already (declare before the first step, or
                after ``reset()``).

        A step that runs on past the declared end is refused: end a step at the prompt's end.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"expect_prompt takes a positive int of token positions, got {tokens!r}")
        if any(g is not None for g in self._groups):
            raise CacheStateError("expect_prompt declares a prompt before the first step: this cache holds tokens "
                                  "already (call reset() first)")
        self._prompt_tokens = tokens

    def reset(self) -> None:
        """Forget every token and free the buffers: the cache is then exactly a fresh one."""
        self._groups = [None] * len(self.layers)
        self._front = None
        self.schedules = list(self._nominal_schedules)
        self._prompt_decided = False
        self._prompt_tokens = None

    # -- internals ---------------------------------------------------------------------------
    def _unique_groups(self) -> list[LayerGroup]:
        seen: dict[int, LayerGroup] = {}
        for g in self._groups:
            if g is not None:
                seen.setdefault(id(g), g)
        return list(seen.values())

    def _check_index(self, layer_idx: int) -> int:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise IndexError(
                f"layer {layer_idx!r} out of range: this cache was built for {len(self.layers)} layers "
                "(was it built for another model?)"
            )
        return layer_idx

    def _append(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
        queries: torch.Tensor | None, token_valid: torch.Tensor | None,
    ) -> LayerGroup:
        self._check_index(layer_idx)
        _check_step(keys, values, queries, token_valid)
        window = self.policy.schedule.window
        self._admit(layer_idx, keys, values, queries, token_valid, window)
        if queries is None and window > 0:
            raise ValueError(
                f"policy {self.policy.name!r} keeps a window of {window} queries: "
                "pass the step's post-RoPE queries"
            )
        group = self._groups[layer_idx]
        opens = self._check_other_groups(layer_idx, group, keys)
        if group is not None:
            _check_writable(group, "run this step")
        if group is not None and not group.fits(keys, values):
            if group.steps != 1 or group.layer_steps[group.member[layer_idx]] != 0:
                raise ValueError(
                    f"layer {layer_idx}: keys {tuple(keys.shape)} {keys.dtype} on {keys.device} do not match the "
                    f"cache's [B={group.batch}, Hkv={group.buffers.keys.shape[2]}, T, D={group.buffers.keys.shape[4]}] "
                    f"{group.buffers.keys.dtype} on {group.device}"
                )
            # Claimed by a peer of another shape at its first step: this layer gets a group of its own.
            del group.member[layer_idx]
            group = self._groups[layer_idx] = None
        if group is None:
            group = self._new_group(layer_idx, keys, values, queries, token_valid)
        elif group.written(layer_idx):  # this layer opens the next step for the whole group
            if group.any_due:
                self._decide_from_prompt()
            self.executor.before_step(group, keys.shape[2])
            group.begin_step(keys.shape[2], token_valid)
        if opens is not None:  # the step has begun: later layers join it
            self._front = opens
        group.write(layer_idx, keys, values, queries)
        if self._from_prompt and not self._prompt_decided and self._step_complete():
            if any(g.any_due for g in self._unique_groups()):
                self._decide_from_prompt()  # as soon as every layer holds the prompt: schedules final
        return group

    def _check_other_groups(
        self, layer_idx: int, group: LayerGroup | None, keys: torch.Tensor
    ) -> tuple[int, int, int] | None:
        """Refuse an append that opens a step the other layer groups do not share. Layers of
        other budgets (per-layer allocations) or devices have buffers of their own, so a group's
        own checks (``LayerGroup.require_complete``, ``LayerGroup.write``) see only its layers:
        every layer must write each step once, of one batch size and length. ``_front`` is the
        latest step a group opened, ``(step, rows, tokens)``: a group that opens the next one
        checks every layer once; the others opening it check its shape. Returns the new front when
        this append opens the next step (``_append`` records it once the step has begun)."""
        if group is not None and len(group.member) == len(self.layers):
            return None  # one group of every layer: its own checks see them all (the decode fast path)
        if group is None or (group.steps == 1 and not group.written(layer_idx)):
            target = 1  # a layer's first step (or its first chunk, of another shape than its peers')
        elif group.written(layer_idx):
            target = group.steps + 1
        else:
            return None  # joins a step its group opened, checked then (and by LayerGroup.write)
        front = self._front
        if front is not None and target == front[0]:
            if keys.shape[0] != front[1] or keys.shape[2] != front[2]:
                raise CacheStateError(
                    f"layer {layer_idx} appends keys {tuple(keys.shape)} but this step was begun with "
                    f"{front[1]} rows of {front[2]} tokens, which it has not written (a forward was "
                    "interrupted, or refused: call reset() before reusing the cache)"
                )
            return None
        if front is not None and target < front[0]:
            if target == 1:
                return None  # a layer appending for the first time late: _new_group says so
            behind = [layer_idx]  # the other layers are on a later step
        elif front is None:
            behind = []  # the first step of all
        else:
            behind = [i for i, g in enumerate(self._groups) if g is None or not g.written(i) or g.steps != front[0]]
        if behind:
            raise CacheStateError(
                f"cannot begin a step: layers {behind[:8]} did not write the last step. A forward was "
                "interrupted, or the cache serves a model with another number of layers. Call reset() before "
                "reusing it."
            )
        return (target, keys.shape[0], keys.shape[2])

    def _require_aligned(self, action: str) -> None:
        """Every layer has written the same, latest step (across groups: see ``_check_other_groups``)."""
        first = self._groups[0]
        if self._front is None or (first is not None and len(first.member) == len(self.layers)):
            return  # nothing appended yet, or one group of every layer: LayerGroup.require_complete
        if not self._step_complete():
            latest = self._front[0]
            behind = [i for i, g in enumerate(self._groups) if g is None or g.steps != latest or not g.written(i)]
            raise CacheStateError(
                f"cannot {action}: layers {behind[:8]} did not write the last step. A forward was interrupted, "
                "or the cache serves a model with another number of layers. Call reset() before reusing it."
            )

    def _step_complete(self) -> bool:
        """Whether every layer has written the same, current step."""
        groups = self._groups
        if any(g is None for g in groups):
            return False
        steps = {g.steps for g in groups if g is not None}
        return len(steps) == 1 and all(g is not None and g.written(i) for i, g in enumerate(groups))

    def _new_group(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
        queries: torch.Tensor | None, token_valid: torch.Tensor | None,
    ) -> LayerGroup:
        """A group for this layer and every layer not yet placed that may share its buffers (a
        layer whose first chunk then differs in shape leaves it: see ``_append``)."""
        started = [g for g in self._unique_groups() if g.steps > 1]
        if started:
            raise CacheStateError(
                f"layer {layer_idx} appends for the first time after other layers finished a step: the cache "
                "serves a model with another layer layout, or a forward was interrupted. Call reset()."
            )
        device = keys.device
        if self._num_kv_heads is None:  # the model's shape is known now: check it before any work
            self.policy.check_model_facts(self.model_facts, num_kv_heads=keys.shape[1])
            self._num_kv_heads = keys.shape[1]
            self.schedules = self.policy.layer_schedules(len(self.layers), keys.shape[1])
            self._nominal_schedules = list(self.schedules)
        if self.model_facts is not None:
            self.model_facts.check_shape(num_kv_heads=keys.shape[1], head_dim=keys.shape[3])
        schedule = self.schedules[layer_idx]
        peers = [  # layers whose budgets are still to be decided (from_prompt) get buffers of their own
            i for i in range(len(self.layers))
            if self._groups[i] is None and self._layer_devices[i] in (None, device)
            and self.schedules[i].budget == schedule.budget and not self._from_prompt
        ]
        if layer_idx not in peers:
            peers.insert(0, layer_idx)
        query_heads = keys.shape[1] if queries is None else queries.shape[1]
        group = LayerGroup(schedule, peers, keys, values, query_heads, token_valid, self._layout, self._prompt_tokens)
        if self.independent_rows:
            group.rows.streams = torch.arange(group.batch)
        for i in peers:
            self._groups[i] = group
        return group


class LayerView:
    """One layer of an ``EvictingCache``: read-only views of its slots and counters."""

    def __init__(self, cache: EvictingCache, layer_idx: int) -> None:
        self._cache = cache
        self.layer_idx = layer_idx

    def __repr__(self) -> str:
        return f"LayerView(layer={self.layer_idx}, slots={self.length}, tokens_seen={self.stats.tokens_seen})"

    @property
    def group(self) -> LayerGroup | None:
        """The layer's group (None before its first append)."""
        return self._cache._groups[self.layer_idx]

    def _group(self) -> LayerGroup:
        group = self.group
        if group is None:
            raise CacheStateError(f"layer {self.layer_idx} holds nothing yet")
        return group

    @property
    def is_allocated(self) -> bool:
        return self.group is not None

    @property
    def length(self) -> int:
        """The slot extent: slots held by the longest row."""
        group = self.group
        return 0 if group is None else group.extent(self.layer_idx)

    @property
    def counts(self) -> list[int]:
        """Slots held per row."""
        group = self.group
        return [] if group is None else group.counts_of(self.layer_idx).tolist()

    @property
    def evictions(self) -> torch.Tensor:
        """``[B]`` long: evictions each row has had (what ``Policy.select(evictions=...)`` takes;
        in select mode, the choices it made before this step)."""
        return self._group().layout.draw_counts().clone()

    @property
    def streams(self) -> torch.Tensor:
        """``[B]`` long: each row's random stream (what ``Policy.select(streams=...)`` takes)."""
        return self._group().rows.streams.clone()

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """``[B]`` long: each row's prompt tokens, the real tokens of the cache's first step (what
        ``Policy.select(prompt_lengths=...)`` takes)."""
        return self._group().rows.prompt.clone()

    @property
    def eviction_due(self) -> bool:
        group = self.group
        return group is not None and group.written(self.layer_idx) and group.any_due

    @property
    def keys(self) -> torch.Tensor:
        """``[B, Hkv, L, D]`` view of the held slots (``L`` = the longest row's count). When heads
        hold different counts (a per-head allocation), a copy with each head's slots
        right-aligned in ``L`` columns (its fullest head's count); ``valid`` says which."""
        return self._group().layout.slots(self.layer_idx).keys

    @property
    def values(self) -> torch.Tensor:
        return self._group().layout.slots(self.layer_idx).values

    @property
    def valid(self) -> torch.Tensor:
        """``[B, Hkv, L]`` bool: slot ``s`` of row ``r`` holds a token iff ``s < counts[r]``
        (per-head allocations: see ``keys``)."""
        return self._group().layout.slots(self.layer_idx).valid

    @property
    def positions(self) -> torch.Tensor:
        """``[B, Hkv, L]`` long: each slot's token index among its row's real tokens (-1: empty)."""
        return self._group().layout.positions(self.layer_idx)

    def window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The query window in time order: ``[B, Hq, W, D]`` and its ``[B, W]`` validity."""
        return self._group().window(self.layer_idx)

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The policy's state on this layer, by stored name (``Policy.state_fields``): ``[B, Hkv,
        L]`` per slot, in the columns of ``keys``, and ``[B, Hkv]`` per head (copies). Empty for a
        policy that keeps none. With ``window_new``, what ``Policy.select(state=...)`` takes."""
        group = self._group()
        names = group.executor.policy.state_fields
        if not names:
            return {}
        held = group.layout.gather_layer(self.layer_idx)
        return {name: held.fields[name].clone() for name in names}

    @property
    def window_new(self) -> torch.Tensor:
        """``[B, W]`` bool: the window's queries the policy's state has not seen yet."""
        group = self._group()
        _, valid = group.window(self.layer_idx)
        rows = group.rows
        return new_queries(group.executor.policy, valid, rows.seen(), rows.observed)[1]

    @property
    def stats(self) -> EvictionStats:
        group = self.group
        return EvictionStats() if group is None else group.stats(self.layer_idx)

    @property
    def tokens_seen(self) -> int:
        """Padded positions appended (what RoPE positions count)."""
        group = self.group
        if group is None:
            return 0
        return group.tokens_seen if group.written(self.layer_idx) else group.tokens_seen_before


def _check_step(
    keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None, token_valid: torch.Tensor | None
) -> None:
    """Shapes of one step, refused with the shapes named."""
    for label, x in (("keys", keys), ("values", values), ("queries", queries)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.dim() != 4):
            raise ValueError(f"{label} must be a 4-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if keys.dtype not in FLOAT_DTYPES:  # before the first step allocates buffers of it
        raise ValueError(f"keys must be float32, float16, bfloat16 or float64, got {keys.dtype}")
    if keys.is_meta:  # no data: some policies answered placeholders, others failed in torch
        raise ValueError("keys are on the meta device, which holds no data: a cache stores and ranks real tensors")
    b, h, t, d = keys.shape
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"values {tuple(values.shape)} must match keys {tuple(keys.shape)} in [B, Hkv, T]")
    if t < 1:
        raise ValueError(f"a step appends at least one token, got keys {tuple(keys.shape)}")
    if b < 1:
        raise ValueError("a step needs at least one row (every row has finished: reset() the cache to start anew)")
    for label, x in (("values", values), ("queries", queries)):
        if x is not None and (x.dtype != keys.dtype or x.device != keys.device):
            raise ValueError(f"{label} are {x.dtype} on {x.device}, keys {keys.dtype} on {keys.device}: a step's "
                             "keys, values and queries share one dtype and device")
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (keys, values, queries)):
        # The slots are written in place and evictions are not differentiable.
        raise RuntimeError("kvpolicy caches serve inference: run the forward under torch.no_grad() or "
                           "torch.inference_mode() (these keys, values or queries require grad)")
    if queries is not None and (queries.shape[0] != b or queries.shape[2] != t or queries.shape[3] != d
                                or queries.shape[1] % h):
        raise ValueError(f"queries {tuple(queries.shape)} must be [B={b}, Hq (a multiple of {h}), T={t}, D={d}]")
    if token_valid is not None and (tuple(token_valid.shape) != (b, t) or token_valid.dtype != torch.bool):
        raise ValueError(f"token_valid must be [B={b}, T={t}] bool, got {tuple(token_valid.shape)} {token_valid.dtype}")


def _check_writable(group: LayerGroup, action: str) -> None:
    """Refuse, by name, writing outside ``torch.inference_mode()`` into buffers made inside it
    (torch would fail deep inside the write, perhaps with some layers written already)."""
    if group.buffers.keys.is_inference() and not torch.is_inference_mode_enabled():
        raise CacheStateError(
            "this cache's buffers were made under torch.inference_mode(), and tensors made there cannot be "
            f"written outside it: {action} under inference_mode too, or reset() the cache"
        )
