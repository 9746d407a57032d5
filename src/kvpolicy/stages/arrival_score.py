"""A scorer's score taken once, when a token arrives, and kept with the token (DMS's buffered score)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar, Literal

import torch

from .base import EvictionInput, Scorer, StateField
from .guards import run_scorer
from .spec import ScorerSpec

_STATE = {"score": StateField(torch.float32, 0.0), "scored": StateField(torch.float32, 0.0)}


class ArrivalScoreScorer(Scorer):
    """``scorer``'s score of each token, computed once, the first time the policy sees the token
    (at the eviction or choice after it arrived, while it is still in the recent buffer), then
    kept with it for good: later evictions rank by the buffered score, never a fresh one. This
    is DMS's rule as kvpress's ``DMSPress`` runs it (each token scored at arrival, decided once
    it leaves the protected window: ``threshold`` selector, ``dms`` policy).

    State (per slot, moved with its token): ``score`` float32, and ``scored`` (1.0 once the
    token was scored, 0.0 for a new one). Every valid slot is scored when first seen, the recent
    buffer's included, so the inner scorer must give a finite score on every valid slot, not
    only on the candidates (a query-free scorer such as ``key_norm`` does; a non-finite one is a
    ``SelectionError`` naming it). For a query-free scorer the score at arrival is the score at
    any time, so the buffer changes nothing but the work; for a scorer that reads the window,
    "arrival" is the first eviction after the token came, with the window as it is then.
    """

    type_name: ClassVar[str] = "arrival_score"
    reads_values: ClassVar[bool] = False
    state_updates: ClassVar[Literal["every_query", "eviction"]] = "eviction"

    scorer: ScorerSpec

    @property
    def may_be_negative(self) -> bool:
        return self.scorer.may_be_negative

    @property
    def heads_alike(self) -> bool:
        return self.scorer.heads_alike

    @property
    def state_fields(self) -> Mapping[str, StateField]:
        return _STATE

    def update_state(self, inp: EvictionInput) -> Mapping[str, torch.Tensor]:
        state = inp.state_of(self)
        new = inp.slot_valid & (state["scored"] == 0)
        if not bool(new.any()):
            return {"score": state["score"], "scored": state["scored"]}
        every_slot = replace(inp, num_candidates=inp.num_slots)  # the recent buffer's tokens have arrived too
        fresh = run_scorer(self.scorer, every_slot, where=f" (in scorer {self.type_name!r})").float()
        return {
            "score": torch.where(new, fresh, state["score"]),
            "scored": torch.where(new, torch.ones_like(state["scored"]), state["scored"]),
        }

    def score(self, inp: EvictionInput) -> torch.Tensor:
        return inp.state_of(self)["score"]
