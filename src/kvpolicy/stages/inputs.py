"""``EvictionInput``: everything a stage may read for one eviction (or one choice), with its
shapes, seeded streams and state."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from .. import seeds
from .errors import SelectionError
from .model_facts import Fact, ModelFacts


class AskingStage(Protocol):
    """What an input reads off the stage that asks it (a ``kvpolicy.stages.stage.Stage``, which
    imports this module: the input names it structurally, so the two do not import each other)."""

    @property
    def kind(self) -> str: ...
    @property
    def type_name(self) -> str: ...
    @property
    def needs_model(self) -> frozenset[Fact]: ...
    @property
    def state_key(self) -> str: ...

#: Attributes of ``EvictionInput`` that plugin contract 1 (kvpolicy 0.1) had, and what replaced
#: them: reading one raises an ``AttributeError`` that says so, not a bare "no attribute".
REMOVED_INPUT_ATTRIBUTES = {
    "generator": "draw through the input's counter-based streams instead: inp.uniform(*shape, stream=NAME) "
    "and inp.normal(...) per row, inp.head_uniform(*shape, stream=NAME) and inp.head_normal(...) per KV head",
    "rows_per_layer": "rows of one call may come from different layers, and each row carries its own seeds: "
    "inp.layer_seed and inp.row_seed are [B]",
}


def window_positions(query_valid: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, W]`` long: the token index of each valid window entry (``query_valid [B, W]``, in
    time order) of rows that have seen ``tokens [B]`` real tokens, the last of which is the newest
    entry; ``-1`` for invalid entries. A window holds a row's latest real queries, so the entry
    with ``j`` valid ones after it is token ``tokens - 1 - j``."""
    later = query_valid.flip(-1).long().cumsum(-1).flip(-1)  # valid entries at or after each one
    return torch.where(query_valid, tokens.to(query_valid.device)[:, None] - later, -1)


