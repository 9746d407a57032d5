"""When eviction fires and how many slots it keeps: the numbers every policy file starts with."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .documents import refuse_lax_scalar

_RELATIVE = re.compile(r"^\s*budget\s*-\s*(\d+)\s*$")
#: Upper bound of every slot count of a schedule (16,777,216): far beyond any model's context,
#: and small enough that capacities and indices stay exact in float32 and int32 arithmetic.
MAX_SLOTS = 1 << 24

#: Where a step falls in a request's life, the one prompt rule every engine asks (``step_phase``):
#: ``"prefill"``, a chunk of the prompt that leaves some of it still to come (vLLM prefills long
#: prompts in chunks); ``"prompt"``, the step that completes the prompt; ``"decode"``, any later
#: step (a generated token, or a later turn's chunk fed after the prompt).
Phase = Literal["prefill", "prompt", "decode"]
PHASES: tuple[Phase, ...] = get_args(Phase)


def step_phase(before: int, after: int, prompt_len: int) -> Phase:
    """The phase of a step that took a request from ``before`` to ``after`` tokens computed,
    for a prompt of ``prompt_len`` tokens. A cache that sees the prompt as its first step has
    ``prompt_len`` = that step's length; vLLM knows each request's own. So a prompt prefilled in
    chunks has one ``"prompt"`` step, its last chunk, exactly as a prompt in one step has."""
    if before >= prompt_len:
        return "decode"
    return "prompt" if after >= prompt_len else "prefill"


class Schedule(BaseModel):
    """The decode-phase schedule of a policy.

    After each decoded token is appended, eviction fires when a layer holds ``L > budget`` slots
    and ``L % interval == 0`` (``count="slots"``; ``count="tokens"`` tests the tokens seen
    instead, as R-KV does: each row's own real tokens, so a padded row evicts as it would alone);
    a step of several tokens evicts at its end if, appended one at a time, they would have made it
    fire on the way. It keeps ``budget`` slots: the ``recent`` newest slots are never candidates and always kept;
    the ``L - recent`` older slots compete for the other ``budget - recent``. Attention scorers see the last ``window`` post-RoPE queries.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget: int = Field(
        ..., gt=0, le=MAX_SLOTS, description="Slots kept after an eviction, recent ones included (at most 2**24)."
    )
    recent: int = Field(
        64,
        ge=0,
        le=MAX_SLOTS,
        description='Newest slots always kept; an int or "budget - N" (StreamingLLM); at most 2**24.',
    )
    interval: int = Field(
        64, ge=1, le=MAX_SLOTS, description="Eviction fires when the count is a multiple of it (at most 2**24)."
    )
    window: int = Field(64, ge=0, le=MAX_SLOTS, description="Recent queries kept for attention scorers (at most 2**24).")
    count: Literal["slots", "tokens"] = "slots"
    evict_above: int | None = Field(
        None, ge=0, le=MAX_SLOTS,
        description='Slots held above which eviction fires (default: the budget); an int or "recent". A '
        "threshold selector (dms) sets it to the recent buffer: each token is decided once it leaves it, "
        "however few are held.",
    )
    compress_prompt: bool = Field(False, description="Compress a prompt longer than the budget once it is in.")

    @model_validator(mode="before")
    @classmethod
    def _resolve_relative_recent(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("recent"), str):
            m = _RELATIVE.match(data["recent"])
            if m is None:
                raise ValueError(f'recent must be an int or "budget - N", got {data["recent"]!r}')
            budget = data.get("budget")
            if isinstance(budget, int):
                data = {**data, "recent": budget - int(m.group(1))}
        if isinstance(data, dict) and data.get("evict_above") == "recent":  # follows an overridden recent
            data = {**data, "evict_above": data.get("recent", cls.model_fields["recent"].default)}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "recent" and isinstance(value, str):  # "budget - N" without an int budget
            return value  # pydantic reports it, beside the budget's own problem
        return refuse_lax_scalar(cls, info.field_name, value)

    @model_validator(mode="after")
    def _check(self) -> Schedule:
        if self.recent >= self.budget:
            raise ValueError(
                f"budget ({self.budget}) must be above the recent buffer ({self.recent}): "
                "otherwise no slot is ever a candidate"
            )
        if self.evict_above is not None and not self.recent <= self.evict_above <= self.budget:
            raise ValueError(
                f"evict_above ({self.evict_above}) must lie between the recent buffer ({self.recent}) and the "
                f"budget ({self.budget})"
            )
        if self.window > max(self.recent, 1) and self.window > self.interval:
            raise ValueError(
                f"window ({self.window}) is larger than the buffer (recent {self.recent}, interval "
                f"{self.interval}): the window's queries would belong to slots already evicted"
            )
        return self

    @property
    def fires_above(self) -> int:
        """Slots held above which eviction fires: ``evict_above``, else the budget."""
        return self.budget if self.evict_above is None else self.evict_above

    @property
    def capacity(self) -> int:
        """Slots a layer needs in steady state: eviction brings it back to ``budget``."""
        return self.capacity_for(0)

    def capacity_for(self, prompt_len: int) -> int:
        """Slots a layer needs when decoding after a prompt of ``prompt_len`` slots."""
        top = max(self.budget, prompt_len)
        if self.count == "slots":
            return (top // self.interval + 1) * self.interval
        return top + self.interval

    def due(self, slots: Any, tokens: Any, *, prompt: bool = False, added: Any = 1) -> Any:
        """The one "is an eviction due" rule, for ints or ``[B]`` long tensors alike.

        ``slots`` held after ``tokens`` real tokens seen, ``added`` of them by this step;
        ``prompt``: this step completed the prompt. Prefill never evicts unless the policy
        compresses a long prompt once it is in; after that, eviction fires when the counted
        number (slots, or tokens for ``count="tokens"``) is a multiple of ``interval`` while more
        than ``budget`` slots are held (``evict_above``, when set: a threshold's rows may hold
        fewer than the budget and still evict). A step of one token asks it at its end; a longer
        step evicts at its end if its tokens, appended one at a time, would have made it fire on
        the way (``tokens_to_eviction`` gives the chunk that ends exactly there). The caches, the
        evaluation loops and vLLM's slot ledger all ask this method.
        """
        if prompt:
            return (slots > self.fires_above) & self.compress_prompt
        counted = slots if self.count == "slots" else tokens
        last = counted - counted % self.interval  # the step's last multiple, if the step reached it
        # the most slots held at a multiple within the step: at the last one
        return (last > counted - added) & (slots - (counted - last) > self.fires_above)

    def step_due(self, slots: Any, tokens: Any, phase: Phase, added: Any = 1) -> Any:
        """``due`` after a step of ``phase`` (``step_phase``) that added ``added`` real tokens: a
        prefill chunk never evicts (the prompt is not in yet), the step completing the prompt
        evicts as ``due(prompt=True)``, a decode step as ``due``. Ints or ``[B]`` tensors, as ``due``."""
        if phase == "prefill":
            return (slots > self.fires_above) & False  # False, or a tensor of them shaped as slots
        return self.due(slots, tokens, prompt=phase == "prompt", added=added)

    def fires(self, slots: int, tokens: int) -> bool:
        """Whether a decode step leaving ``slots`` held after ``tokens`` positions evicts."""
        return bool(self.due(slots, tokens))

    def tokens_to_eviction(self, slots: int, tokens: int) -> int:
        """How many real tokens, appended one at a time after ``slots`` held and ``tokens`` seen,
        make eviction fire (at least 1): the end of the next exact chunk when feeding a text."""
        if self.count == "slots":
            target = -(-(max(slots, self.fires_above) + 1) // self.interval) * self.interval
            return target - slots
        first = self.interval - tokens % self.interval
        short = max(0, self.fires_above + 1 - slots - first)
        return first + -(-short // self.interval) * self.interval

