"""The five kinds of stage: scorer, reservation, selector, allocation and merge, each with exactly
one abstract method and its shapes documented.

A stage is a small, frozen pydantic model: its fields are its hyperparameters (validated, with the
published defaults). Stages are pure tensor functions over ``[B, Hkv, N]``: they never loop over
rows or heads, never touch a model, and never move cache memory (the executor does that).

What every kind shares lives beside them, one job a module: ``stage`` (``Stage``, the list of
kinds), ``inputs`` (``EvictionInput``, what a stage reads), ``state`` (``StateField``, what it
keeps across evictions) and ``data_file`` (``DataFile``). Each is re-exported here, the one import
path plugins use (``from kvpolicy.stages.base import Scorer, EvictionInput``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from ..documents import PolicyError
from .data_file import DataFile
from .inputs import REMOVED_INPUT_ATTRIBUTES, EvictionInput, window_positions
from .stage import STAGE_KINDS, Stage, StageKind, declared_for, state_field_names
from .state import POSITION_DTYPES, StateField

if TYPE_CHECKING:
    from ..schedule import Schedule
    from .recall import RecallInput

__all__ = [
    "POSITION_DTYPES", "REMOVED_INPUT_ATTRIBUTES", "STAGE_BASES", "STAGE_KINDS", "Allocation", "DataFile",
    "EvictionInput", "Merge", "MergeResult", "Reservation", "Scorer", "Selector", "Stage", "StageKind",
    "StateField", "declared_for", "state_field_names", "window_positions",
]


class Scorer(Stage):
    """Scores every slot: higher means more worth keeping."""

    kind: ClassVar[StageKind] = "scorer"

    @abstractmethod
    def score(self, inp: EvictionInput) -> torch.Tensor:
        """Return ``[B, Hkv, N]`` float32 scores.

        Only the entries of valid candidate slots (``inp.candidate_mask``) are read by later
        stages; a scorer may put anything finite elsewhere. Checked at every call
        (``kvpolicy.stages.guards.run_scorer``): a result of another shape (``[B, N]`` is never
        broadcast), not floating or on another device, or NaN/inf on a valid candidate, is a
        ``SelectionError`` naming the scorer. The inputs are finite when a policy calls it, so
        compute in float32 (not float16, which overflows near 65504) and mind float32's range.
        """

    @property
    def may_be_negative(self) -> bool:
        """Whether scores can be negative (a sampling selector needs non-negative weights)."""
        return False

    @property
    def heads_alike(self) -> bool:
        """``Stage.heads_alike``: False unless the scorer gives every KV head of a row the same scores."""
        return False

    def score_packed(self, inp: EvictionInput) -> torch.Tensor | None:
        """``score(inp)`` on select mode's packed rows, computed faster, or None (the default)
        to decline: a scorer that defines it declares that select mode may choose directly
        (``kvpolicy.selection.choose_directly``).

        Return ``[B, Hkv, N]`` float32 scores equal to ``score(inp)``'s on every candidate slot
        ``[0, C)`` (entries past ``C`` are not read), or None for an input it cannot score
        faster. Called only under a selector whose priority is the score
        (``Selector.priority_is_score``: greedy) and no reservation, on a cache's packed rows:
        every slot is valid (``slot_valid`` all True, ``positions`` ``0 .. N-1``, every head
        holding the same tokens) and every key, value and query was checked finite as it
        entered the cache, so masks, padding and those checks can be skipped. The state of a
        stateful scorer is up to date, as for ``score``.

        kvpolicy ranks these scores with the very call ``Policy.select`` ranks its priorities
        with (``kvpolicy.policy.keep_top``), ``+inf`` on the recent buffer: equal scores keep
        the slots the full pipeline keeps, ties included. Checked at every call
        (``kvpolicy.stages.guards.run_packed_scorer``) as ``score`` is: another shape, dtype or
        device, or NaN/inf on a candidate, is a ``SelectionError`` naming the scorer.

        Define it on the class that defines ``score``: a subclass that overrides ``score``
        without overriding ``score_packed`` is not asked (its promise was made for another
        score).
        """
        return None

    #: What ``score_packed`` reads of the slots when the rows come with page summaries of every
    #: size the scorer names (``EvictionInput.key_pages``): ``"slots"`` (any key or value, the
    #: default) or ``"short_page"`` (the keys of the candidates' last, short page
    #: ``[(C // P) * P, C)`` only, and no value: Quest). An engine whose slots live elsewhere
    #: (vLLM's blocks) gathers only what is read and hands NaN for the rest, which the checked
    #: scores would show. Declare it on the class that defines ``score_packed``.
    packed_reads: ClassVar[Literal["slots", "short_page"]] = "slots"

    @property
    def choice_page_size(self) -> int | None:
        """``P`` when the scorer declares a *page choice* in select mode, else None (the default).

        A scorer that declares one is ranked by whole pages of ``P`` slots from slot 0, never by
        slot: at each choice select mode takes the ``k`` best whole candidate pages by
        ``score_pages`` and attends them together with the tail ``[(C // P) * P, N)`` (the
        candidates' last, short page and the recent buffer), where ``k`` is what fits the budget
        after the tail (``kvpolicy.selection.page_plan``). Such a policy is select mode only,
        with a selector whose priority is the score, no reservation and no per-head allocation
        (refused at load otherwise, naming the field), and ``Policy.select`` refuses it (it
        ranks slots; ``kvpolicy.selection.choose_pages`` is the page choice)."""
        return None

    def score_pages(self, inp: EvictionInput) -> torch.Tensor:
        """``[B, Hkv, C // P]`` float32: the score of each whole candidate page (``P`` =
        ``choice_page_size``), for select mode's page choice; higher is more worth attending.

        Called on a cache's packed rows only (as ``score_packed``: every slot valid, every key,
        value and query checked finite as it entered the cache). Checked at every call
        (``kvpolicy.stages.guards.run_page_scorer``): another shape, dtype or device, or NaN/inf,
        is a ``SelectionError`` naming the scorer."""
        raise NotImplementedError(f"scorer {self.type_name!r} declares choice_page_size but no score_pages")

    #: The page summaries (``kvpolicy.stages.recall.SUMMARIES``) this scorer reads when it ranks a
    #: slow tier's pages as a recall scorer (``PolicyConfig.recall``); empty, the default: it
    #: cannot serve as one (refused at load, naming ``recall.scorer``).
    recall_summaries: ClassVar[frozenset[str]] = frozenset()

    def score_summaries(self, inp: RecallInput) -> torch.Tensor:
        """``[B, Hkv, Np]`` float32: each slow-tier page's score from its summaries alone
        (``inp.summaries``, the kinds ``recall_summaries`` declares); higher is recalled first.
        Entries of empty page slots (``inp.page_valid`` False) are never read. Checked at every
        call (``kvpolicy.stages.guards.run_recall_scorer``): another shape, dtype or device, or
        NaN/inf on a page, is a ``SelectionError`` naming the scorer."""
        raise NotImplementedError(f"scorer {self.type_name!r} declares recall_summaries but no score_summaries")


class Reservation(Stage):
    """Protects slots before the selector runs; protected slots are always kept.

    Keeping them all is only possible while they fit in the budget, so the number of protected
    slots is checked twice (a violation is a ``SelectionError`` naming the stage):

    - at load, where the count is knowable: ``recent + sum(reserved_beside(budget, recent)) <=
      budget`` over the policy's reservations (``reserved_count``, less what the recent buffer
      covers for a stage that counts it);
    - at every eviction (``kvpolicy.stages.guards.run_reservation``): the protected slots of each row
      and head, recent buffer and earlier reservations included, must not exceed the budget,
      and a stage that overrides ``reserved_count`` must not add more candidate slots than it
      declares.

    A stage whose count depends on the sequence (every 16th position, say) grows with it and
    fails at run time once the budget is exceeded: bound it (protect at most ``n`` slots) and
    declare the bound.
    """

    kind: ClassVar[StageKind] = "reservation"

    @abstractmethod
    def reserve(self, inp: EvictionInput, protected: torch.Tensor) -> torch.Tensor:
        """Return the ``[B, Hkv, N]`` bool mask of slots this stage protects.

        ``protected`` is what earlier stages (and the recent buffer) already protect; the result
        is OR-ed into it by the executor. Another shape or dtype than ``[B, Hkv, N]`` bool is an
        error naming the stage.
        """

    def reserved_count(self, budget: int) -> int:
        """Upper bound, at ``budget``, of the candidate slots (slots ``[0, C)``) this stage adds to
        the protected ones in any row and head: ``load_policy`` checks ``recent + sum of the
        bounds <= budget``, and every eviction checks that the stage keeps to its bound.

        Override it whenever the bound is known (``sinks``: ``n``; ``top_scores``: its ``n``).
        The default declares nothing: it counts as 0 at load, and the stage is then only
        checked at run time against the budget itself (``kvpolicy.stages.guards.declared_count`` is
        None for it).
        """
        return 0

    def reserved_beside(self, budget: int, recent: int) -> int:
        """What the load checks count for this stage beside a full recent buffer of ``recent``
        slots: ``reserved_count(budget)``, less what that buffer already covers for a stage whose
        count includes it (``top_scores`` with ``count_recent``: CriticalKV's first half counts
        the window). Override it only for such a stage."""
        return self.reserved_count(budget)

    def prompt_refusal(self, prompt_len: int, room: int) -> str | None:
        """Why a request whose prompt has ``prompt_len`` tokens cannot be served, where ``room``
        slots of the budget are left beside the recent buffer and the other reservations'
        declared counts (None, the default: it can). An engine that admits requests asks it up
        front (``Policy.prompt_refusal``) instead of failing at an eviction."""
        return None


class Selector(Stage):
    """Ranks the unprotected candidates; the executor keeps the top of the ranking."""

    kind: ClassVar[StageKind] = "selector"
    #: False for selectors that keep protected slots only and never read a score.
    needs_scores: ClassVar[bool] = True
    #: True when ``priority`` returns the scores themselves, unchanged, on every eligible slot
    #: (greedy): the policy then keeps the top-scoring candidates, and select mode may choose
    #: them directly from a scorer's ``Scorer.score_packed``. Set it on the class that
    #: defines ``priority``: a subclass that overrides ``priority`` without setting it again is
    #: not taken at its word.
    priority_is_score: ClassVar[bool] = False

    @abstractmethod
    def priority(self, scores: torch.Tensor | None, inp: EvictionInput) -> torch.Tensor:
        """Return ``[B, Hkv, N]`` float32 keys: the executor keeps protected slots, then the
        unprotected valid candidates with the largest keys until ``inp.budget`` slots are kept.
        """

    #: True when the selector decides how many slots each head keeps (``head_counts``: a score
    #: threshold), instead of every head keeping ``inp.budget``. The policy then runs per head,
    #: as under a per-head allocation (``Policy.per_head``): each head keeps its count of the
    #: highest priorities, at most the budget (the pool each head's slots are sized by), and the
    #: per-head layout holds the uneven counts. It cannot be combined with a per-head allocation.
    sets_counts: ClassVar[bool] = False

    def head_counts(self, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput) -> torch.Tensor:
        """``[B, Hkv]`` long: slots each head keeps (``sets_counts`` selectors only), its protected
        ones included, from the policy's ``priority [B, Hkv, N]`` (``+inf`` protected, ``-inf`` not
        eligible, the clamped priorities elsewhere). Each count must lie between the head's
        protected slots and ``min(inp.budget, its valid slots)`` (checked by
        ``kvpolicy.stages.guards.run_selector_counts``); the counts need not add up to anything."""
        raise NotImplementedError(f"selector {self.type_name!r} does not set per-head counts")

    def check_pool(self, budget: int, protected: int) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` naming the field when a ``sets_counts`` selector cannot keep its
        promises with ``budget`` slots per head of which ``protected`` (recent buffer and
        declared reservations) are always kept. Called at load, before any work."""