@dataclass(frozen=True)
class EvictionInput:
    """Everything a stage may read for one eviction of one layer (or of a stack of equal layers).

    Shapes use ``B`` batch rows, ``Hkv`` KV heads, ``Hq = G * Hkv`` query heads, ``N`` cached slots,
    ``W`` window queries and ``D`` the head dimension.

    Attributes:
        keys: ``[B, Hkv, N, D]`` cached keys, after RoPE (and after ``k_norm`` on Qwen3).
        values: ``[B, Hkv, N, D]`` cached values; on the ``meta`` device (their shape only) where
            no stage of the policy reads them (``Stage.reads_values``) and the engine skipped them.
        queries: ``[B, Hq, W, D]`` the window of most recent post-RoPE queries.
        budget: ``K = min(N, budget)``, the number of slots kept, protected ones included.
        num_candidates: ``C``; slots ``[0, C)`` are eviction candidates, slots ``[C, N)`` are the
            recent buffer, always kept and never scored.
        slot_valid: ``[B, Hkv, N]`` bool, False for padding slots (never kept while a valid one
            is not). Per head, since heads keep different slots after an eviction.
        query_valid: ``[B, W]`` bool, False for window entries that hold no real query yet.
        positions: ``[B, Hkv, N]`` long, the index of each slot's token among its row's real
            tokens (``-1`` for padding). Sinks are the slots at positions ``0 .. n-1``. Positions
            keep growing past ``N`` as tokens are evicted.
        seed_key: how the rows' random streams are keyed (``kvpolicy.seeds.SeedKey``; None: all 0).
            Stages read the seeds it derives, on first use:
        layer_seed: ``[B]`` int64, the fixed seed of each row's layer (the same at every
            eviction of that layer): for stages that draw once per layer and reuse it.
        row_seed: ``[B]`` int64, the seed of each row's current eviction: for stages that draw
            afresh at every eviction. Draw through ``uniform``/``normal`` below, never from a
            global generator: a row's draws then depend on that row alone (see ``kvpolicy.seeds``).
        head_offset: the model's index of the first KV head in ``keys`` (0 unless the heads are
            sharded: a tensor-parallel rank holds heads ``head_offset .. head_offset + Hkv - 1``).
            Per-head draws (``head_uniform``/``head_normal``) are keyed by the model's head, so a
            sharded run draws exactly what an unsharded one does.
        query_positions: ``[B, W]`` long, the token index of each window query among its row's
            real tokens (``-1`` where ``query_valid`` is False). Query ``w`` sees the slots whose
            position is at most ``query_positions[:, w]`` (causal attention). Always a tensor
            (plugin contract 4): an input built without it (None) gets, in ``__post_init__``,
            the window's valid entries as the row's latest real tokens, the newest at the
            row's largest slot position (``window_positions``), as ``eviction_input`` does.
        query_new: ``[B, W]`` bool, the window queries no stage's state has seen yet (those since
            the state was last brought up to date): what ``Stage.update_state`` adds. Always a
            tensor (plugin contract 4): built without it (None), every ``query_valid`` entry.
        state: every stateful stage's fields (``Stage.state_fields``), read with
            ``inp.state_of(stage)``. None when the policy keeps no state.
        model: facts about the model the cache serves (``ModelFacts``: its shape, the RoPE of
            any position, a layer's output projection), for stages that declare them in
            ``Stage.needs_model``; None where unknown (a policy needing them is then refused
            before any work). ``positions`` and ``query_positions`` are the RoPE positions when
            the model numbers its tokens among each row's real ones (what ``generate()`` does).
        prompt_lengths: ``[B]`` long on the keys' device, each row's prompt tokens (real ones):
            the slots whose ``positions`` are below it hold the prompt. A cache's prompt is its
            first step, vLLM's each request's own; ``Policy.select`` takes it as
            ``prompt_lengths=``. None where not given: read it through ``prompt_mask``, which
            refuses then, and declare ``Stage.needs_prompt`` so the policy is refused first.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    budget: int
    num_candidates: int
    slot_valid: torch.Tensor
    query_valid: torch.Tensor
    positions: torch.Tensor
    #: What keys the rows' random streams (None, as when a test builds an input by hand: all 0).
    seed_key: seeds.SeedKey | None = None
    #: ``{P: (min, max)}``, each ``[B, Hkv, ceil(N / P), D]``: the per-channel minimum and maximum
    #: of the keys of each page of ``P`` slots from slot 0, maintained by a cache that keeps every
    #: token (select mode) for the page sizes its stages ask for (``Stage.key_page_sizes``). A
    #: page's summary may cover slots past ``N`` that the cache holds; stages use only the pages
    #: that lie within the candidates and compute the rest from ``keys``. None: not maintained.
    key_pages: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    head_offset: int = 0
    # Never None once built: None (the default, so that inputs built without them still build)
    # asks __post_init__ for the documented default. Typed as the tensors stages read.
    query_positions: torch.Tensor = None  # type: ignore[assignment]
    query_new: torch.Tensor = None  # type: ignore[assignment]
    state: Mapping[str, Mapping[str, torch.Tensor]] | None = None
    model: ModelFacts | None = None
    prompt_lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Frozen: fill the defaults the class docstring gives in place, once.
        if self.query_positions is None:
            b, n = self.positions.shape[0], self.positions.shape[-1]
            if n:
                # One index of each broadcast (stride 0) axis past the batch: select mode's
                # positions are an expanded arange, and flattening them would copy Hkv * N.
                pos = self.positions
                axes = [slice(0, 1) if pos.stride(a) == 0 else slice(None) for a in range(1, pos.dim())]
                pos = pos[tuple([slice(None), *axes])]
                newest = pos.flatten(1).amax(-1)
            else:
                newest = torch.full((b,), -1, dtype=torch.long, device=self.positions.device)
            object.__setattr__(self, "query_positions", window_positions(self.query_valid, newest + 1))
        if self.query_new is None:
            object.__setattr__(self, "query_new", self.query_valid)

    def state_of(self, stage: AskingStage) -> Mapping[str, torch.Tensor]:
        """``stage``'s state fields by name: ``[B, Hkv, N]`` per slot, ``[B, Hkv]`` per head (see
        ``StateField``). In ``Stage.update_state`` they hold the state before this eviction's
        new queries; in every other stage method, after them (the executor brings the state up
        to date before any stage scores)."""
        fields = None if self.state is None else self.state.get(stage.state_key)
        if fields is None:
            raise KeyError(
                f"{stage.kind} {stage.type_name!r} reads state this input does not carry: a stage with "
                "state_fields runs only where kvpolicy keeps its state (a cache, select mode, vLLM), or through "
                "Policy.select(..., state=...)"
            )
        return fields

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: explain the attributes contract 2 removed.
        hint = REMOVED_INPUT_ATTRIBUTES.get(name)
        if hint is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)
        raise AttributeError(
            f"EvictionInput.{name} was removed in kvpolicy 0.2 (plugin contract 2): {hint}. See the stage "
            "contract in docs/plugins.md and CHANGELOG.md",
            name=name, obj=self,
        )

    @property
    def layer_seed(self) -> torch.Tensor:
        """``[B]`` int64 on the keys' device (see the class docstring)."""
        return self._seed_key().layer.to(self.keys.device)

    @property
    def row_seed(self) -> torch.Tensor:
        """``[B]`` int64 on the keys' device (see the class docstring)."""
        return self._seed_key().row.to(self.keys.device)

    def _seed_key(self) -> seeds.SeedKey:
        if self.seed_key is None:
            object.__setattr__(self, "seed_key", seeds.SeedKey.zeros(self.keys.shape[0]))
        return self.seed_key  # type: ignore[return-value]

    def uniform(self, *shape: int, stream: str) -> torch.Tensor:
        """``[B, *shape]`` float32 in ``(0, 1)`` from each row's eviction seed, on the keys' device.

        ``stream`` names the draw (use the stage's ``type_name``), so two stages never share one.
        """
        return seeds.uniform(self.row_seed, shape, stream, self.keys.device)

    def normal(self, *shape: int, stream: str, per: Literal["eviction", "layer"] = "eviction") -> torch.Tensor:
        """``[B, *shape]`` float32 standard normal draws from each row's eviction seed, or from its
        layer seed (``per="layer"``: the same numbers at every eviction of the layer)."""
        seed = self.row_seed if per == "eviction" else self.layer_seed
        return seeds.normal(seed, shape, stream, self.keys.device)

    def head_uniform(self, *shape: int, stream: str) -> torch.Tensor:
        """``[B, Hkv, *shape]`` float32 in ``(0, 1)``: draws of their own for each KV head.

        Use it, not ``uniform(num_kv_heads, ...)``, for anything drawn per head: head ``h`` draws
        as the model's head ``head_offset + h``, so a tensor-parallel rank draws its heads' share
        of the unsharded draw (with ``head_offset`` 0 the two calls give the same numbers).
        """
        rest = math.prod(shape)
        full = (self.num_kv_heads, *shape)
        return seeds.uniform(self.row_seed, full, stream, self.keys.device, start=self.head_offset * rest)

    def head_normal(self, *shape: int, stream: str, per: Literal["eviction", "layer"] = "eviction") -> torch.Tensor:
        """``[B, Hkv, *shape]`` float32 standard normal draws per KV head (see ``head_uniform``)."""
        seed = self.row_seed if per == "eviction" else self.layer_seed
        rest = math.prod(shape)
        full = (self.num_kv_heads, *shape)
        return seeds.normal(seed, full, stream, self.keys.device, start=self.head_offset * rest)

    def prompt_mask(self, stage: AskingStage) -> torch.Tensor:
        """``[B, Hkv, N]`` bool: the valid slots holding a prompt token of their row (position
        below the row's ``prompt_lengths``), for ``stage`` (which declares ``needs_prompt``); a
        clear error where the input carries no prompt lengths."""
        if self.prompt_lengths is None:
            raise KeyError(
                f"{stage.kind} {stage.type_name!r} reads each row's prompt length, which this input does not "
                "carry: pass prompt_lengths= to Policy.select (caches and vLLM give it)"
            )
        lengths = self.prompt_lengths.to(self.positions.device)
        return self.slot_valid & (self.positions >= 0) & (self.positions < lengths[:, None, None])

    @property
    def layer_index(self) -> torch.Tensor:
        """``[B]`` long on the host: the model layer of each (stacked) row."""
        return self._seed_key().layer_idx

    def facts(self, stage: AskingStage) -> ModelFacts:
        """The model facts, for ``stage`` (which declares them in ``needs_model``); a clear error
        where the input carries none (``Policy.check_model_facts`` refuses such a policy before
        any work, so only a hand-built input reaches it)."""
        if self.model is None:
            raise KeyError(
                f"{stage.kind} {stage.type_name!r} reads model facts ({', '.join(sorted(stage.needs_model))}) this "
                "input does not carry: pass model_facts= to EvictingCache, model= to Policy.select, or build "
                "KVPolicyCache with the model"
            )
        return self.model

    def rows_by_layer(self) -> list[tuple[int, torch.Tensor]]:
        """``(layer, rows)`` for each model layer among the stacked rows (``rows``: a long tensor
        of row indices on the keys' device): for stages that read a per-layer fact."""
        layers = self.layer_index
        return [
            (int(layer), (layers == layer).nonzero().flatten().to(self.keys.device))
            for layer in torch.unique(layers).tolist()
        ]

    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def num_slots(self) -> int:
        return self.keys.shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    @property
    def group_size(self) -> int:
        return self.queries.shape[1] // self.keys.shape[1]

    @property
    def candidate_mask(self) -> torch.Tensor:
        """``[B, Hkv, N]`` bool: valid slots that are eviction candidates."""
        idx = torch.arange(self.num_slots, device=self.keys.device)
        return self.slot_valid & (idx < self.num_candidates)

    def require_same_tokens_in_every_head(self, stage: AskingStage) -> None:
        """Raise a ``SelectionError`` naming ``stage`` unless every KV head of each row holds the same
        tokens in the same slots (the same validity and positions): what a stage that combines the
        heads slot by slot needs, since slot ``j`` of two heads is otherwise two different tokens."""
        if self.num_kv_heads < 2:
            return
        valid = self.slot_valid
        pos = self.positions.masked_fill(~valid, -1)
        if bool((valid == valid[:, :1]).all()) and bool((pos == pos[:, :1]).all()):
            return
        raise SelectionError(
            f"{stage.kind} {stage.type_name!r} combines the KV heads slot by slot, so every KV head of a row must "
            "hold the same tokens, but here they differ: a per-head allocation, or a stage that chose per head at "
            "an earlier eviction (a Range reservation, sampling), made them differ"
        )
