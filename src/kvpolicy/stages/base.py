"""The three kinds of stage and the input they all read.

A stage is a small, frozen pydantic model: its fields are its hyperparameters (validated, with the
published defaults), and it has exactly one abstract method. Stages are pure tensor functions over
``[B, Hkv, N]``: they never loop over rows or heads, never touch a model, and never move cache
memory (the executor does that).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from ..schedule import Schedule

StageKind = Literal["scorer", "reservation", "selector"]


@dataclass(frozen=True)
class EvictionInput:
    """Everything a stage may read for one eviction of one layer (or of a stack of equal layers).

    Shapes use ``B`` batch rows, ``Hkv`` KV heads, ``Hq = G * Hkv`` query heads, ``N`` cached slots,
    ``W`` window queries and ``D`` the head dimension.

    Attributes:
        keys: ``[B, Hkv, N, D]`` cached keys, after RoPE (and after ``k_norm`` on Qwen3).
        values: ``[B, Hkv, N, D]`` cached values.
        queries: ``[B, Hq, W, D]`` the window of most recent post-RoPE queries.
        budget: ``K = min(N, budget)``, the number of slots kept, protected ones included.
        num_candidates: ``C``; slots ``[0, C)`` are eviction candidates, slots ``[C, N)`` are the
            recent buffer, always kept and never scored.
        slot_valid: ``[B, Hkv, N]`` bool, False for padding slots (never kept while a valid one
            is not). Per head, since heads keep different slots after an eviction.
        query_valid: ``[B, W]`` bool, False for window entries that hold no real query yet.
        positions: ``[B, Hkv, N]`` long, the index of each slot's token among its row's real
            tokens (``-1`` for padding). Sinks are the slots at positions ``0 .. n-1``.
        generator: the seeded source of randomness for stochastic stages.
        layer_seed: ``[L]`` long, one fixed seed per stacked layer (``L = B // rows_per_layer``
            layers stacked on the batch axis) for stages that draw once per layer and reuse it.
        rows_per_layer: batch rows belonging to one layer when several layers are stacked.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    budget: int
    num_candidates: int
    slot_valid: torch.Tensor
    query_valid: torch.Tensor
    positions: torch.Tensor
    generator: torch.Generator | None = None
    layer_seed: torch.Tensor | None = None
    rows_per_layer: int | None = None

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


class Stage(BaseModel, ABC):
    """Base of every stage: a frozen pydantic model named by ``type`` in policy files."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: ClassVar[StageKind]
    type_name: ClassVar[str]
    #: True when the stage consumes ``generator`` (the executor then seeds one).
    stochastic: ClassVar[bool] = False

    def describe(self) -> dict[str, Any]:
        """The stage as it appears in a resolved policy file."""
        data: dict[str, Any] = {"type": self.type_name}
        for name in type(self).model_fields:
            value = getattr(self, name)
            data[name] = value.describe() if isinstance(value, Stage) else _plain(value)
        return data

    def validate_schedule(self, schedule: Schedule) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` if the stage cannot run under this schedule (checked at load)."""


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [v.describe() if isinstance(v, Stage) else _plain(v) for v in value]
    if isinstance(value, BaseModel):
        return {k: _plain(v) for k, v in value.model_dump().items()}
    return value


class Scorer(Stage):
    """Scores every slot: higher means more worth keeping."""

    kind: ClassVar[StageKind] = "scorer"

    @abstractmethod
    def score(self, inp: EvictionInput) -> torch.Tensor:
        """Return ``[B, Hkv, N]`` float32 scores.

        Only the entries of valid candidate slots (``inp.candidate_mask``) are read by later
        stages; a scorer may put anything finite elsewhere.
        """

    @property
    def may_be_negative(self) -> bool:
        """Whether scores can be negative (a sampling selector needs non-negative weights)."""
        return False


class Reservation(Stage):
    """Protects slots before the selector runs; protected slots are always kept."""

    kind: ClassVar[StageKind] = "reservation"

    @abstractmethod
    def reserve(self, inp: EvictionInput, protected: torch.Tensor) -> torch.Tensor:
        """Return the ``[B, Hkv, N]`` bool mask of slots this stage protects.

        ``protected`` is what earlier stages (and the recent buffer) already protect; the result
        is OR-ed into it by the executor.
        """

    def reserved_count(self, budget: int) -> int:
        """Upper bound of candidate slots protected at ``budget``, checked against it at load."""
        return 0


class Selector(Stage):
    """Ranks the unprotected candidates; the executor keeps the top of the ranking."""

    kind: ClassVar[StageKind] = "selector"
    #: False for selectors that keep protected slots only and never read a score.
    needs_scores: ClassVar[bool] = True

    @abstractmethod
    def priority(self, scores: torch.Tensor | None, inp: EvictionInput) -> torch.Tensor:
        """Return ``[B, Hkv, N]`` float32 keys: the executor keeps protected slots, then the
        unprotected valid candidates with the largest keys until ``inp.budget`` slots are kept.
        """