class Allocation(Stage):
    """Shares a policy's total budget (``layers x KV heads x budget`` slots) among layers and heads.

    Two questions, asked at two times:

    - ``layer_budgets`` once, when a cache learns the model's shape: each layer's budget, the
      mean number of slots its heads keep after an eviction (it sizes that layer's buffers and
      drives its schedule). They must add up to ``num_layers * budget``.
    - ``head_counts`` at every eviction, only for stages with ``per_head = True``: how many of
      the layer's ``Hkv * budget`` slots each KV head keeps. The executor then keeps, per head,
      that many slots of the highest priority (protected slots first).

    The default shares evenly (the ``uniform`` stage): every layer and head keeps ``budget``.
    """

    kind: ClassVar[StageKind] = "allocation"
    #: True when heads of one layer keep different numbers of slots (``head_counts`` is called).
    per_head: ClassVar[bool] = False
    #: True when the layer budgets are decided from the prompt (``prompt_budgets``), once every
    #: layer holds it, before the first eviction (CAKE); ``layer_budgets`` then gives the
    #: provisional ones, and each layer gets buffers of its own. Evict mode only.
    from_prompt: ClassVar[bool] = False
    #: False for a ``per_head`` stage that shares each layer's own ``budget`` among its heads,
    #: every layer keeping the same (Ada-KV); True when ``layer_budgets`` may differ by layer
    #: (a paged engine then gives every layer blocks of its own: vLLM's KV-cache group per layer).
    layer_budgets_differ: ClassVar[bool] = True

    @property
    def uneven(self) -> bool:
        """Whether layers or heads may hold different budgets (vLLM cannot free such memory)."""
        return True

    def layer_budgets(self, budget: int, num_layers: int, recent: int) -> list[int]:
        """Each layer's budget (mean slots per head), ``num_layers`` ints adding up to
        ``num_layers * budget`` (``recent``: the schedule's recent buffer, which every layer
        keeps). Raise ``ValueError`` naming the field for an impossible share."""
        return [budget] * num_layers

    def prompt_budgets(self, budget: int, recent: int, inputs: Sequence[EvictionInput]) -> list[int]:
        """``from_prompt`` allocations: each layer's budget from what it holds before its first
        eviction (``inputs[l]``: layer ``l``'s slots and window, every row), ints above ``recent``
        adding up to ``len(inputs) * budget``."""
        raise NotImplementedError(f"allocation {self.type_name!r} does not decide its budgets from the prompt")

    def check_model(self, num_layers: int, num_kv_heads: int) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` if the stage cannot serve a model of this shape (a profile for
        another model, a per-layer list of the wrong length). Called before any work."""

    def head_counts(self, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput) -> torch.Tensor:
        """``[B, Hkv]`` long: slots each head keeps (``per_head`` stages only).

        ``priority [B, Hkv, N]`` float32 ranks slots within a head (``+inf``: protected,
        ``-inf``: not eligible, padding included); ``protected [B, Hkv, N]`` bool. Each row's
        counts must add up to ``Hkv * inp.budget``, and each head's count must lie between its
        protected slots and its valid ones (``kvpolicy.stages.guards.run_allocation`` checks it).
        """
        raise NotImplementedError(f"allocation {self.type_name!r} does not share slots per head")

    def head_budgets(self, layer: int, layer_budget: int, recent: int) -> list[int] | None:
        """``per_head`` stages whose shares the model's shape alone fixes (a head profile): the
        slots each KV head of ``layer`` keeps when the layer keeps ``Hkv * layer_budget``
        (``recent``: the schedule's recent buffer). None: heads share by the data (Ada-KV).
        ``layer_schedules`` refuses a share below its head's protected slots."""
        return None

    def head_cap(self, budget: int, num_kv_heads: int) -> int | None:
        """``per_head`` stages: the most slots one KV head of a layer can keep at an eviction,
        whatever the data, with ``budget`` per head on average (a paged engine reserves this much
        room per request: vLLM). None: no such bound is known (vLLM then refuses the policy)."""
        return None

    def layer_head_cap(self, layer: int, layer_budget: int, num_kv_heads: int, recent: int) -> int | None:
        """``head_cap`` for layer ``layer``, which keeps ``layer_budget`` per head on average
        (``recent``: the schedule's recent buffer), where the bound differs by layer (a head
        profile's retrieval heads). The default: ``head_cap``, the same rule in every layer."""
        return self.head_cap(layer_budget, num_kv_heads)



    def layer_schedules(
        self, schedule: Schedule, reservations: Sequence[Any], num_layers: int, num_kv_heads: int | None,
        policy_name: str,
    ) -> list[Schedule]:
        """``Policy.layer_schedules``: each layer's schedule (its ``budget`` the layer's) for a
        policy of ``schedule`` and ``reservations`` under this allocation, or a ``PolicyError``
        naming the ``allocation`` field when it cannot serve this model or leaves a layer no
        candidate after its protected slots."""
        try:
            self.check_model(num_layers, num_kv_heads if num_kv_heads is not None else 0)
            budgets = self.layer_budgets(schedule.budget, num_layers, schedule.recent)
        except ValueError as exc:
            raise PolicyError([f"allocation: {exc}"], policy_name) from None
        if len(budgets) != num_layers or sum(budgets) != num_layers * schedule.budget:
            raise PolicyError(
                [f"allocation {self.type_name!r} gave {len(budgets)} layer budgets adding up to {sum(budgets)}; "
                 f"{num_layers} adding up to {num_layers * schedule.budget} were due"],
                policy_name,
            )
        schedules: dict[int, Schedule] = {}
        for layer, budget in enumerate(budgets):
            if budget in schedules:
                continue
            protected = schedule.recent + sum(r.reserved_beside(budget, schedule.recent) for r in reservations)
            if budget <= schedule.recent or protected > budget:
                raise PolicyError(
                    [f"allocation: layer {layer} gets a budget of {budget} slots, which leaves no candidate "
                     f"after its {protected} protected slots (recent {schedule.recent} and reservations): "
                     "raise the budget or flatten the allocation"],
                    policy_name,
                )
            schedules[budget] = schedule.model_copy(update={"budget": budget})
        for layer, budget in enumerate(budgets):
            for head, share in enumerate(self.head_budgets(layer, budget, schedule.recent) or []):
                protected = schedule.recent + sum(r.reserved_beside(share, schedule.recent) for r in reservations)
                if share < protected:  # kept anyway, the layer's total would not hold
                    raise PolicyError(
                        [f"allocation: layer {layer}, KV head {head} gets a share of {share} slots, fewer than its "
                         f"{protected} protected slots (recent {schedule.recent} and reservations): raise the "
                         "allocation's floor or the budget, or lower recent"],
                        policy_name,
                    )
        return [schedules[b] for b in budgets]


@dataclass(frozen=True)
class MergeResult:
    """What a merge stage returns (``Merge.merge``).

    ``values [B, Hkv, N, Dv]``: the new value of every slot, in any floating dtype; only the kept
    slots' entries are read (kvpolicy casts them to the cache's dtype and writes them in place of
    the kept slots' values). ``state``: the stage's own state fields after the merge, by field
    name, as ``update_state`` returns them (empty for a stateless merge)."""

    values: torch.Tensor
    state: Mapping[str, torch.Tensor]


class Merge(Stage):
    """What becomes of the slots an eviction drops: folded into the values of kept slots.

    It runs once per eviction, after the kept set is chosen, on the same ``EvictionInput`` (state
    brought up to date). It never changes which slots are kept or how many (memory is unchanged),
    and it never changes a key: keys carry their position's RoPE rotation, and a mixture of keys
    rotated for different positions is no key of any position. The default, ``drop``, merges
    nothing and leaves every policy as it was without merging.

    A merge keeps its own state in ``state_fields`` (per-slot weights, moved with their slots)
    and returns it in ``MergeResult.state``. A merge that reads a scorer's state (``cam`` reads
    accumulated attention) nests that scorer as a stage-valued field (``ScorerSpec``) and reads
    ``inp.state_of(nested)``: the policy keeps every nested stage's state, and equal stages share
    one (``Stage.state_key``), so where the policy's scorer equals the nested one the merge reads
    the scorer's state and it is accumulated once.
    """

    kind: ClassVar[StageKind] = "merge"
    #: False for ``drop``: the eviction core then skips the stage (no values are written).
    merges: ClassVar[bool] = True

    @abstractmethod
    def merge(self, inp: EvictionInput, keep: torch.Tensor) -> MergeResult:
        """The merged values of the kept slots, ``keep [B, Hkv, N]`` bool (the eviction's kept set,
        every head's own). Slots ``keep`` leaves out (valid ones: ``inp.slot_valid``) are what the
        eviction drops; padding slots are neither kept nor merged. Checked at every call
        (``kvpolicy.stages.guards.run_merge``): another shape, a non-floating dtype, another device,
        or NaN/inf on a kept slot is a ``SelectionError`` naming the stage."""


#: The base class of each kind of stage, in ``STAGE_KINDS`` order.
STAGE_BASES: dict[StageKind, type[Stage]] = {
    base.kind: base for base in (Scorer, Reservation, Selector, Allocation, Merge)
}
