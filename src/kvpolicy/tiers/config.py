"""A two-tier policy's ``recall`` block: the slow tier's pages, and how they come back."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..documents import refuse_lax_scalar
from ..schedule import Schedule
from ..stages.base import Allocation, Merge, Selector
from ..stages.quest import QuestScorer
from ..stages.recall import SUMMARIES
from ..stages.spec import ScorerSpec


class RecallConfig(BaseModel):
    """What eviction drops goes, in pages, to a slow tier, and the best pages come back.

    Written beside an evicting policy's stages::

        recall: {budget: 64, page_size: 16, interval: 1, scorer: {type: quest}}

    Eviction still decides what leaves the fast tier. Each eviction's evicted tokens go, per KV
    head, in pages of ``page_size`` (in position order; an eviction's last page may be short) to
    the slow tier, and each page leaves its summaries in the fast tier: what the ``scorer``
    declares it reads (``Scorer.recall_summaries``: key bounds for ``quest``, the mean key for
    ``landmark``) and any ``summaries`` named besides. Every ``interval`` decode
    tokens the scorer ranks the slow tier's pages against the step's query from the summaries
    alone, and the best ``budget // page_size`` pages (greedy) are brought into the recall
    buffer; attention reads the kept slots and the recall buffer.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_lax_scalar(cls, info.field_name, value)

    budget: Annotated[int, Field(ge=0)] | Literal["schedule"] = Field(
        ..., description="Slots per KV head of the recall buffer, in whole pages (0: the slow tier is kept but "
        "nothing comes back, so the policy attends what its eviction keeps), or `schedule`: as many as "
        "schedule.budget keeps (the policy then attends twice its budget, and an overridden budget carries "
        "the recall with it).",
    )
    page_size: int = Field(16, ge=1, le=4096, description="Evicted tokens per page (a page is recalled whole).")
    interval: int = Field(1, ge=1, description="Recall at every decode token whose count is a multiple of this.")
    scorer: ScorerSpec = Field(
        default_factory=QuestScorer,
        description="Ranks the slow tier's pages from their summaries (a scorer that declares recall_summaries: "
        "quest, landmark); default quest (key bounds).",
    )
    summaries: list[str] = Field(
        default_factory=list,
        description="Summary kinds to keep beyond what the scorer reads (key_min, key_max, key_mean).",
    )
    pages: Literal["position", "similar_keys"] = Field(
        "position",
        description="How an eviction's evicted tokens of a head are cut into pages: in position order, or "
        "similar keys together (median splits along the keys' principal direction), which tightens each "
        "page's summaries.",
    )
    summary_precision: Literal["keys", "int8"] = Field(
        "keys",
        description="How summaries are stored in the fast tier: in the keys' dtype, or int8 with one float32 "
        "scale per page and kind (a quarter of float32's bytes; bounds rounded outward, so Quest's bound "
        "stays a bound).",
    )
    capacity: int | None = Field(
        None, ge=1, description="Slow-tier slots per KV head, in whole pages (null: unbounded). When an eviction "
        "brings more, `drop` decides which pages go for good.",
    )
    drop: Literal["oldest", "lowest"] = Field(
        "oldest", description="Which pages a full slow tier drops: the oldest written, or the lowest scored at the "
        "last recall (pages not yet scored count as highest).",
    )

    @model_validator(mode="after")
    def _check(self) -> RecallConfig:
        if isinstance(self.budget, int):
            self._check_slots(self.budget)
        if self.capacity is not None and self.capacity % self.page_size:
            raise ValueError(f"recall.capacity {self.capacity} must be whole pages of recall.page_size {self.page_size}")
        unknown = sorted(set(self.summaries) - set(SUMMARIES))
        if unknown:
            raise ValueError(f"recall.summaries: unknown kind(s) {unknown}; known: {sorted(SUMMARIES)}")
        self._align_scorer_pages()
        reads = self.scorer.recall_summaries
        if not reads:
            raise ValueError(
                f"recall.scorer {self.scorer.type_name!r} cannot rank slow-tier pages: it declares no "
                "recall_summaries (use quest or landmark)"
            )
        missing = sorted(reads - set(SUMMARIES))
        if missing:
            raise ValueError(
                f"recall.scorer {self.scorer.type_name!r} reads summaries {missing} that no slow tier holds "
                f"(known: {sorted(SUMMARIES)})"
            )
        return self

    def _align_scorer_pages(self) -> None:
        """The slow tier's pages are ``page_size`` tokens, whatever a recall scorer's own
        ``page_size`` (quest's, landmark's) says: a different one written out is refused, one left
        to its default takes ``page_size``, so that the resolved policy says what it runs."""
        scorer = self.scorer
        if "page_size" not in type(scorer).model_fields or scorer.page_size == self.page_size:  # type: ignore[attr-defined]
            return
        if "page_size" in scorer.model_fields_set:
            raise ValueError(
                f"recall.scorer.page_size {scorer.page_size} differs from recall.page_size {self.page_size}: "  # type: ignore[attr-defined]
                "the slow tier's pages, which the recall scorer ranks, are recall.page_size tokens; drop "
                "recall.scorer.page_size or make the two equal"
            )
        object.__setattr__(self, "scorer", scorer.model_copy(update={"page_size": self.page_size}))

    def _check_slots(self, slots: int) -> None:
        p = self.page_size
        if 0 < slots < p:
            raise ValueError(f"recall.budget {slots} has no room for one page of {p} slots (recall.page_size)")
        if slots % p:
            raise ValueError(f"recall.budget {slots} must be whole pages of recall.page_size {p}")
        if self.capacity is not None and self.capacity < slots:
            raise ValueError(f"recall.capacity {self.capacity} is below recall.budget {slots}: the recall buffer "
                             "could never fill")

    def slots(self, schedule: Schedule) -> int:
        """The recall buffer's slots per KV head under ``schedule`` (a layer's, under an allocation)."""
        return schedule.budget if self.budget == "schedule" else self.budget

    @property
    def kept_summaries(self) -> frozenset[str]:
        """Every summary kind the slow tier keeps: the scorer's and the extra ones (``summaries``).
        Key bounds are not kept unless one of them reads them: they count in the fast tier's
        bytes, and a landmark recall would pay twice its own summaries for them."""
        return self.scorer.recall_summaries | frozenset(self.summaries)

    def check_policy(self, mode: str, sched: Schedule, allocation: Allocation, selector: Selector, merge: Merge) -> None:
        """Refuse, naming the field, a policy (its ``mode``, schedule and stages) this recall
        cannot serve (``PolicyConfig`` calls it)."""
        if mode == "select":
            raise ValueError("recall: select mode keeps every token and evicts nothing to recall; use mode: evict")
        if self.budget == "schedule":
            self._check_slots(sched.budget)
        elif self.budget > sched.budget:
            raise ValueError(
                f"recall.budget {self.budget} is larger than the fast tier's kept slots (schedule.budget "
                f"{sched.budget})"
            )
        if sched.interval % self.page_size:
            raise ValueError(
                f"recall.page_size {self.page_size} must divide schedule.interval {sched.interval}: each eviction "
                "after the prompt evicts that many tokens per head, in whole pages"
            )
        if sched.window < 1:
            raise ValueError("recall reads each step's query: set schedule.window to at least 1")
        if allocation.per_head or selector.sets_counts:
            name = allocation.type_name if allocation.per_head else selector.type_name
            raise ValueError(
                f"recall with {name!r}, whose heads keep different counts: not served yet (the slow tier pages "
                "each head's evictions alike); use a uniform allocation"
            )
        if allocation.uneven:  # a layer of a small budget would get a recall buffer of no whole pages, or above it
            raise ValueError(
                f"recall with allocation {allocation.type_name!r}, whose layers keep different budgets: not served yet "
                "(each layer's recall buffer and pages would have to follow its own budget); use a uniform allocation"
            )
        if merge.merges:
            raise ValueError(
                f"recall with merge {merge.type_name!r}: a merged value already stands for the tokens it "
                "absorbed, and recalling them would count them twice; use merge: drop"
            )
