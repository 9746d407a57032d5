"""Attention sinks: the first tokens of the sequence (StreamingLLM)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from .base import EvictionInput, Reservation


class SinksReservation(Reservation):
    """Protects the slots holding the first ``n`` real tokens of each row (padding excluded)."""

    type_name: ClassVar[str] = "sinks"
    reads_values: ClassVar[bool] = False

    n: int = Field(4, ge=0, le=1 << 24, description="Sink slots; at most 2**24, the largest budget.")

    def reserve(self, inp: EvictionInput, protected: torch.Tensor) -> torch.Tensor:
        return (inp.positions >= 0) & (inp.positions < self.n) & inp.slot_valid

    def reserved_count(self, budget: int) -> int:
        return self.n
